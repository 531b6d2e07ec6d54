"""The speculative gate (profile smoke-spec) end to end through the CLI: it passes on the embedded
worker with NGRAM speculation, and a worker whose drafts are ruined (--fault-random-drafts) fails it
on the accept-length expectation alone, while its output stays the greedy output (quality passes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from e2eutil import REPO, gate_env, stdout_json, worker_processes

pytestmark = [pytest.mark.gate, pytest.mark.exclusive, pytest.mark.timeout(900)]

# Smaller than the profile where it does not touch what is validated (CI time): fewer serving
# prompts and quality items; the occupancy request keeps the profile's copying prompt and length.
SMALLER = ["--set", "serving.num_prompts=6", "--set", "quality.max_items=20"]
# The profile's extra_args plus the fault (--set replaces the list).
RUIN_DRAFTS = ["--set", 'worker.extra_args=["--decode-log-interval","8","--fault-random-drafts"]']
MEASURED = ("one_batch", "serving", "occupancy", "quality")


def _gate(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "smoke-spec", "--output-dir", str(tmp_path / "runs"),
           "--json", *SMALLER, *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=gate_env(tmp_path), capture_output=True, text=True, timeout=840)
    return proc, stdout_json(proc)


def test_spec_gate_passes_and_ruined_drafts_fail_it_on_accept_length_only(tmp_path: Path) -> None:
    # Quality (slow on 2 cores) runs where it proves something: on the faulted worker, whose output must not change.
    proc, verdict = _gate(tmp_path, "--set", "quality.enabled=false")
    assert proc.returncode == 0, f"{json.dumps(verdict, indent=1)}\n{proc.stderr[-3000:]}"
    assert verdict["status"] == "pass" and verdict["breaches"] == []
    run_dir = Path(verdict["run_dir"])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["worker"]["speculative_num_draft_tokens"] == 4
    occupancy = pd.read_parquet(run_dir / "occupancy_summary.parquet").iloc[0]
    assert bool(occupancy["speculative_decoding"])
    assert occupancy["spec_accept_length_median"] > 1.8  # the copying prompt: drafts accepted
    samples = pd.read_parquet(run_dir / "occupancy_samples.parquet")
    assert samples["spec_accept_length"].notna().sum() >= 5  # the gauge was scraped, not invented

    proc, verdict = _gate(tmp_path, *RUIN_DRAFTS)
    assert proc.returncode == 1, f"{json.dumps(verdict, indent=1)}\n{proc.stderr[-3000:]}"
    assert verdict["status"] == "fail" and verdict["infra_errors"] == []
    assert [(b["table"], b["column"]) for b in verdict["breaches"]] == \
        [("occupancy_summary", "spec_accept_length_median")], verdict["breaches"]
    run_dir = Path(verdict["run_dir"])
    config = json.loads((run_dir / "config.json").read_text())
    assert "--fault-random-drafts" in config["worker"]["extra_args"]
    occupancy = pd.read_parquet(run_dir / "occupancy_summary.parquet").iloc[0]
    assert occupancy["spec_accept_length_median"] < 1.2  # towards 1: nearly every draft rejected
    # Every stage measured, and the greedy output did not change: reference agreement still holds.
    stages = json.loads((run_dir / "stages.json").read_text())
    assert all(stages[s]["status"] == "ok" for s in MEASURED), stages
    agreement = pd.read_parquet(run_dir / "quality_agreement.parquet").iloc[0]
    assert agreement["within_tolerance_rate"] == 1.0
    assert not worker_processes(tmp_path)
