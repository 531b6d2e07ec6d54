"""Signals at every stage: TERM, INT, KILL of the gate and KILL of its whole process group.

A pipeline cancels a job with SIGTERM (or SIGINT from a terminal), and a CI runner's timeout
SIGKILLs the job's process group. Whatever the moment: exit 2 (could not decide) with a
one-line reason where the gate can still speak, no process left behind, the history database
intact with the run absent (it was not decided), and what was measured kept in the run folder.
"""

from __future__ import annotations

import os
import signal

import pytest
from faultutil import db_state, run_folder, stage_status, start_gate, survivors, wait_for_stage

pytestmark = [pytest.mark.timeout(420)]

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
]


@pytest.mark.parametrize(("stage", "sig", "target"), SCENARIOS,
                         ids=[f"{s.name}-{t}-during-{st}" for st, s, t in SCENARIOS])
def test_signal_during_a_stage(tmp_path, stage: str, sig: signal.Signals, target: str) -> None:
    gate = start_gate(tmp_path)
    try:
        wait_for_stage(gate, tmp_path, stage)
        if target == "group":
            os.killpg(gate.pid, sig)
        else:
            gate.send_signal(sig)
        _, stderr = gate.communicate(timeout=180)
    finally:
        if gate.poll() is None:
            os.killpg(gate.pid, signal.SIGKILL)
            gate.wait()

    if sig == signal.SIGKILL:
        assert gate.returncode == -signal.SIGKILL
    else:
        assert gate.returncode == 2, f"exit {gate.returncode}, wanted 2 (could not decide)\nstderr:\n{stderr[-4000:]}"
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
