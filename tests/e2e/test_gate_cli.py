"""The gate end to end, as a user runs it: `servegate run` against the real SmolLM2 worker.

Each test runs the real CLI in a subprocess (its own ephemeral Prefect server, a real
embedded worker process, real GX validation) and checks the exit code, the run folder and
that no process survives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from e2eutil import REPO, gate_env, stdout_json, tiny_gate, worker_processes

from servegate.history import Store

pytestmark = [pytest.mark.gate, pytest.mark.timeout(900)]

PRICE_PER_HOUR = 2.5


# A smaller smoke: same stages, fewer requests, so three gate runs fit the CI budget.
FAST = [
    "--set", "serving.num_prompts=12",
    "--set", "occupancy.max_new_tokens=96",
    "--set", "quality.max_items=60",
]


def _run(tmp_path: Path, *args: str, timeout: float = 840, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"),
           "--json", *FAST, *args]
    return subprocess.run(cmd, cwd=REPO, env={**gate_env(tmp_path), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.exclusive
def test_smoke_gate_passes_and_keeps_everything(tmp_path: Path):
    proc = _run(tmp_path, "--set", f"cost.price_per_hour={PRICE_PER_HOUR}")
    verdict = stdout_json(proc)
    assert proc.returncode == 0, f"{verdict}\n{proc.stderr[-4000:]}"
    assert verdict["status"] == "pass" and verdict["breaches"] == []
    run_dir = Path(verdict["run_dir"])
    for name in ("config.json", "stages.json", "verdict.json", "expectations.json", "worker.log",
                 "one_batch.csv", "one_batch.parquet", "one_batch.jsonl", "serving_requests.parquet",
                 "serving_summary.csv", "occupancy_samples.csv", "occupancy_summary.csv"):
        assert (run_dir / name).is_file(), f"{name} missing from {sorted(p.name for p in run_dir.iterdir())}"
    stages = json.loads((run_dir / "stages.json").read_text())
    assert stages.pop("compare")["status"] == "skipped"  # smoke has no baseline comparison
    assert stages.pop("paired")["status"] == "skipped"  # nor a baseline worker to pair with
    assert stages.pop("capacity")["status"] == "skipped"  # the capacity sweep is off in smoke
    assert all(s["status"] == "ok" for s in stages.values()), stages
    # `servegate run` started the worker before Prefect was up, and the launch stage took that process.
    assert [r.split(" (pid ")[0] for r in stages["launch"]["remarks"]] == [
        "adopted the worker process started early"], stages["launch"]
    rows = [json.loads(line) for line in (run_dir / "one_batch.jsonl").read_text().splitlines()]
    # the smoke grid has one case past the worker's max running requests: a row with its reason
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert skipped and all(r["skip_reason"] for r in skipped)
    measured = [r for r in rows if r["status"] == "measured"]
    assert measured and all(r["latency"] > 0 and r["output_throughput"] > 0 for r in measured)
    assert not worker_processes(tmp_path)
    # The terminal (issue 14): one line per stage, no library's INFO line (Prefect's API client,
    # httpx, GX, progress bars); those are in the run's gate.log.
    for stage in ("launch", "warmup", "one_batch", "serving", "occupancy", "quality", "validate"):
        assert re.search(rf"^✓ {re.escape(stage)} +\d+\.\d s  ok$", proc.stderr, re.M), proc.stderr[-3000:]
    assert re.search(r"^– paired +skipped: no baseline worker", proc.stderr, re.M), proc.stderr[-3000:]
    assert not re.search(r" INFO |\| INFO|it/s\]|req/s\]", proc.stderr), proc.stderr[-3000:]
    log = (run_dir / "gate.log").read_text()
    assert " INFO httpx: HTTP Request: POST" in log and " INFO prefect.task_runs: Finished in state" in log

    # The same run folder and verdict layout as before the redesign (issue 12: behaviour stays the
    # same), recorded from the smoke gate of commit 5910325. Added since, on purpose:
    # summary.not_applicable (issue 11, finding 8: checks the engine cannot provide); the paired
    # stage's record (issue 13: skipped without a baseline worker); verdict.undecided (issue 13);
    # each stage record's remarks (issue 11: a discarded serving attempt is named there); gate.log,
    # where the libraries' log lines go instead of the terminal (issue 14); the capacity stage's
    # record (issue 16: skipped, off in smoke); the host stage's record and host.json (issue 19: the
    # environment record and host checks before the first measurement); the worker and cost tables
    # (issue 19: start-up time, memory high-water mark, cost per million output tokens: with a price).
    golden = json.loads((Path(__file__).parent / "golden" / "smoke_run_folder.json").read_text())
    added = ["gate.log", "host.json", "worker.csv", "worker.parquet", "cost.csv", "cost.parquet"]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([*golden["files"], *added])
    expected = golden["verdict_json"]
    expected["summary"]["not_applicable"] = "int"
    expected["undecided"] = "list"  # issue 13: gated metrics left undecided, apart from infra errors
    assert _schema(json.loads((run_dir / "verdict.json").read_text())) == expected
    assert sorted(verdict) == sorted([*golden["stdout_json_keys"], "undecided"])
    recorded = json.loads((run_dir / "stages.json").read_text())
    assert sorted(recorded) == sorted([*golden["stages"], "paired", "capacity", "host"])
    assert all(sorted(r) == sorted([*golden["stage_record_keys"], "remarks"]) for r in recorded.values()), recorded
    assert recorded["launch"]["tables"] == ["worker"] and "cost" in recorded["serving"]["tables"]

    # What the worker cost (issue 19), in the run folder, the history and the report.
    worker = pd.read_parquet(run_dir / "worker.parquet").iloc[0]
    assert worker["engine"] == "embedded" and 0 < worker["startup_s"] < 600, worker
    # SmolLM2-135M with torch holds a few hundred MiB at least; the peak is at least what it held when ready.
    assert 100 < worker["ready_rss_mib"] <= worker["peak_rss_mib"] < 32 * 1024, worker
    assert worker["peak_through"] == "quality" and worker["rss_samples"] >= 10, worker  # the last stage on it
    throughput = pd.read_parquet(run_dir / "serving_summary.parquet")["output_throughput"].iloc[0]
    cost = pd.read_parquet(run_dir / "cost.parquet").iloc[0]
    assert (cost["price_per_hour"], cost["currency"]) == (PRICE_PER_HOUR, "USD")
    assert cost["cost_per_mtok_output"] == pytest.approx(PRICE_PER_HOUR * 1e6 / (throughput * 3600), rel=1e-9)
    with Store(str(tmp_path / "history.db")) as store:
        [record] = store.runs()
        kept = store.tables(record.run_id, ["worker", "cost"])
    assert kept["worker"]["peak_rss_mib"].iloc[0] == pytest.approx(worker["peak_rss_mib"])
    assert kept["cost"]["cost_per_mtok_output"].iloc[0] == pytest.approx(cost["cost_per_mtok_output"])
    report = (run_dir / "report.html").read_text()
    assert f"{worker['startup_s']:.1f} s" in report and f"{worker['peak_rss_mib']:.0f} MiB through quality" in report
    assert f"{cost['cost_per_mtok_output']:.4g} USD at 2.5 USD/h" in report


def test_terminal_shows_the_measured_numbers_and_verbose_brings_the_library_logs_back(tmp_path: Path):
    """Without --json: the metric table (each measured number with its bound and mark) before the
    verdict, and where the report is; -v puts the libraries' INFO lines back on the terminal."""
    cmd = [sys.executable, "-m", "servegate", "-v", "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"),
           "--set", "one_batch.enabled=false", "--set", "occupancy.enabled=false", *tiny_gate(),
           "--set", "serving.num_prompts=4"]
    proc = subprocess.run(cmd, cwd=REPO, env=gate_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    table, verdict_line = proc.stdout.split("VERDICT: PASS (exit 0)")
    assert re.search(r"^ok +serving_summary\.p90_ttft_ms +\d+(\.\d+)? +<= 5000 +threshold$", table, re.M), table
    assert re.search(r"^ok +serving_summary\.failed +0 +<= 0", table, re.M), table
    assert re.search(r"^report: .*/report\.html$", verdict_line, re.M), verdict_line
    assert " INFO httpx: HTTP Request" in proc.stderr and "Finished in state Completed()" in proc.stderr
    assert re.search(r"^✓ serving +\d+\.\d s  ok$", proc.stderr, re.M), proc.stderr[-3000:]
    assert not worker_processes(tmp_path)


def _schema(obj):
    """A JSON document's shape: keys with their value types (lists as "list")."""
    if isinstance(obj, dict):
        return {k: _schema(v) for k, v in sorted(obj.items())}
    return "list" if isinstance(obj, list) else type(obj).__name__


def test_threshold_the_worker_cannot_meet_fails_with_exit_1(tmp_path: Path):
    suites = tmp_path / "expectations"
    shutil.copytree(REPO / "expectations", suites)
    smoke = json.loads((suites / "smoke.json").read_text())
    # Demand an output throughput no 2-core CPU reaches (the tiny model's forward passes sleep 20 ms each).
    smoke["suites"].setdefault("serving_summary", {"expectations": []})["expectations"].append({
        "type": "expect_column_values_to_be_between",
        "kwargs": {"column": "output_throughput", "min_value": 1.0e6},
        "meta": {"source": "test: impossible threshold"},
    })
    (suites / "smoke.json").write_text(json.dumps(smoke))
    # As a GitHub Actions job runs it (issue 14): the job summary, annotations, the PR comment body.
    step_summary = tmp_path / "step_summary.md"
    step_summary.write_text("## an earlier step's summary\n")
    proc = _run(tmp_path, "--set", f"validate.expectations_dir={suites}", "--set", "occupancy.enabled=false",
                *tiny_gate(), env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(step_summary)})
    verdict = stdout_json(proc)
    assert proc.returncode == 1, f"{verdict}\n{proc.stderr[-4000:]}"
    assert verdict["status"] == "fail"
    named = [b for b in verdict["breaches"] if b["column"] == "output_throughput"]
    assert named, verdict["breaches"]
    assert not worker_processes(tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("::error ")]
    assert len(errors) == len(verdict["breaches"]) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("::error title=servegate smoke/embedded/cpu-2core/tiny-random%3A regression::"
                                "serving_summary.output_throughput: observed "), errors
    assert "allowed >= 1e+06" in errors[0] and "(test: impossible threshold)" in errors[0], errors
    summary = step_summary.read_text()
    assert summary.startswith("## an earlier step's summary\n## servegate: **fail**"), summary
    assert summary.rstrip().endswith((Path(verdict["run_dir"]) / "summary.md").read_text().rstrip())
    comment = (Path(verdict["run_dir"]) / "pr_comment.md").read_text()
    assert comment.startswith("<!-- servegate:smoke/embedded/cpu-2core/tiny-random -->\n## servegate: **fail**")


