"""A worker whose outputs are corrupted fails the gate through the quality stage alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e2eutil import REPO, gate_env, stdout_json, worker_processes

pytestmark = [pytest.mark.gate, pytest.mark.exclusive, pytest.mark.timeout(900)]


def test_corrupted_logits_fail_quality_while_speed_stages_pass(tmp_path: Path):
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"),
           "--json", "--set", "serving.num_prompts=12", "--set", "occupancy.max_new_tokens=96",
           "--set", "quality.max_items=40", "--set", 'worker.extra_args=["--fault-corrupt-logits"]']
    proc = subprocess.run(cmd, cwd=REPO, env=gate_env(tmp_path), capture_output=True, text=True, timeout=840)
    verdict = stdout_json(proc)
    assert proc.returncode == 1, f"{json.dumps(verdict, indent=1)}\n{proc.stderr[-3000:]}"
    assert verdict["status"] == "fail" and verdict["infra_errors"] == []
    tables = {b["table"] for b in verdict["breaches"]}
    assert tables and tables <= {"quality_accuracy", "quality_agreement"}, verdict["breaches"]
    stages = json.loads((Path(verdict["run_dir"]) / "stages.json").read_text())
    assert all(stages[s]["status"] == "ok" for s in ("one_batch", "serving", "occupancy", "quality")), stages
    assert not worker_processes(tmp_path)
