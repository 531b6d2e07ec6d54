"""A ``suspicious`` comparison row (the history rule, ``compare.consecutive``) through the shipped
Great Expectations suites and the verdict: inconclusive (exit 2) with a "suspicious:" reason, never a
pass, never a breach, never a baseline; a regression elsewhere still fails the run."""

from __future__ import annotations

import pandas as pd
import pytest

from servegate.config import available_profiles, load_config
from servegate.render import format_verdict_table, metric_rows, verdict_markdown
from servegate.validate import load_suites, validate_tables
from servegate.verdict import ExitCode, decide_verdict

REASON = ("regression in 1 of the last 2 run(s) (compare.consecutive = 2; the streak breaks at run night-2 "
          "(no_change)): not yet called; the next run decides")


def comparison_table(decisions: tuple[str, ...], gated: tuple[bool, ...]) -> pd.DataFrame:
    return pd.DataFrame({"metric": [f"m{i}" for i in range(len(decisions))], "decision": list(decisions),
                         "gated": list(gated), "ratio": [1.6] * len(decisions), "ci_low": [1.4] * len(decisions),
                         "ci_high": [1.8] * len(decisions), "bound": [0.05] * len(decisions),
                         "reason": [REASON if d == "suspicious" else None for d in decisions]})


def comparing_profiles() -> list[str]:
    return [p for p in available_profiles() if load_config(profile=p).compare.enabled
            or "comparison" in load_suites(load_config(profile=p).validate_.expectation_profile)]


def comparison_outcomes(profile: str, decisions: tuple[str, ...], gated: tuple[bool, ...]) -> list:
    suite = load_config(profile=profile).validate_.expectation_profile
    tables = {"comparison": comparison_table(decisions, gated)}
    return [o for o in validate_tables(tables, suite) if o.table == "comparison"]


@pytest.mark.parametrize("profile", comparing_profiles())
def test_a_suspicious_gated_metric_is_inconclusive_never_a_pass_nor_a_baseline(profile: str) -> None:
    verdict = decide_verdict(comparison_outcomes(profile, ("no_change", "suspicious"), (True, True)), [])
    assert (verdict.status, verdict.exit_code, verdict.breaches) == ("inconclusive", ExitCode.UNDECIDED, [])
    assert verdict.baseline_eligible is False and verdict.infra_errors == []
    assert verdict.reason.startswith("suspicious: gated metric(s) beyond the bound in this run but not yet in "
                                     "compare.consecutive runs in a row (comparison: 1 of 2 rows: ['suspicious'])"), \
        verdict.reason
    [entry] = verdict.undecided
    assert entry.startswith("suspicious: comparison.decision expect_column_values_to_not_be_in_set failed"), entry
    assert "history rule (compare.consecutive" in entry, entry  # the expectation's source


def test_a_regression_elsewhere_still_fails_and_an_undecided_metric_is_listed_too() -> None:
    failed = decide_verdict(comparison_outcomes("cpu-nightly", ("regression", "suspicious"), (True, True)), [])
    assert failed.status == "fail" and [b.column for b in failed.breaches] == ["decision"], failed
    assert [e.split(":")[0] for e in failed.undecided] == ["suspicious"]
    both = decide_verdict(comparison_outcomes("cpu-nightly", ("inconclusive", "suspicious"), (True, True)), [])
    assert both.status == "inconclusive" and both.reason.startswith("suspicious: "), both.reason
    assert both.reason.endswith("; 1 check(s) undecided as well")
    assert sorted(e.split(":")[0] for e in both.undecided) == ["suspicious", "undecided"]


def test_the_terminal_and_markdown_verdict_show_the_suspicious_metric() -> None:
    table = comparison_table(("no_change", "suspicious"), (True, True))
    verdict = decide_verdict(comparison_outcomes("cpu-nightly", ("no_change", "suspicious"), (True, True)), [])
    rows = metric_rows([], table.to_dict("records"))
    assert [r[0] for r in rows] == ["ok", "SUSPECT"] and rows[1][4] == "baseline: suspicious", rows
    text = format_verdict_table(verdict, metrics=rows)
    assert "VERDICT: INCONCLUSIVE (exit 2) - suspicious: " in text and "  - suspicious: comparison.decision" in text
    assert "**inconclusive** (exit 2)" in verdict_markdown(verdict)
    assert "- suspicious: comparison.decision" in verdict_markdown(verdict)


def test_the_alert_names_the_suspicious_metric_with_the_rule_s_reason(tmp_path) -> None:
    from servegate.alerts import compose_alert
    from servegate.results import RunFolder

    table = comparison_table(("no_change", "suspicious"), (True, True)).assign(
        metric=["serving.ttft_ms.median", "serving.itl_ms.median"], case="", direction="lower_is_better",
        baseline_runs="")
    table.attrs["baseline"] = {"policy": "last 5 passing", "run_ids": [], "reason": None}
    verdict = decide_verdict(comparison_outcomes("cpu-nightly", ("no_change", "suspicious"), (True, True)), [])
    folder = RunFolder.create(tmp_path / "runs", "cpu-nightly")
    folder.write_table("comparison", table)
    folder.write_json("verdict", verdict.model_dump(mode="json"))
    body = compose_alert({"status": "inconclusive", "reason": "1 of 1 gate(s) could not decide", "gates": [
        {"deployment": "regression-gate/cpu-nightly", "status": "inconclusive", "reason": verdict.reason,
         "run_dir": str(folder.path), "flow_run_name": "calm-owl"}]}).body
    assert "Suspicious metrics, not yet called a regression (1 of 1):" in body, body
    assert "- `serving.itl_ms.median`: ×1.6000 [1.4000, 1.8000] vs baseline runs, bound 5.0%: regression in 1 of " \
           "the last 2 run(s)" in body, body
    assert "Top regressed metrics" not in body and "- suspicious: comparison.decision" in body, body