def test_worker_killed_mid_run_is_inconclusive_and_leaves_no_process(tmp_path: Path):
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"),
           "--json", *FAST, *tiny_gate(), "--set", "serving.num_prompts=40", "--set", "serving.request_rate=2"]
    gate = subprocess.Popen(cmd, cwd=REPO, env=gate_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        # Wait until the serving stage is under way: its flush recorded ok, serving itself not yet
        # (stages.json is rewritten as each stage ends; 40 requests at 2/s last about 20 s).
        deadline = time.monotonic() + 600
        killed = None
        while time.monotonic() < deadline and gate.poll() is None:
            stages = {}
            for path in (tmp_path / "runs").glob("*/stages.json"):
                try:
                    stages = json.loads(path.read_text())
                except (OSError, ValueError):  # being rewritten this instant
                    pass
            workers = []
            for p in psutil.Process(gate.pid).children(recursive=True):
                try:
                    if "worker" in (p.cmdline() or []):
                        workers.append(p)
                except psutil.Error:  # exiting this instant (a zombie's cmdline cannot be read)
                    continue
            if stages.get("flush:serving", {}).get("status") == "ok" and "serving" not in stages and workers:
                time.sleep(2.0)
                killed = workers[0]
                killed.send_signal(signal.SIGKILL)
                break
            time.sleep(0.5)
        assert killed is not None, "the gate never reached the serving stage"
        out, err = gate.communicate(timeout=300)
    finally:
        if gate.poll() is None:
            os.killpg(gate.pid, signal.SIGKILL)
    assert gate.returncode == 2, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-4000:]}"
    verdict = json.loads(out[out.find("{"):])
    assert verdict["status"] == "inconclusive"
    assert any("serving" in e for e in verdict["infra_errors"]), verdict["infra_errors"]
    run_dir = Path(verdict["run_dir"])
    assert (run_dir / "one_batch.csv").is_file()  # measured before the kill: kept
    assert not killed.is_running() or killed.status() == psutil.STATUS_ZOMBIE
    assert not worker_processes(tmp_path)
