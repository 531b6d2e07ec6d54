"""What ``servegate run`` does before its flow, overlapped: Prefect's temporary API server started in a
thread while GX loads the suites (``servegate.runstate.prefect_api_starting``, ``check_suites``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from servegate.config import GateConfig
from servegate.errors import ConfigError
from servegate.runstate import check_suites

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2eutil import gate_env, marked_processes, survivors  # noqa: E402

pytestmark = pytest.mark.timeout(120)

START = textwrap.dedent("""
    from servegate.errors import InfraError
    from servegate.runstate import prefect_api_starting
    try:
        with prefect_api_starting():
            pass
    except InfraError as exc:
        print("InfraError:", exc)
    else:
        print("started")
""")


@pytest.mark.gate
def test_a_prefect_server_that_does_not_start_is_an_infra_error_and_leaves_no_process(tmp_path: Path) -> None:
    # 1 s is far too short for the server's start (8-14 s here): Prefect gives up, servegate says what to do.
    env = {**gate_env(tmp_path, own_prefect=True), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"}
    out = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("InfraError: Timed out while attempting to connect to ephemeral Prefect API"), out
    assert "Set PREFECT_API_URL to a running `prefect server start`" in out.stdout
    # The guardian's grace (30 s), should Prefect's own atexit stop miss it.
    assert not survivors(tmp_path, 30, "uvicorn"), "Prefect's server outlived the command"


@pytest.mark.gate
def test_with_a_running_server_named_nothing_starts(tmp_path: Path) -> None:
    env = {**gate_env(tmp_path), "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # never asked: nothing listens
    out = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=100)
    assert out.stdout.strip() == "started", out.stderr[-3000:]
    assert not marked_processes(tmp_path, "uvicorn")


@pytest.mark.gate
def test_a_server_waits_for_another_gate_starting_one_in_the_same_prefect_home(tmp_path: Path) -> None:
    # Gates started at once share PREFECT_HOME's SQLite database; two servers starting side by side
    # collided there ("UNIQUE constraint failed: block_type.slug", stop 26's CI). While another holds
    # the start lock, no server process appears; once it is released, the server starts.
    from filelock import FileLock

    env = gate_env(tmp_path, own_prefect=True)
    home = Path(env["PREFECT_HOME"])
    home.mkdir(parents=True)
    lock = FileLock(home / "servegate-api-start.lock")
    lock.acquire()
    proc = subprocess.Popen([sys.executable, "-c", START], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20  # longer than a server's start here (8-14 s)
        while time.monotonic() < deadline:
            assert not marked_processes(tmp_path, "uvicorn"), "a server started while the lock was held"
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
    finally:
        lock.release()
    out, err = proc.communicate(timeout=90)
    assert out.strip() == "started", err[-3000:]


def test_check_suites_fails_a_paired_gate_without_a_paired_suite(tmp_path: Path) -> None:
    config = GateConfig.model_validate({"baseline": {"engine": "external", "url": "http://127.0.0.1:9"},
                                        "output_dir": str(tmp_path)})
    assert config.is_paired
    with pytest.raises(ConfigError, match="none for the 'paired' table"):
        check_suites(config)
    check_suites(GateConfig.model_validate({"output_dir": str(tmp_path)}))  # smoke's suites load
    assert os.listdir(tmp_path) == []
