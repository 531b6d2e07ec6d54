"""The fork server (servegate/worker/forkserver.py): each worker a fork of a parent that imported torch and
transformers once, a whole worker all the same, and none left behind when the owner stops or dies."""

from __future__ import annotations

import json
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
from workerutil import TINY_ARGS, free_port, generate

from servegate.proctree import wait_gone
from servegate.worker.forkserver import ForkedWorker, ForkServer

pytestmark = pytest.mark.timeout(180)


def _wait_ready(url: str, worker, timeout_s: float = 60) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert worker.poll() is None, f"the forked worker exited with {worker.returncode}"
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except requests.ConnectionError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"not ready after {timeout_s} s")


def test_a_fork_is_a_whole_worker_in_a_session_of_its_own_with_the_environment_it_was_given(tmp_path: Path) -> None:
    server = ForkServer(tmp_path)
    try:
        port = free_port()
        log = tmp_path / "worker.log"
        env = {**os.environ, "SERVEGATE_FAULT_DECODE_SLOWDOWN_PCT": "50"}
        worker = server.spawn(["--host", "127.0.0.1", "--port", str(port), *TINY_ARGS], env=env, log_path=log)
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, worker)
        proc = psutil.Process(worker.pid)
        assert proc.ppid() == server.process.pid  # a fork of the server, not a new interpreter
        assert os.getsid(worker.pid) == worker.pid  # its own session (its group is its tree)
        assert requests.get(url + "/get_server_info", timeout=10).json()["faults"] == {"decode_slowdown_pct": 50.0}
        assert generate(url, {"text": "x", "sampling_params": {"max_new_tokens": 3}}).status_code == 200
        assert "fault injection active" in log.read_text()  # the worker's own log lines, in its own file
        worker.terminate()
        assert worker.wait(30) == -signal.SIGTERM  # as subprocess.Popen reports it
        with pytest.raises(RuntimeError, match="not a child of this fork server"):
            ForkedWorker(server, os.getpid(), []).poll()
        # A usage error ends the child with argparse's status 2, before anything loads.
        bad = server.spawn(["--no-such-flag"], env=env, log_path=tmp_path / "bad.log")
        assert bad.wait(30) == 2 and "unrecognized arguments" in (tmp_path / "bad.log").read_text()
        # stop() ends a worker still running
        port = free_port()
        running = server.spawn(["--port", str(port), *TINY_ARGS], env=env, log_path=tmp_path / "running.log")
        _wait_ready(f"http://127.0.0.1:{port}", running)
        kept = psutil.Process(running.pid)
    finally:
        server.stop()
    assert not wait_gone([kept], 10), "stop() left a worker running"
    assert server.process.returncode == 0 and not server.socket_path.exists()


def test_when_its_owner_is_killed_the_fork_server_ends_its_workers_and_itself(tmp_path: Path) -> None:
    port = free_port()
    owner_script = textwrap.dedent(f"""
        import json, os, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from workerutil import TINY_ARGS
        from servegate.worker.forkserver import ForkServer
        server = ForkServer(Path({str(tmp_path)!r}))
        worker = server.spawn(["--port", "{port}", *TINY_ARGS], env=dict(os.environ),
                              log_path=Path({str(tmp_path / "w.log")!r}))
        print(json.dumps({{"server": server.process.pid, "worker": worker.pid}}), flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_script], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        _wait_ready(f"http://127.0.0.1:{port}", _Alive(pids["worker"]))
        procs = [psutil.Process(pids["server"]), psutil.Process(pids["worker"])]
        owner.send_signal(signal.SIGKILL)  # no finally of the owner runs
        owner.wait(10)
        assert not wait_gone(procs, 20), "the fork server or its worker outlived the owner"
    finally:
        owner.kill()
        owner.wait(10)


class _Alive:
    """``poll`` for a process that is not ours to wait for."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return None if psutil.pid_exists(self.pid) else -1
