"""The gate flow as a real Prefect flow run (shared ephemeral server), on a real worker process.

The tiny random-weight model keeps this fast; the e2e tests run the real SmolLM2.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import psutil
import pytest

from servegate.flows.gate import regression_gate

pytestmark = [pytest.mark.gate, pytest.mark.timeout(600)]

TINY = [
    "worker.model=tiny-random",
    "warmup.max_new_tokens=4",
    "one_batch.batch_sizes=[1, 2, 64]",
    "one_batch.input_lens=[16]",
    "one_batch.output_lens=[4]",
    "serving.num_prompts=6",
    "serving.random_input_len=16",
    "serving.random_output_len=6",
    "serving.request_rate=20",
    "serving.progress=false",
    "occupancy.max_new_tokens=400",
    "occupancy.scrape_interval_s=0.05",
    "quality.enabled=false",  # a random-weight model cannot meet an accuracy floor
]


def _children() -> set[int]:
    """This process's descendants, less its guardian (servegate.proctree), which lives as long as it does."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "servegate.proctree" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            continue
    return out


async def _artifacts(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async with get_client() as client:
        return await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def _suites_for_a_busy_machine(tmp_path: Path) -> Path:
    """The smoke suites with the occupancy floor at 10 %: the random tiny model's forward pass is so
    short that on a loaded 2-core machine the step loop's own time reached half the wall time (52 %
    seen while other suites ran). This test is about the flow, not the floor."""
    doc = json.loads((Path(__file__).resolve().parents[2] / "expectations" / "smoke.json").read_text())
    for exp in doc["suites"]["occupancy_summary"]["expectations"]:
        if exp["kwargs"].get("column") == "fwd_occupancy_median" and "min_value" in exp["kwargs"]:
            exp["kwargs"]["min_value"] = 10
    folder = tmp_path / "expectations"
    folder.mkdir()
    (folder / "smoke.json").write_text(json.dumps(doc))
    return folder


def test_flow_run_passes_records_artifacts_and_stops_worker(prefect_server, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SERVEGATE_DB", str(tmp_path / "history.db"))
    before = _children()
    state = regression_gate(profile="smoke", overrides=[
        *TINY, f"output_dir={tmp_path}", f"validate.expectations_dir={_suites_for_a_busy_machine(tmp_path)}"],
        return_state=True)
    assert state.is_completed(), state
    result = state.result()
    verdict = result["verdict"]
    assert verdict["status"] == "pass", json.dumps(verdict, indent=1)
    run_dir = Path(result["run_dir"])
    stages = json.loads((run_dir / "stages.json").read_text())
    for stage in ("launch", "warmup", "flush:one_batch", "one_batch", "flush:serving", "serving",
                  "flush:occupancy", "occupancy", "validate"):
        assert stages[stage]["status"] == "ok", (stage, stages[stage])
    assert stages["compare"]["status"] == "skipped"  # smoke: no baseline comparison
    assert (run_dir / "junit.xml").is_file() and (run_dir / "report.html").is_file()
    artifacts = asyncio.run(_artifacts(state.state_details.flow_run_id))
    keys = {a.key for a in artifacts if a.key}
    assert {"servegate-smoke-launch", "servegate-smoke-one-batch", "servegate-smoke-serving",
            "servegate-smoke-occupancy", "servegate-smoke-verdict", "servegate-smoke-summary"} <= keys, keys
    # One artifact per stage: the launch's is the worker's address and budget, and its table.
    (launch,) = [a for a in artifacts if a.key == "servegate-smoke-launch"]
    assert "ready at http://127.0.0.1:" in launch.data and "memory budget:" in launch.data, launch.data
    assert "startup_s" in launch.data, launch.data
    assert _children() <= before  # the worker's whole tree is gone


def test_flow_with_unreachable_flush_is_inconclusive_and_keeps_tables(prefect_server, tmp_path: Path, monkeypatch):
    """A worker that stays busy past the flush timeout: the stage after it is skipped, never measured dirty."""
    monkeypatch.setenv("SERVEGATE_DB", str(tmp_path / "history.db"))
    result = regression_gate(profile="smoke", overrides=[
        *TINY, f"output_dir={tmp_path}", "flush.timeout_s=1",
        'worker.extra_args=["--fault-flush-busy-s", "30"]', "report.html=false"])
    verdict = result["verdict"]
    assert verdict["status"] == "inconclusive"
    assert any("flush" in e for e in verdict["infra_errors"]), verdict["infra_errors"]
    stages = json.loads((Path(result["run_dir"]) / "stages.json").read_text())
    assert stages["flush:one_batch"]["status"] == "failed"
    assert stages["one_batch"]["status"] == "skipped" and "flush" in stages["one_batch"]["error"]


def test_a_client_that_falls_behind_is_measured_again_and_never_passes(prefect_server, tmp_path: Path,
                                                                        monkeypatch):
    """A load generator that missed its schedule measured itself: the load is flushed and run again
    (serving.invalid_client_retries), each discarded attempt is kept, and a client that is still not
    valid makes the gate inconclusive. A lag limit no real client meets forces every attempt invalid."""
    monkeypatch.setenv("SERVEGATE_DB", str(tmp_path / "history.db"))
    result = regression_gate(profile="smoke", overrides=[
        *TINY, f"output_dir={tmp_path}", "serving.max_dispatch_lag_p99_ms=0.000001",
        "serving.invalid_client_retries=2", "serving.num_prompts=4", "one_batch.enabled=false",
        "occupancy.enabled=false", "report.html=false"])
    verdict = result["verdict"]
    assert verdict["status"] == "inconclusive", json.dumps(verdict, indent=1)
    assert verdict["baseline_eligible"] is False
    run_dir = Path(result["run_dir"])
    stages = json.loads((run_dir / "stages.json").read_text())
    remarks = stages["serving"]["remarks"]
    discarded = [r for r in remarks if r.startswith("attempt ")]
    assert [d.split(":")[0] for d in discarded] == ["attempt 1 discarded", "attempt 2 discarded"], remarks
    assert all("client not valid: dispatch lag p99" in d for d in discarded), discarded
    # the kept (third) attempt says how it was measured, too
    assert any(r.startswith("client not valid: dispatch lag p99") for r in remarks[2:]), remarks
    import pandas as pd

    for n in (1, 2):  # the discarded measurements stay on disk, whole
        kept = pd.read_csv(run_dir / f"serving_requests_discarded_{n}.csv")
        assert len(kept) == 4 and kept["success"].all()
    assert not (run_dir / "serving_requests_discarded_3.csv").exists()
    summary = pd.read_csv(run_dir / "serving_summary.csv")
    assert not bool(summary.loc[0, "client_valid"]) and len(pd.read_csv(run_dir / "serving_requests.csv")) == 4


def test_flow_whose_history_write_fails_is_inconclusive_and_keeps_its_files(prefect_server, tmp_path: Path):
    """A run the history database could not take is not a pass: tomorrow's baseline and `status` miss it."""
    unwritable = tmp_path / "a-folder-not-a-database"
    unwritable.mkdir()
    result = regression_gate(profile="smoke", overrides=[
        *TINY, f"output_dir={tmp_path}", f"store.url={unwritable}", "serving.num_prompts=3",
        "occupancy.enabled=false", "one_batch.batch_sizes=[1]"])
    verdict = result["verdict"]
    assert verdict["status"] == "inconclusive", json.dumps(verdict, indent=1)
    assert verdict["baseline_eligible"] is False
    assert any(e.startswith("record: writing the history database failed") for e in verdict["infra_errors"]), \
        verdict["infra_errors"]
    run_dir = Path(result["run_dir"])
    assert json.loads((run_dir / "verdict.json").read_text())["status"] == "inconclusive"
    summary = (run_dir / "summary.md").read_text()
    assert "inconclusive" in summary and "record" in summary, summary
    assert (run_dir / "junit.xml").is_file() and (run_dir / "serving_requests.csv").is_file()


def test_external_engine_stages_it_cannot_serve_are_not_applicable(prefect_server, tmp_path: Path, monkeypatch):
    """Engine external promises no metrics and no prompt log-probabilities: its occupancy and quality
    stages are not applicable, neither measured nor a breach (it once failed the gate on occupancy)."""
    from servegate.config import WorkerSpec
    from servegate.launch import launch_worker

    monkeypatch.setenv("SERVEGATE_DB", str(tmp_path / "history.db"))
    spec = WorkerSpec(engine="embedded", model="tiny-random", memory_profile="cpu-small")
    with launch_worker(spec, tmp_path / "served.log", ready_timeout_s=180) as served:
        result = regression_gate(profile="smoke", overrides=[
            *[o for o in TINY if not o.startswith("quality.")], f"output_dir={tmp_path}", "worker.engine=external",
            f"worker.url={served.base_url}", "serving.num_prompts=3", "one_batch.batch_sizes=[1]",
            "report.html=false"])
    verdict = result["verdict"]
    stages = json.loads((Path(result["run_dir"]) / "stages.json").read_text())
    for stage in ("occupancy", "quality"):
        assert stages[stage]["status"] == "not_applicable", stages[stage]
        assert stages[stage]["error"].startswith("engine external "), stages[stage]
        assert f"flush:{stage}" not in stages, stages
    assert verdict["status"] == "pass", json.dumps(verdict, indent=1)
    assert {"occupancy_summary", "quality_accuracy"} <= set(verdict["not_applicable"]), verdict


def test_a_stage_past_its_deadline_is_stopped_and_the_gate_cannot_decide(prefect_server, tmp_path: Path,
                                                                        monkeypatch):
    """A worker slowed to a crawl: the occupancy stage's long request passes stage_max_s, its worker is
    stopped, and the gate ends in bounded time as inconclusive (not a 30-minute hang)."""
    import time

    monkeypatch.setenv("SERVEGATE_DB", str(tmp_path / "history.db"))
    started = time.monotonic()
    result = regression_gate(profile="smoke", overrides=[
        *TINY, f"output_dir={tmp_path}", "stage_max_s=8", "report.html=false", "one_batch.batch_sizes=[1]",
        # 0.2 s per forward pass: occupancy's 400-token request would take 80 s
        'worker.extra_args=["--fault-decode-delay-ms", "200"]', "warmup.max_new_tokens=1",
        "one_batch.output_lens=[2]", "serving.num_prompts=2", "serving.random_output_len=2"])
    elapsed = time.monotonic() - started
    verdict = result["verdict"]
    assert verdict["status"] == "inconclusive", json.dumps(verdict, indent=1)
    stages = json.loads((Path(result["run_dir"]) / "stages.json").read_text())
    assert stages["serving"]["status"] == "ok", stages["serving"]
    occupancy = stages["occupancy"]
    assert occupancy["status"] == "failed" and occupancy["error"].startswith("DeadlineError: occupancy ran past "
                                                                             "stage_max_s = 8 s"), occupancy
    assert occupancy["duration_s"] < 8 + 15, occupancy
    assert any("stage_max_s" in e for e in verdict["infra_errors"]), verdict["infra_errors"]
    assert elapsed < 150, f"the gate took {elapsed:.0f} s"