def test_the_html_report_marks_a_suspicious_decision_apart_from_a_regression():
    from servegate.report import _mark_decisions

    marked = _mark_decisions("<tr><td>suspicious</td><td>regression</td><td>no_change</td></tr>")
    assert '<td class="warn">suspicious</td>' in marked and '<td class="bad">regression</td>' in marked
    assert "<td>no_change</td>" in marked


def test_junit_and_ci_annotations_call_a_suspicious_metric_suspicious_and_an_undecided_one_undecided(tmp_path):
    import xml.etree.ElementTree as ET

    from servegate.ci_output import annotations
    from servegate.report import write_junit

    outcomes = comparison_outcomes("cpu-nightly", ("inconclusive", "suspicious"), (True, True))
    verdict = decide_verdict(outcomes, [])
    root = ET.parse(write_junit(verdict, outcomes, tmp_path / "junit.xml")).getroot()
    extra = [c for c in root.findall("testcase") if c.get("classname") in ("servegate.suspicious", "servegate.undecided")]
    assert sorted((c.get("classname"), c.get("name"), c.find("error").get("type")) for c in extra) == [
        ("servegate.suspicious", "suspicious_1", "suspicious"), ("servegate.undecided", "undecided_1", "undecided")]
    assert root.get("errors") == "2" and root.get("failures") == "2"  # both rows fail their expectation, as "error"s
    suspicious = next(c for c in extra if c.get("classname") == "servegate.suspicious").find("error")
    assert suspicious.get("message").startswith("suspicious: comparison.decision")
    assert "not yet in compare.consecutive runs in a row" in suspicious.text
    titles = sorted(line.split(" title=")[1].split("::")[0] for line in annotations(verdict, "k"))
    assert titles == ["servegate k%3A suspicious", "servegate k%3A undecided"], titles


def test_the_trend_plot_marks_this_run_s_point_by_its_decision(tmp_path):
    from datetime import timedelta

    from test_store import KEY, T0, run_inputs, synthetic_tables

    from servegate.compare import compare_run
    from servegate.gated_metrics import GATED_METRICS
    from servegate.history import Store
    from servegate.plots import trend_plot

    with Store(str(tmp_path / "history.db")) as store:
        for i in range(3):
            store.record_run(**run_inputs(f"night-{i}", started_at=T0 + timedelta(days=i), seed=i))
        current = synthetic_tables(3, slowdown=1.6)
        comparison = compare_run(store, current, KEY)
        store.record_run(**run_inputs("night-3", started_at=T0 + timedelta(days=3), seed=3,
                                      tables={**current, "comparison": comparison}))
        history = [(rec, store.tables(rec.run_id)) for rec in store.runs()]
    row = comparison[comparison["metric"] == "serving.itl_ms.median"].iloc[0].to_dict()
    metric = next(m for m in GATED_METRICS if m.metric == row["metric"])
    drawn = {d: trend_plot([{**row, "decision": d}], metric, history, "night-3", set())
             for d in ("suspicious", "regression", "no_change")}
    assert "this run: suspicious" in drawn["suspicious"] and "#9a6700" in drawn["suspicious"]
    assert "this run: regression" in drawn["regression"] and "#cf222e" in drawn["regression"]
    assert "this run:" not in drawn["no_change"] and "#9a6700" not in drawn["no_change"]


def test_a_report_computed_for_a_run_recorded_without_a_comparison_uses_that_run_s_compare_settings(tmp_path):
    # `servegate report` of a run the flow recorded without a comparison table compares it then: under
    # the run's own compare section (its history rule and bounds), not the defaults.
    from datetime import timedelta

    from test_store import T0, run_inputs

    from servegate.history import Store
    from servegate.report import build_report

    def report(compare: dict) -> str:
        with Store(str(tmp_path / f"h{len(compare)}-{compare.get('consecutive')}.db")) as store:
            for i in range(3):
                store.record_run(**run_inputs(f"night-{i}", started_at=T0 + timedelta(days=i), seed=i))
            slow = run_inputs("night-3", started_at=T0 + timedelta(days=3), seed=3, slowdown=1.6)
            slow["config"]["compare"] = {"enabled": True, "policy": "last_n", "n": 5, **compare}
            store.record_run(**slow)
            return build_report(store, "night-3")

    assert '<td class="bad">regression</td>' in report({"consecutive": 1})
    once = report({"consecutive": 2})  # no earlier run compared anything: not yet called
    assert '<td class="warn">suspicious</td>' in once and '<td class="bad">regression</td>' not in once
    wide = report({"consecutive": 1, "bound": 0.9, "tail_bound": 0.9})  # x1.6 is inside a 90 % bound
    assert '<td class="bad">regression</td>' not in wide and '<td class="warn">suspicious</td>' not in wide
