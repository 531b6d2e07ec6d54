"""Three gates at once recording into one SQLite history (a team's machine running a matrix):
no "database is locked", no lost or half-written run, every process gone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faultutil import db_state, start_gate, survivors

pytestmark = [pytest.mark.gate, pytest.mark.timeout(600)]


def test_three_gates_record_into_one_history_at_once(tmp_path: Path) -> None:
    gates = [start_gate(tmp_path, "--set", "occupancy.max_new_tokens=150", "--set", "serving.num_prompts=8",
                        "--set", "serving.request_rate=8", "--set", "one_batch.output_lens=[8]")
             for _ in range(3)]
    outs = [gate.communicate(timeout=540) for gate in gates]
    verdicts = []
    for gate, (stdout, stderr) in zip(gates, outs):
        assert "database is locked" not in stderr and "UNIQUE constraint" not in stderr, stderr[-3000:]
        start = stdout.find("{")
        assert start >= 0, f"exit {gate.returncode}, no verdict:\n{stderr[-3000:]}"
        verdict = json.loads(stdout[start:])
        assert not any("record" in e for e in verdict["infra_errors"]), verdict["infra_errors"]
        assert gate.returncode == {"pass": 0, "fail": 1, "inconclusive": 2}[verdict["status"]], verdict
        verdicts.append(verdict)
    # Their verdicts are whatever three gates sharing two cores measure (absolute floors are not
    # sized for a 3x slowdown); what is checked is that each was decided and recorded whole.
    db = db_state(tmp_path)
    assert db.integrity == "ok" and db.runs == 3, db
    assert len({Path(v["run_dir"]).name for v in verdicts}) == 3
    assert not survivors(tmp_path, within_s=20)
