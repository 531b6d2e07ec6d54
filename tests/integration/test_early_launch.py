"""A worker started early (``servegate run`` starts it before Prefect and the flow are up) and the launch
that adopts it, against real processes: the stand-in server script of test_launch as the engine."""

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

from servegate.config import GateConfig, WorkerSpec
from servegate.launch import discard_early, launch_worker, start_early
from servegate.proctree import terminate_tree
from servegate.runstate import DEVICE_SLOT_ENV, remove_stale_early_logs, start_worker_early

from test_launch import StandInEngine

pytestmark = pytest.mark.timeout(60)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(condition: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_launch_adopts_the_early_process_and_its_startup_is_the_workers_own(tmp_path: Path) -> None:
    engine = StandInEngine("--ready-after", "0.5")
    spec = WorkerSpec(engine="embedded", ready_timeout_s=30)
    early_log = tmp_path / "out" / ".worker.log"
    early = start_early(spec, early_log, engine=engine)
    assert early is not None and early.is_alive()
    _wait(lambda: early.startup_s is not None)  # readiness is probed from the start, not at adoption
    ready_after = early.startup_s
    time.sleep(2.0)  # the gate's own set-up, which the worker's start-up overlapped

    log = tmp_path / "out" / "run" / "worker.log"
    with launch_worker(spec, log, engine=engine) as handle:
        assert handle is early and handle.pid == early.pid  # adopted, not a second process
        assert handle.launch_note is not None and handle.launch_note.startswith(
            f"adopted the worker process started early (pid {early.pid}, "), handle.launch_note
        assert handle.startup_s == ready_after and handle.startup_s < time.perf_counter() - handle.started - 1.9
        assert requests.get(handle.base_url + "/health_generate", timeout=5).status_code == 200
    assert _gone(early.pid)
    assert not early_log.exists()
    text = log.read_text()  # the early process's whole log, moved into the run folder
    assert text.count("# servegate: launching embedded:") == 1 and "fake engine starting" in text


def test_a_launch_of_another_worker_stops_the_early_process(tmp_path: Path) -> None:
    early_log = tmp_path / ".worker.log"
    early = start_early(WorkerSpec(model="tiny-random"), early_log, engine=StandInEngine())
    assert early is not None
    with launch_worker(WorkerSpec(model="smollm2-135m"), tmp_path / "worker.log", ready_timeout_s=30,
                       engine=StandInEngine()) as handle:
        assert handle.pid != early.pid
        assert _gone(early.pid) and not early_log.exists()
        assert handle.launch_note == (f"the worker process started early (pid {early.pid}) was not adopted: it was "
                                      f"started for a different launch; this launch started a fresh one")
    with launch_worker(WorkerSpec(), tmp_path / "plain.log", ready_timeout_s=30, engine=StandInEngine()) as plain:
        assert plain.launch_note is None  # nothing started early: a plain start, nothing to say


def test_an_early_process_that_exits_fails_the_launch_with_its_log(tmp_path: Path) -> None:
    engine = StandInEngine("--exit-code", "3")
    early = start_early(WorkerSpec(), tmp_path / ".worker.log", engine=engine)
    assert early is not None
    from servegate.errors import WorkerLaunchError

    with pytest.raises(WorkerLaunchError, match="exit code 3") as info:
        launch_worker(WorkerSpec(), tmp_path / "run" / "worker.log", engine=engine)
    assert str(tmp_path / "run" / "worker.log") in str(info.value) and "could not load the model" in str(info.value)


def test_discard_stops_an_unadopted_process_and_deletes_its_log(tmp_path: Path) -> None:
    early_log = tmp_path / ".worker.log"
    early = start_early(WorkerSpec(), early_log, engine=StandInEngine())
    assert early is not None and early_log.is_file()
    discard_early()
    assert _gone(early.pid) and not early_log.exists()
    discard_early()  # nothing left: a no-op


def test_nothing_starts_early_when_the_gate_would_not_launch(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def config(**sections: object) -> GateConfig:
        return GateConfig.model_validate({"output_dir": str(tmp_path), **sections})

    # A gate killed with SIGKILL before its launch left its early log; the next gate in the folder removes it.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    (tmp_path / f".worker-{dead.pid}.log").write_text("a killed gate's worker log\n")
    assert start_worker_early(config())  # the gate would launch its worker: it starts now
    assert [p.name for p in tmp_path.iterdir()] == [f".worker-{os.getpid()}.log"]
    discard_early()
    no_gate_worker = {name: {"enabled": False} for name in ("one_batch", "serving", "occupancy", "quality", "capacity")}
    assert not start_worker_early(config(**no_gate_worker))  # only the paired stage's own workers would run
    assert not start_worker_early(config(worker={"engine": "external", "url": "http://127.0.0.1:9"}))
    monkeypatch.setenv(DEVICE_SLOT_ENV, "box-gpu0")
    assert not start_worker_early(config())  # the device is not the gate's before it holds the slot
    assert list(tmp_path.iterdir()) == []


def test_a_launch_that_cannot_be_made_early_is_left_to_the_launch_stage(tmp_path: Path) -> None:
    # The head start never reports an error itself: the gate reports it where it always has, with its
    # advice (the run folder for a full or read-only disk, the launch stage for an engine not installed).
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    config = GateConfig.model_validate({"output_dir": str(read_only / "runs")})
    if os.access(read_only, os.W_OK):  # root writes anywhere: a file where the folder should be instead
        config = GateConfig.model_validate({"output_dir": str(tmp_path / "file" / "runs")})
        (tmp_path / "file").write_text("not a folder")
    assert not start_worker_early(config)
    missing = GateConfig.model_validate({"output_dir": str(tmp_path / "runs"),
                                         "worker": {"engine": "vllm", "python": "vllm-cpu-9.9.9"}})
    assert not start_worker_early(missing)
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []
    discard_early()  # nothing was started: a no-op


def test_only_the_early_logs_of_gates_that_are_gone_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    names = [f".worker-{dead.pid}.log", f".worker-{os.getppid()}.log", ".worker-x.log", "worker-1.log"]
    for name in names:
        (tmp_path / name).write_text("log\n")
    assert remove_stale_early_logs(tmp_path) == [tmp_path / names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])  # a live gate's log, and not ours


GATE_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests_dir!r})
    from test_launch import StandInEngine
    from servegate.config import WorkerSpec
    from servegate.launch import start_early
    out = Path({out!r})
    handle = start_early(WorkerSpec(), out / ".worker.log",
                         engine=StandInEngine("--spawn", "--pid-file", str(out / "pids")))
    (out / "worker_pid").write_text(str(handle.pid))
    while True:
        time.sleep(0.1)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill-9"])
def test_the_gate_ending_before_the_launch_leaves_no_early_worker(tmp_path: Path, sig: signal.Signals) -> None:
    # The gate ended between its start and its launch stage (Prefect still starting): SIGTERM runs the
    # exit hooks, SIGKILL leaves it to the guardian.
    script = GATE_SCRIPT.format(tests_dir=str(Path(__file__).parent), out=str(tmp_path))
    gate = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    pids: list[int] = []
    try:
        _wait(lambda: (tmp_path / "pids").is_file() and (tmp_path / "pids").read_text().endswith("\n"))
        pids = [int((tmp_path / "worker_pid").read_text()), *(int(x) for x in (tmp_path / "pids").read_text().split())]
        gate.send_signal(sig)
        gate.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids), f"{[p for p in pids if not _gone(p)]} outlived the gate's {sig.name}"
    finally:
        for pid in pids:
            if not _gone(pid):
                terminate_tree(pid, timeout_s=5)
        if gate.poll() is None:
            terminate_tree(gate.pid, timeout_s=5)
            gate.wait(timeout=5)
        if gate.stdout:
            gate.stdout.close()
