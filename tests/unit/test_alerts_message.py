"""The matrix alert's composition (servegate/alerts.py) from run folders written with RunFolder,
as a gate writes them: which regressions are named and in which order, the baseline and build
range, threshold breaches, undecided gates, improvements apart, links. The real gate run and the
sending through Prefect blocks are tests/integration/test_alerts.py."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from servegate.alerts import AlertLinks, compose_alert, load_notifier, should_alert
from servegate.errors import ConfigError
from servegate.results import RunFolder

BASE_REV, CAND_REV = "a" * 40, "b" * 40


def _comparison_row(metric: str, ratio: float, decision: str, direction: str = "lower_is_better") -> dict:
    return {"metric": metric, "table": "serving_requests", "case": "", "statistic": "median", "unit": "ms",
            "direction": direction, "ratio": ratio, "ci_low": ratio * 0.9, "ci_high": ratio * 1.1, "bound": 0.05,
            "gated": True, "decision": decision, "baseline_runs": "", "reason": None}


def _folder(runs: Path, rev: str, *, comparison: list[dict] | None = None, baseline_ids: list[str] = (),
            paired: list[dict] | None = None, verdict: dict | None = None) -> RunFolder:
    made = RunFolder.create(runs, "smoke")
    folder = RunFolder(made.path, made.manifest.model_copy(update={"git_revision": rev, "git_dirty": False,
                                                                   "git_branch": "main"}))
    folder.write_manifest()
    if comparison is not None:
        df = pd.DataFrame(comparison)
        df.attrs["baseline"] = {"key": "smoke/embedded/cpu/m", "policy": "last 5 passing",
                                "run_ids": list(baseline_ids), "reason": None}
        folder.write_table("comparison", df)
    if paired is not None:
        folder.write_table("paired", pd.DataFrame(paired))
    folder.write_json("verdict", verdict or {"status": "fail", "breaches": [], "infra_errors": [], "undecided": []})
    (folder.path / "summary.md").write_text("## servegate\n")
    return folder


@pytest.fixture
def failed(tmp_path: Path) -> tuple[dict, RunFolder, RunFolder]:
    runs = tmp_path / "runs"
    baseline = _folder(runs, BASE_REV)
    candidate = _folder(runs, CAND_REV, baseline_ids=[baseline.manifest.run_id], comparison=[
        _comparison_row("serving.itl_ms.median", 1.6, "regression"),
        _comparison_row("serving.tpot_ms.median", 2.5, "regression"),
        _comparison_row("serving.ttft_ms.median", 1.4, "regression"),
        _comparison_row("serving.output_throughput.median", 0.5, "regression", "higher_is_better"),
        _comparison_row("serving.e2e_latency_ms.median", 0.7, "improvement"),
        _comparison_row("occupancy.fwd_occupancy.median", 1.0, "no_change", "higher_is_better"),
    ], paired=[{"metric": "itl_median_ms", "ratio": 1.05, "ci_low": 1.03, "ci_high": 1.07, "bound": 0.015,
                "direction": "lower_is_better", "gated": True, "decision": "regression", "rounds": 12}],
        verdict={"status": "fail", "infra_errors": [], "undecided": [], "breaches": [
            {"table": "comparison", "column": "decision", "observed": "regression", "allowed": "not regression"},
            {"table": "serving_summary", "column": "output_throughput", "observed": 12.5, "allowed": ">= 1e+06"}]})
    result = {"status": "fail", "reason": "1 of 3 gate(s) found a regression", "gates": [
        {"deployment": "regression-gate/smoke-cpu", "status": "fail", "reason": "2 expectation(s) breached",
         "run_dir": str(candidate.path), "flow_run_name": "brave-fox"},
        {"deployment": "regression-gate/vllm-cpu", "status": "inconclusive", "reason": "gate run x ended Crashed",
         "run_dir": None, "flow_run_name": "calm-owl"},
        {"deployment": "regression-gate/smoke-spec", "status": "pass", "reason": "every expectation held",
         "run_dir": str(tmp_path / "elsewhere" / "gone"), "flow_run_name": "quick-elk"},
    ]}
    return result, baseline, candidate


def test_the_three_worst_regressions_are_named_worst_first(failed):
    result, _, _ = failed
    body = compose_alert(result).body
    named = [line for line in body.splitlines() if line.startswith("- `") and " vs " in line]
    # tpot x2.5 (log 0.92), throughput x0.5 higher-is-better (0.69), itl x1.6 (0.47); ttft x1.4 and the
    # paired x1.05 are counted but not named
    assert named[:3] == ["- `serving.tpot_ms.median`: ×2.5000 [2.2500, 2.7500] vs baseline runs, bound 5.0%",
                         "- `serving.output_throughput.median`: ×0.5000 [0.4500, 0.5500] vs baseline runs, bound 5.0%",
                         "- `serving.itl_ms.median`: ×1.6000 [1.4400, 1.7600] vs baseline runs, bound 5.0%"], body
    assert "Top regressed metrics (3 of 5):" in body
    assert "serving.ttft_ms.median" not in body and "itl_median_ms" not in body


def test_baseline_build_range_breaches_and_links(failed):
    result, baseline, candidate = failed
    body = compose_alert(result, links=AlertLinks(runs_base_url="https://ci.example/runs/",
                                                  dashboard_url="https://ci.example/dash")).body
    assert f"- Baseline (last 5 passing): `{baseline.manifest.run_id}` at {BASE_REV[:12]} (main)" in body
    assert f"- Build range: {BASE_REV[:12]} (main) -> {CAND_REV[:12]} (main) (latest baseline -> this run)" in body
    # the comparison's own breach is the regressions; the threshold breach is listed
    assert ("Threshold breaches (1 of 1):\n"
            "- `serving_summary.output_throughput`: observed 12.5, allowed >= 1e+06") in body
    assert f"report: <https://ci.example/runs/{candidate.path.name}/summary.md>" in body
    assert body.rstrip().endswith("Dashboard: <https://ci.example/dash>")
    plain = compose_alert(result).body
    assert f"report: <{candidate.path / 'summary.md'}>" in plain and "Dashboard: not linked" in plain


def test_improvements_apart_undecided_gates_with_their_reason_passes_listed(failed):
    result, _, _ = failed
    alert = compose_alert(result, title="nightly-cpu")
    assert alert.subject == "servegate nightly-cpu: FAIL: 1 of 3 gate(s) found a regression"
    sections = alert.body.split("### ")
    improvements = next(s for s in sections if s.startswith("Improvements"))
    assert "`serving.e2e_latency_ms.median`: ×0.7000" in improvements
    assert "serving.e2e_latency_ms" not in next(s for s in sections if s.startswith("regression-gate/smoke-cpu"))
    crashed = next(s for s in sections if s.startswith("regression-gate/vllm-cpu: INCONCLUSIVE"))
    assert "gate run x ended Crashed" in crashed and "flow run `calm-owl`" in crashed
    assert "Passed: regression-gate/smoke-spec" in alert.body  # its folder is not readable here: no improvements
    assert "regression-gate/smoke-spec:" not in alert.body


def test_an_unreadable_run_folder_says_what_to_do(tmp_path: Path):
    result = {"status": "inconclusive", "reason": "1 of 1 gate(s) could not decide", "gates": [
        {"deployment": "regression-gate/sglang-h100", "status": "inconclusive", "reason": "worker died",
         "run_dir": str(tmp_path / "on-the-gpu-box"), "flow_run_name": "r"}]}
    body = compose_alert(result).body
    assert f"Run folder `{tmp_path / 'on-the-gpu-box'}` could not be read here" in body
    assert "set runs_base_url" in body


def test_an_inconclusive_gate_says_why(tmp_path: Path):
    folder = _folder(tmp_path / "runs", CAND_REV, verdict={
        "status": "inconclusive", "breaches": [], "undecided": ["undecided: serving.ttft_ms.median"],
        "infra_errors": ["worker died during serving"]})
    result = {"status": "inconclusive", "reason": "1 of 1 gate(s) could not decide", "gates": [
        {"deployment": "regression-gate/smoke-cpu", "status": "inconclusive", "reason": "1 infra error",
         "run_dir": str(folder.path), "flow_run_name": "r"}]}
    body = compose_alert(result).body
    assert "Could not decide:\n- worker died during serving\n- undecided: serving.ttft_ms.median" in body
    assert f"- Build: {CAND_REV[:12]} (main) (no baseline runs compared)" in body
    assert "Top regressed metrics" not in body and "Improvements" not in body


def test_untrusted_text_cannot_format_the_message():
    result = {"status": "inconclusive", "reason": "[click](http://evil) *now*", "gates": [
        {"deployment": "regression-gate/x", "status": "inconclusive", "reason": "<img src=x> `code`",
         "run_dir": None, "flow_run_name": "n"}]}
    body = compose_alert(result).body
    assert "\\[click\\](http://evil) \\*now\\*" in body and "&lt;img src=x> \\`code\\`" in body


def test_who_gets_a_message():
    assert should_alert({"status": "fail"}) and should_alert({"status": "inconclusive"})
    assert not should_alert({"status": "pass"}) and should_alert({"status": "pass"}, on_pass=True)


@pytest.mark.parametrize("name", ["servegate-chat", "custom-webhook/", "/x", "a/b/c"])
def test_a_block_name_without_its_type_is_refused_before_any_server_call(name):
    with pytest.raises(ConfigError, match="give '<block-type-slug>/<block-name>'"):
        load_notifier(name)
