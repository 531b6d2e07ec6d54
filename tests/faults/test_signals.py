"""Signals at every stage: TERM, INT, KILL of the gate and of its whole process group.

A pipeline cancels a job with SIGTERM (or SIGINT from a terminal, which reaches the whole
foreground group), and a CI runner's timeout SIGKILLs the job's process group. Whatever the
moment: exit 2 (could not decide) within seconds, with a one-line reason where the gate can
still speak, no process left behind, the history database intact with the run absent (it was
not decided), and what was measured kept in the run folder. The same for a paired calibration,
whose every decision is a gate flow inside the calibration's flow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultutil import (REPO, db_state, gate_env, run_folder, stage_status, start_gate, survivors,
                       wait_for_stage)

pytestmark = [pytest.mark.gate, pytest.mark.timeout(420)]


@pytest.fixture(autouse=True, scope="module")
def _gates_start_with_sigint_at_its_default():
    """A test run started in the background by a shell without job control (`cmd &` in a script) inherits
    SIGINT ignored, and so would every gate started here: Python then installs no KeyboardInterrupt handler and
    the gate keeps ignoring SIGINT, as a background job should. The SIGINT scenarios are a foreground job's
    (Ctrl-C, a runner's cancellation), so while they run this process catches SIGINT: its children start with
    it at its default. Restored afterwards, for the rest of the test run."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


SCENARIOS = [
    ("launch", signal.SIGTERM, "gate"),
    ("one_batch", signal.SIGTERM, "gate"),
    ("serving", signal.SIGTERM, "gate"),
    ("occupancy", signal.SIGTERM, "gate"),
    ("one_batch", signal.SIGINT, "gate"),
    ("serving", signal.SIGINT, "gate"),
    ("launch", signal.SIGKILL, "group"),
    ("serving", signal.SIGKILL, "gate"),
    ("serving", signal.SIGKILL, "group"),
    ("serving", signal.SIGTERM, "group"),
    ("serving", signal.SIGINT, "group"),
]


@pytest.mark.parametrize(("stage", "sig", "target"), SCENARIOS,
                         ids=[f"{s.name}-{t}-during-{st}" for st, s, t in SCENARIOS])
def test_signal_during_a_stage(tmp_path, stage: str, sig: signal.Signals, target: str) -> None:
    gate = start_gate(tmp_path, own_prefect=True)
    try:
        wait_for_stage(gate, tmp_path, stage)
    except BaseException:
        _kill(gate)
        raise
    stderr, took = _signal_and_wait(gate, sig, group=target == "group", timeout_s=180)

    if sig == signal.SIGKILL:
        assert gate.returncode == -signal.SIGKILL
    else:
        assert gate.returncode == 2, f"exit {gate.returncode}, wanted 2 (could not decide)\nstderr:\n{stderr[-4000:]}"
        assert took < 45, f"the gate took {took:.0f} s to end after the signal\nstderr:\n{stderr[-4000:]}"
        reason = [line for line in stderr.splitlines() if line.startswith("servegate:")]
        assert reason and ("terminated" in reason[-1] or "interrupted" in reason[-1]), stderr[-4000:]
        assert "Traceback" not in stderr, stderr[-4000:]
        stages = stage_status(tmp_path)
        if stage != "launch":
            assert stages[stage]["status"] == "failed" and "interrupted" in stages[stage]["error"], stages
            assert "internal error" not in stages[stage]["error"], stages[stage]
            measured_before = {"one_batch": [], "serving": ["one_batch.csv"],
                               "occupancy": ["one_batch.csv", "serving_requests.csv"]}[stage]
            for name in measured_before:
                assert (run_folder(tmp_path) / name).is_file(), f"{name} measured before {stage} was lost"

    left = survivors(tmp_path, within_s=30)
    assert not left, "processes outlived the gate:\n" + "\n".join(left)
    db = db_state(tmp_path)
    assert db.integrity in (None, "ok"), db
    assert db.runs == 0, f"an interrupted run was recorded as decided: {db}"


# `servegate calibrate --paired` on the tiny model: each decision is a paired gate flow inside the calibration
# flow, two workers at once, restarted every 2 rounds, rounds until decided (300 s at most, never reached: the
# signal comes first).
CALIBRATE_TINY = ["worker.model=tiny-random", "baseline.model=tiny-random",
                  'worker.extra_args=["--fault-decode-delay-ms","20"]',
                  'baseline.extra_args=["--fault-decode-delay-ms","20"]',
                  "paired.min_rounds=3", "paired.min_units=3", "paired.max_rounds=40", "paired.max_measure_s=300",
                  "paired.rounds_per_worker=2", "paired.confirm=false"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_group_of_a_paired_calibration_ends_it_at_once(tmp_path, sig: signal.Signals) -> None:
    # The signal reaches every process of the group, as from a CI job's cancellation, GNU `timeout` or Ctrl-C in
    # a terminal. Prefect's temporary API server used to be in that group: it stopped at once, and both nested
    # flows' crash reports were retried against it with back-off (> 150 s) while the round's workers ran on.
    cmd = [sys.executable, "-m", "servegate", "calibrate", "--profile", "smoke-ab", "--paired", "--aa-runs", "3",
           "--slowdowns", "", "--output-dir", str(tmp_path / "calibration"), "--no-record",
           *[a for s in CALIBRATE_TINY for a in ("--set", s)]]
    gate = subprocess.Popen(cmd, cwd=REPO, env=gate_env(tmp_path, own_prefect=True), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        run_dir = _wait_for(gate, lambda: _both_workers_up(tmp_path / "calibration" / "runs"),
                            "a decision's two workers", timeout_s=300)
        time.sleep(4)  # inside the rounds (~2 s each)
    except BaseException:
        _kill(gate)
        raise
    stderr, took = _signal_and_wait(gate, sig, group=True, timeout_s=120)

    assert gate.returncode == 2, f"exit {gate.returncode}, wanted 2 (could not decide)\nstderr:\n{stderr[-4000:]}"
    assert took < 45, f"the calibration took {took:.0f} s to end after the signal\nstderr:\n{stderr[-4000:]}"
    reason = [line for line in stderr.splitlines() if line.startswith("servegate:")]
    assert reason and ("terminated" in reason[-1] or "interrupted" in reason[-1]), stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    paired = json.loads((run_dir / "stages.json").read_text())["paired"]
    assert paired["status"] == "failed" and "interrupted" in paired["error"], paired
    counted = tmp_path / "calibration" / "runs.json"  # the decisions made; a resumed calibration goes on from them
    assert not counted.exists() or str(run_dir) not in counted.read_text(), "an interrupted decision was counted"
    left = survivors(tmp_path, within_s=30)
    assert not left, "processes outlived the calibration:\n" + "\n".join(left)


def _signal_and_wait(gate: subprocess.Popen, sig: signal.Signals, *, group: bool,
                     timeout_s: float) -> tuple[str, float]:
    """Send ``sig`` to the command (or its whole process group) and wait for it to end: its stderr and
    the seconds it took after the signal. Killed with its group if it outlives ``timeout_s``."""
    try:
        if group:
            os.killpg(gate.pid, sig)
        else:
            gate.send_signal(sig)
        signalled = time.monotonic()
        _, stderr = gate.communicate(timeout=timeout_s)
        return stderr, time.monotonic() - signalled
    finally:
        _kill(gate)


def _kill(gate: subprocess.Popen) -> None:
    if gate.poll() is None:
        os.killpg(gate.pid, signal.SIGKILL)
        gate.wait()


def _both_workers_up(runs: Path) -> Path | None:
    """The run folder of the decision whose candidate and baseline workers both serve, if any."""
    for run_dir in sorted(runs.glob("*")) if runs.is_dir() else []:
        logs = [run_dir / "worker.log", run_dir / "baseline-worker.log"]
        if all(log.is_file() and "Uvicorn running" in log.read_text(errors="replace") for log in logs):
            return run_dir
    return None


def _wait_for(gate: subprocess.Popen, found, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gate.poll() is not None:
            raise AssertionError(f"the command exited ({gate.returncode}) before {what}:\n{gate.stderr.read()[-3000:]}")
        if result := found():
            return result
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s} s")
