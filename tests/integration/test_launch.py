"""launch_worker / WorkerHandle against real processes: a stand-in server script as the engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import requests

from servegate.config import WorkerSpec
from servegate.engines import EmbeddedEngine
from servegate.errors import ConfigError, WorkerDiedError, WorkerLaunchError, WorkerOOMError
from servegate.launch import launch_worker
from servegate.proctree import terminate_tree

from fake_servers import FakeServer

FAKE_ENGINE = Path(__file__).with_name("fake_engine_server.py")

pytestmark = pytest.mark.timeout(60)


class StandInEngine(EmbeddedEngine):
    """The embedded engine's protocol, but launching the stand-in script with test flags."""

    def __init__(self, *flags: str) -> None:
        self.flags = list(flags)

    def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
        return [sys.executable, str(FAKE_ENGINE), "--port", str(port), *self.flags]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_ready_worker_answers_and_stop_ends_it(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "worker.log"
    spec = WorkerSpec(engine="embedded", port=0)
    with launch_worker(spec, log, ready_timeout_s=30, engine=StandInEngine("--ready-after", "0.5")) as handle:
        assert handle.is_alive() and handle.returncode is None
        assert handle.base_url.startswith("http://127.0.0.1:")
        assert requests.get(handle.base_url + "/health_generate", timeout=5).status_code == 200
        handle.check_alive()  # no exception while running
        pid = handle.pid
    assert not handle.is_alive()
    assert handle.returncode == -signal.SIGTERM
    assert _gone(pid)
    text = log.read_text()
    assert "# servegate: launching embedded:" in text and "fake engine starting" in text
    handle.stop()  # idempotent


def test_early_exit_is_a_launch_error_with_log_tail(tmp_path: Path) -> None:
    with pytest.raises(WorkerLaunchError) as info:
        launch_worker(WorkerSpec(), tmp_path / "w.log", ready_timeout_s=30, engine=StandInEngine("--exit-code", "3"))
    assert not isinstance(info.value, WorkerOOMError)
    msg = str(info.value)
    assert "exit code 3" in msg
    assert "fake engine could not load the model" in msg  # the log tail
    assert str(tmp_path / "w.log") in msg


def test_sigkill_at_startup_is_reported_as_oom_with_budget(tmp_path: Path) -> None:
    spec = WorkerSpec(memory_profile="cpu-small")
    with pytest.raises(WorkerOOMError) as info:
        launch_worker(spec, tmp_path / "w.log", ready_timeout_s=30, engine=StandInEngine("--self-kill"))
    msg = str(info.value)
    assert "SIGKILL" in msg and "OOM" in msg
    assert "max_total_tokens=16384" in msg and "max_running_requests=16" in msg
    assert "lower it (max_total_tokens, max_running_requests)" in msg  # the engine's OOM knobs
    assert "'cpu-small'" in msg
    assert "allocating KV cache" in msg  # log tail


def test_ready_timeout_fails_and_tears_down(tmp_path: Path) -> None:
    started = []

    class Recording(StandInEngine):
        def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
            started.append(port)
            return super().launch_command(spec, port)

    with pytest.raises(WorkerLaunchError, match=r"not ready after 1 s.*ready_timeout_s"):
        launch_worker(WorkerSpec(), tmp_path / "w.log", ready_timeout_s=1, engine=Recording("--never-ready"))
    # Nothing listens on the worker's port any more: the process was ended.
    port = started[0]
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health_generate", timeout=2)


def test_stop_ends_children_orphans_and_term_ignoring_processes(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    engine = StandInEngine("--spawn", "--stubborn", "--pid-file", str(pid_file))
    handle = launch_worker(WorkerSpec(), tmp_path / "w.log", ready_timeout_s=30, engine=engine)
    child, orphan, stubborn = (int(x) for x in pid_file.read_text().split())
    worker = psutil.Process(handle.pid)
    descendants = {p.pid for p in worker.children(recursive=True)}
    assert {child, stubborn} <= descendants
    assert orphan not in descendants  # reparented: only the process group still ties it to the worker
    assert os.getpgid(orphan) == handle.pid
    handle.stop(timeout_s=1)
    for pid in (handle.pid, child, stubborn, orphan):
        assert _gone(pid), f"pid {pid} survived stop()"


def test_check_alive_raises_when_worker_dies(tmp_path: Path) -> None:
    with launch_worker(WorkerSpec(), tmp_path / "w.log", ready_timeout_s=30, engine=StandInEngine()) as handle:
        os.kill(handle.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while handle.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(WorkerDiedError, match=r"exit code -9.*OOM"):
            handle.check_alive()


def test_missing_executable_is_a_launch_error(tmp_path: Path) -> None:
    spec = WorkerSpec(python=str(tmp_path / "no-such-python"))
    with pytest.raises(WorkerLaunchError, match="worker.python"):
        launch_worker(spec, tmp_path / "w.log", ready_timeout_s=5)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_bad_ready_timeout_is_a_config_error(tmp_path: Path, bad: float) -> None:
    with pytest.raises(ConfigError, match="ready_timeout_s"):
        launch_worker(WorkerSpec(), tmp_path / "w.log", ready_timeout_s=bad)


def test_external_attaches_via_v1_models_when_no_health_route(tmp_path: Path) -> None:
    with FakeServer() as srv:
        srv.state.routes_missing = {"/health"}
        handle = launch_worker(WorkerSpec(engine="external", url=srv.url + "/"), tmp_path / "w.log",
                               ready_timeout_s=10)
        assert handle.pid is None and handle.is_alive() and handle.base_url == srv.url
        assert [r.path for r in srv.state.requests] == ["/health", "/v1/models"]
        handle.check_alive()
        handle.stop()


def test_external_not_ready_times_out(tmp_path: Path) -> None:
    with FakeServer() as srv:
        srv.state.routes_missing = {"/health", "/v1/models"}
        with pytest.raises(WorkerLaunchError, match="not ready after"):
            launch_worker(WorkerSpec(engine="external", url=srv.url), tmp_path / "w.log", ready_timeout_s=1)


GATE_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests_dir!r})
    from test_launch import StandInEngine
    from servegate.config import WorkerSpec
    from servegate.launch import launch_worker
    out = Path({out!r})
    handle = launch_worker(WorkerSpec(), out / "w.log", ready_timeout_s=30,
                           engine=StandInEngine("--spawn", "--pid-file", str(out / "pids")))
    (out / "worker_pid").write_text(str(handle.pid))
    while True:
        time.sleep(0.1)
""")


def _start_gate(tmp_path: Path, **popen: object) -> tuple[subprocess.Popen, list[int]]:
    """The gate script with its worker up: the gate process and the worker tree's pids."""
    script = GATE_SCRIPT.format(tests_dir=str(Path(__file__).parent), out=str(tmp_path))
    gate = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            **popen)
    deadline = time.monotonic() + 30
    while not (tmp_path / "worker_pid").exists():
        assert gate.poll() is None, gate.stdout.read().decode() if gate.stdout else ""
        assert time.monotonic() < deadline, "gate did not launch its worker"
        time.sleep(0.05)
    worker = int((tmp_path / "worker_pid").read_text())
    return gate, [worker, *(int(x) for x in (tmp_path / "pids").read_text().split())]


