"""Report-only metrics (worker start-up time, memory high-water mark, cost per million output tokens):
compared with the baseline and shown, never deciding the verdict; gated only by a threshold a profile
adds. Real comparison maths (servegate.compare), real Great Expectations with the shipped suites."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from datetime import timedelta

import pandas as pd
import pytest
from test_report import _Plots
from test_store import KEY, T0, run_inputs, synthetic_tables
from test_validate import passing_tables

from servegate.compare import compare_run, compare_tables
from servegate.history import Store
from servegate.report import write_markdown_summary, write_report
from servegate.gated_metrics import GATED_METRICS
from servegate.suites import resolve_expectations_dir
from servegate.tables import COST_COLUMNS, WORKER_COLUMNS
from servegate.validate import validate_tables
from servegate.verdict import decide_verdict

pytestmark = pytest.mark.timeout(120)

REPORT_ONLY = ("worker.startup_s.median", "worker.peak_rss_mib.median", "cost.cost_per_mtok_output.median")


def _run_tables(startup_s: float, peak_rss_mib: float, cost: float) -> dict[str, pd.DataFrame]:
    tables = passing_tables()
    del tables["comparison"]
    tables["worker"] = pd.DataFrame([{
        "engine": "embedded", "startup_s": startup_s, "ready_rss_mib": 0.9 * peak_rss_mib, "peak_rss_mib": peak_rss_mib,
        "rss_samples": 40, "rss_sample_interval_s": 0.5, "peak_through": "quality"}], columns=WORKER_COLUMNS)
    tables["cost"] = pd.DataFrame([{"price_per_hour": 2.5, "currency": "USD", "output_throughput": 96.0,
                                    "cost_per_mtok_output": cost}], columns=COST_COLUMNS)
    return tables


# Three nights of an unchanged worker, then one whose start-up took 12x as long, whose memory grew 10x and
# whose cost per token rose 10x, every serving sample the same as before.
BASELINE = [(f"night{i}", _run_tables(s, m, c)) for i, (s, m, c) in
            enumerate([(5.0, 500.0, 7.0), (5.2, 505.0, 7.1), (4.9, 498.0, 6.9)])]
CURRENT = _run_tables(60.0, 5000.0, 70.0)


def _verdict(comparison: pd.DataFrame, profile: str = "cpu-nightly", expectations_dir: Path | None = None):
    tables = {**CURRENT, "comparison": comparison}
    return decide_verdict(validate_tables(tables, profile, expectations_dir), [])


def test_a_big_change_in_report_only_metrics_leaves_a_pass_a_pass():
    comparison = compare_tables(CURRENT, BASELINE)
    rows = comparison.set_index("metric")
    for metric in REPORT_ONLY:
        row = rows.loc[metric]
        # Shown with its interval, which sees the change, yet never gated.
        assert row["ratio"] >= 9 and row["ci_low"] > 1.05, row
        assert (row["gated"], row["decision"]) == (False, "report_only"), row
        assert row["reason"].startswith("report-only metric, never gated (its interval: regression)"), row["reason"]
    assert (rows.loc["serving.ttft_ms.median", "decision"], rows.loc["serving.ttft_ms.median", "gated"]) == \
        ("no_change", True)
    verdict = _verdict(comparison)
    assert (verdict.status, verdict.breaches, verdict.infra_errors, verdict.undecided) == ("pass", [], [], [])

    # The same change in metrics that are not declared report-only fails the gate: the pass above is
    # the declaration's doing, not a comparison that could not see the change.
    gated = [dataclasses.replace(m, report_only=False) for m in GATED_METRICS]
    verdict = _verdict(compare_tables(CURRENT, BASELINE, metrics=gated))
    assert verdict.status == "fail" and [(b.table, b.column) for b in verdict.breaches] == [("comparison", "decision")]


def test_report_only_metrics_without_history_are_shown_not_insufficient_data():
    comparison = compare_tables(CURRENT, BASELINE[:1]).set_index("metric")
    for metric in REPORT_ONLY:
        row = comparison.loc[metric]
        assert (row["gated"], row["decision"], row["n_baseline_runs"]) == (False, "report_only", 1), row
        assert "(its interval: insufficient_data)" in row["reason"] and "2 needed" in row["reason"], row["reason"]
        assert row["current_value"] in (60.0, 5000.0, 70.0)


@pytest.mark.gate
def test_a_profile_gates_start_up_time_with_a_threshold_on_the_worker_table(tmp_path: Path):
    """Off by default; a profile turns it on with an absolute bound on the ``worker`` table."""
    suites = tmp_path / "expectations"
    shutil.copytree(resolve_expectations_dir(None), suites)
    profile = json.loads((suites / "cpu-nightly.json").read_text())
    assert "worker" not in profile["suites"] and "cost" not in profile["suites"]  # off in every shipped profile
    profile["suites"]["worker"] = {"expectations": [{
        "type": "expect_column_values_to_be_between", "kwargs": {"column": "startup_s", "max_value": 30.0},
        "meta": {"source": "test: a worker that takes over 30 s to be ready misses the autoscaler's window"}}]}
    (suites / "cpu-nightly.json").write_text(json.dumps(profile))
    comparison = compare_tables(CURRENT, BASELINE)
    verdict = _verdict(comparison, expectations_dir=suites)
    assert verdict.status == "fail", verdict
    [breach] = verdict.breaches
    assert (breach.table, breach.column, breach.allowed) == ("worker", "startup_s", "<= 30"), breach
    assert breach.observed == 60.0
    fast = {**_run_tables(5.0, 500.0, 7.0), "comparison": comparison}
    assert decide_verdict(validate_tables(fast, "cpu-nightly", suites), []).status == "pass"


@pytest.mark.gate
def test_report_only_metrics_are_kept_in_history_trended_and_shown_in_the_report(tmp_path: Path):
    """Three nights and a fourth as the flow records them (compare, then record with the comparison):
    the history keeps the worker and cost tables, the report trends them, shows them in the comparison
    table under the stage that measured them, and states the run's own start-up, memory and cost."""
    def night(i: int, startup_s: float, peak: float, cost: float) -> dict[str, pd.DataFrame]:
        extra = _run_tables(startup_s, peak, cost)
        return {**synthetic_tables(i), "worker": extra["worker"], "cost": extra["cost"]}

    with Store(str(tmp_path / "history.db")) as store:
        for i, (s, m, c) in enumerate([(5.0, 500.0, 7.0), (5.2, 505.0, 7.1), (4.9, 498.0, 6.9)]):
            store.record_run(**run_inputs(f"night-{i}", started_at=T0 + timedelta(days=i), seed=i,
                                          tables=night(i, s, m, c)))
        current = night(3, 60.0, 5000.0, 70.0)
        comparison = compare_run(store, current, KEY)
        run_dir = tmp_path / "runs" / "night-3"
        run_dir.mkdir(parents=True)
        store.record_run(**run_inputs("night-3", started_at=T0 + timedelta(days=3), seed=3,
                                      tables={**current, "comparison": comparison}), run_dir=run_dir)
        kept = store.tables("night-0", ["worker", "cost"])
        assert kept["worker"]["startup_s"].iloc[0] == 5.0 and kept["cost"]["cost_per_mtok_output"].iloc[0] == 7.0
        text = write_report(store, "night-3").read_text(encoding="utf-8")
    rows = comparison.set_index("metric")
    assert all(rows.loc[m, "decision"] == "report_only" and rows.loc[m, "n_baseline_runs"] == 3 for m in REPORT_ONLY)
    parser = _Plots()
    parser.feed(text)
    for metric in REPORT_ONLY:
        plot = parser.plots[f"trend:{metric}"]
        assert plot["svg"] and plot["paths"] > 0 and not plot["empty"], (metric, plot)
    assert "report only: never gated" in text
    assert '<h3 class="stage" id="comparison-launch">launch</h3>' in text  # worker rows under their stage
    assert "report-only metric, never gated (its interval: regression)" in text
    assert "60.0 s" in text and "5000 MiB through quality" in text and "70 USD at 2.5 USD/h and 96 tok/s" in text
    summary = write_markdown_summary({"status": "pass"}, [], comparison)
    assert "| worker.startup_s.median |" in summary and "| cost.cost_per_mtok_output.median |" in summary
