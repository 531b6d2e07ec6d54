"""`servegate rerun` end to end: a serving stage killed by a worker crash, re-run alone, passes.

Real CLI in subprocesses, real SmolLM2 embedded worker, real GX, real SQLite history.
The first gate runs the worker with ``--fault-crash-after-requests 4``: warmup (1 request)
and one-batch (1 batched request) finish, the worker exits during serving, the verdict is
inconclusive (exit 2). The re-run drops the fault (``--set worker.extra_args=[]``), measures
serving only, carries one-batch from the original folder, and passes (exit 0).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from e2eutil import REPO, gate_env, worker_processes

pytestmark = [pytest.mark.gate, pytest.mark.timeout(900)]


TINY = [
    "--set", "warmup.num_requests=1", "--set", "warmup.max_new_tokens=8",
    "--set", "one_batch.batch_sizes=[1]", "--set", "one_batch.input_lens=[16]", "--set", "one_batch.output_lens=[4]",
    "--set", "serving.num_prompts=6", "--set", "serving.random_input_len=16", "--set", "serving.random_output_len=8",
    "--set", "serving.request_rate=4", "--set", "serving.max_concurrency=2",
    "--set", "occupancy.enabled=false", "--set", "quality.enabled=false", "--set", "report.html=false",
]
CRASH_IN_SERVING = ["--set", 'worker.extra_args=["--fault-crash-after-requests", "4"]']


def _expectations_without_speed_bounds(tmp_path: Path) -> Path:
    """The smoke suites minus their speed floors and latency ceilings: this test checks the re-run,
    not how fast a shared, loaded CI machine decodes (there a 135M model has been seen at 0.4 tok/s
    in one-batch and 4 s per token in serving). Correctness checks (no failed request, every
    prompt completed, grid rows measured or skipped with a reason) stay."""
    suites = tmp_path / "expectations"
    shutil.copytree(REPO / "expectations", suites)
    smoke = json.loads((suites / "smoke.json").read_text())
    speed = ("_ttft_ms", "_tpot_ms", "throughput")
    for suite in smoke["suites"].values():
        suite["expectations"] = [e for e in suite["expectations"]
                                 if not (e["type"] == "expect_column_values_to_be_between"
                                         and e["kwargs"].get("column", "").endswith(speed))]
    (suites / "smoke.json").write_text(json.dumps(smoke))
    return suites




def _cli(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "servegate", *args], cwd=REPO, env=gate_env(tmp_path),
                          capture_output=True, text=True, timeout=840)
    start = min((i for i in (proc.stdout.find("{"), proc.stdout.find("[")) if i >= 0), default=-1)
    assert start >= 0, f"no JSON on stdout.\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc, json.loads(proc.stdout[start:])




def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in folder.iterdir() if p.is_file()}


def test_rerun_serving_after_crash_passes_and_keeps_the_first_attempt(tmp_path: Path):
    suites = _expectations_without_speed_bounds(tmp_path)
    first, v1 = _cli(tmp_path, "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"), "--json",
                     *TINY, *CRASH_IN_SERVING, "--set", f"validate.expectations_dir={suites}")
    assert first.returncode == 2, f"{v1}\n{first.stderr[-4000:]}"
    assert v1["status"] == "inconclusive"
    assert any(e.startswith("serving") for e in v1["infra_errors"]), v1["infra_errors"]
    run_dir = Path(v1["run_dir"])
    stages = json.loads((run_dir / "stages.json").read_text())
    assert stages["one_batch"]["status"] == "ok" and stages["serving"]["status"] == "failed", stages
    before = _snapshot(run_dir)
    one_batch_before = pd.read_parquet(run_dir / "one_batch.parquet")

    second, v2 = _cli(tmp_path, "rerun", str(run_dir), "--task", "serving", "--set", "worker.extra_args=[]", "--json")
    assert second.returncode == 0, f"{v2}\n{second.stderr[-4000:]}"
    assert v2["status"] == "pass" and v2["stages"] == ["serving"], v2
    # capacity, occupancy and quality: disabled in config, carried as skipped
    assert v2["carried"] == ["capacity", "occupancy", "one_batch", "paired", "quality"]
    attempt_dir = Path(v2["run_dir"])
    assert attempt_dir.parent == run_dir / "attempts"

    # Only serving was measured: the attempt's worker saw warmup + serving, never a one-batch case.
    attempt_stages = json.loads((attempt_dir / "stages.json").read_text())
    assert "flush:one_batch" not in attempt_stages and attempt_stages["serving"]["status"] == "ok"
    assert attempt_stages["one_batch"] == stages["one_batch"]  # carried as recorded
    pd.testing.assert_frame_equal(pd.read_parquet(attempt_dir / "one_batch.parquet"), one_batch_before)
    served = pd.read_parquet(attempt_dir / "serving_requests.parquet")
    assert len(served) == 6 and served["success"].all()
    rerun_doc = json.loads((attempt_dir / "rerun.json").read_text())
    assert rerun_doc["overrides"] == ["worker.extra_args=[]"] and rerun_doc["attempt_of"] == v2["attempt_of"]
    assert json.loads((attempt_dir / "config.json").read_text())["worker"]["extra_args"] == []

    # The original folder is untouched: same files, same bytes, same times (attempts/ is new).
    after = _snapshot(run_dir)
    assert after == before

    # The store has both attempts; the first attempt's measurements are still there.
    from servegate.history import Store

    with Store(str(tmp_path / "history.db")) as store:
        attempts = store.attempts(v2["run_id"])
        assert [a.status for a in attempts] == ["inconclusive", "pass"]
        assert [a.attempt for a in attempts] == [1, 2]
        assert attempts[0].run_id == v2["attempt_of"] and attempts[1].attempt_of == v2["attempt_of"]
        first_requests = store.table(attempts[0].run_id, "serving_requests")
        assert (~first_requests["success"]).any()  # the crashed serving load, kept
        assert store.effective(attempts[0].run_id).status == "pass"

    status, rows = _cli(tmp_path, "status", "--json")
    assert status.returncode == 0
    (row,) = rows
    assert row["status"] == "pass" and row["attempts"] == 2 and row["attempt_statuses"] == ["inconclusive", "pass"]
    assert not worker_processes(tmp_path)