def test_sigterm_to_the_gate_ends_the_worker_tree(tmp_path: Path) -> None:
    gate, pids = _start_gate(tmp_path)
    try:
        gate.send_signal(signal.SIGTERM)
        assert gate.wait(timeout=30) == 128 + signal.SIGTERM
        for pid in pids:
            assert _gone(pid), f"pid {pid} survived the gate's SIGTERM"
    finally:
        if gate.poll() is None:
            terminate_tree(gate.pid, timeout_s=5)
            gate.wait(timeout=5)
        if gate.stdout:
            gate.stdout.close()


def _all_gone_within(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if not _gone(p)]
    return alive


@pytest.mark.parametrize("kill_group", [False, True], ids=["kill-9-gate", "kill-9-gate-group"])
def test_sigkill_of_the_gate_leaves_no_worker(tmp_path: Path, kill_group: bool) -> None:
    # Nothing in the gate runs after SIGKILL; its guardian (own session, so a group kill as a CI
    # runner's timeout sends misses it) ends the worker's tree once the gate is gone.
    gate, pids = _start_gate(tmp_path, start_new_session=True)
    try:
        guardians = [p for p in psutil.Process(gate.pid).children()
                     if "servegate.proctree" in " ".join(p.cmdline())]
        assert len(guardians) == 1, [p.cmdline() for p in psutil.Process(gate.pid).children()]
        if kill_group:
            os.killpg(gate.pid, signal.SIGKILL)
        else:
            gate.kill()
        assert gate.wait(timeout=10) == -signal.SIGKILL
        survivors = _all_gone_within(pids, 30)
        assert not survivors, f"pids {survivors} outlived the gate's SIGKILL"
        assert not _all_gone_within([guardians[0].pid], 10), "the guardian did not exit after its work"
    finally:
        for pid in pids:
            if not _gone(pid):
                terminate_tree(pid, timeout_s=5)
        if gate.stdout:
            gate.stdout.close()


def test_terminate_tree_ends_a_process_and_its_children(tmp_path: Path) -> None:
    code = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        assert kids
        terminate_tree(parent.pid, timeout_s=5)
        assert parent.wait(timeout=5) == -signal.SIGTERM
        assert all(_gone(k) for k in kids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.timeout(240)
def test_real_embedded_worker_launch_warmup_flush_stop(tmp_path: Path) -> None:
    """The real embedded worker (tiny random model): launch, warm up, flush, read capacity, stop."""
    pytest.importorskip("servegate.worker.cli", reason="the embedded worker's CLI is not in this tree yet")
    from servegate.bench.flush import flush_until_idle
    from servegate.bench.warmup import run_warmup
    from servegate.config import FlushConfig, WarmupConfig
    from servegate.errors import ModelUnavailableError
    from servegate.http import make_session
    from servegate.models import ensure_model

    try:
        model_dir = ensure_model("tiny-random", allow_fetch=False)
    except ModelUnavailableError as exc:
        pytest.skip(f"tiny-random model not cached: {exc}")
    spec = WorkerSpec(engine="embedded", model=str(model_dir), memory_profile="cpu-small")
    with launch_worker(spec, tmp_path / "worker.log", ready_timeout_s=180) as handle:
        assert run_warmup(handle.base_url, handle.engine, WarmupConfig(num_requests=2, max_new_tokens=8)) == 2
        flush_until_idle(handle.base_url, handle.engine, FlushConfig(timeout_s=10))
        cap = handle.engine.server_capacity(make_session(), handle.base_url)
        assert cap.token_capacity == 16384
        handle.check_alive()
        pids = [handle.pid, *(p.pid for p in psutil.Process(handle.pid).children(recursive=True))]
    assert all(_gone(pid) for pid in pids)
