"""Verdict rules: every branch of decide_verdict(), the exit codes, and the two renderings."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from servegate.render import format_verdict_table, verdict_markdown
from servegate.validate import TABLE_NOT_PRODUCED, ExpectationOutcome
from servegate.verdict import ExitCode, Verdict, decide_verdict


def outcome(table="serving_summary", column="failed", success=True, produced=True, reason=None,
            observed=0, allowed="<= 0", source="absolute: no failed requests") -> ExpectationOutcome:
    return ExpectationOutcome(table=table, expectation_type="expect_column_values_to_be_between", column=column,
                              kwargs={"column": column, "max_value": 0}, success=success, table_produced=produced,
                              reason=reason, observed=observed, allowed=allowed, meta={"source": source})


def not_produced(table):
    return outcome(table=table, success=None, produced=False, reason=TABLE_NOT_PRODUCED, observed=None)


def test_pass():
    v = decide_verdict([outcome(), outcome(table="occupancy_summary", column="fwd_occupancy_median")], [])
    assert (v.status, v.exit_code, v.breaches, v.infra_errors) == ("pass", 0, [], [])
    assert v.summary.passed == 2 and v.summary.expectations == 2


def test_fail_lists_every_breach():
    v = decide_verdict([outcome(success=False, observed=3),
                        outcome(column="p90_ttft_ms", success=False, observed=1500.0, allowed="<= 1000", source="SLO"),
                        outcome(column="completed")], [])
    assert (v.status, v.exit_code) == ("fail", 1)
    assert [(b.column, b.observed, b.allowed, b.source) for b in v.breaches] == [
        ("failed", 3, "<= 0", "absolute: no failed requests"), ("p90_ttft_ms", 1500.0, "<= 1000", "SLO")]
    assert v.summary.failed == 2 and v.summary.passed == 1


def test_infra_error_makes_breaches_inconclusive():
    v = decide_verdict([outcome(success=False, observed=3)], ["worker died during serving: exit -9"])
    assert (v.status, v.exit_code) == ("inconclusive", 2)
    assert len(v.breaches) == 1  # still listed
    assert "not trusted as a regression" in v.reason
    assert v.infra_errors == ["worker died during serving: exit -9"]


def test_failed_stage_is_infra_even_without_message():
    v = decide_verdict([outcome()], [], {"serving": "ok", "occupancy": "failed"})
    assert v.status == "inconclusive" and v.infra_errors == ["stage occupancy failed"]


def test_unevaluated_expectation_on_produced_table_is_infra():
    v = decide_verdict([outcome(), outcome(table="occupancy_summary", column="fwd_occupancy_median", success=None,
                                   reason="table 'occupancy_summary' is empty (0 rows): insufficient data")], [])
    assert v.status == "inconclusive" and v.summary.not_evaluated == 1
    assert "insufficient data" in v.infra_errors[0]


def test_missing_required_table_is_inconclusive():
    v = decide_verdict([outcome(), not_produced("occupancy_summary")], [], {"occupancy": "ok"})
    assert v.status == "inconclusive" and v.not_validated == ["occupancy_summary"] and v.not_applicable == []


def test_missing_table_without_stage_status_is_inconclusive():
    assert decide_verdict([outcome(), not_produced("one_batch")], []).status == "inconclusive"


@pytest.mark.parametrize("status", ["skipped", "not_applicable"])
def test_missing_table_of_exempt_stage_passes(status):
    v = decide_verdict([outcome(), not_produced("occupancy_summary")], [], {"serving": "ok", "occupancy": status})
    assert v.status == "pass" and v.not_applicable == ["occupancy_summary"]


def test_breach_beats_missing_table():
    v = decide_verdict([outcome(success=False, observed=1), not_produced("occupancy_summary")], [])
    assert v.status == "fail"


def test_nothing_evaluated_never_passes():
    v = decide_verdict([not_produced("occupancy_summary")], [], {"occupancy": "not_applicable"})
    assert v.status == "inconclusive" and "does not pass on nothing" in v.reason
    assert decide_verdict([], []).status == "inconclusive"


def comparison_outcome(failure_means, value, success=False, unexpected=1):
    """The comparison suite's check on gated rows that failure_means guards, as validate reports it."""
    return ExpectationOutcome(
        table="comparison", expectation_type="expect_column_values_to_not_be_in_set", column="decision",
        kwargs={"column": "decision", "value_set": [value]}, success=success, table_produced=True,
        observed={"unexpected_count": unexpected, "element_count": 12, "unexpected_values": [value] * unexpected},
        allowed=f"not in [{value}]", meta={"source": "non-inferiority", "failure_means": failure_means})


def test_undecided_gated_metric_is_inconclusive_not_a_breach_and_not_a_baseline():
    # A x1.55 ratio with CI 0.90-2.56 may be a +55 % regression: it must not pass, nor fail.
    v = decide_verdict([outcome(), comparison_outcome("undecided", "inconclusive")], [])
    assert (v.status, v.exit_code, v.breaches) == ("inconclusive", ExitCode.UNDECIDED, [])
    assert v.baseline_eligible is False
    assert v.summary.failed == 0 and v.summary.passed == 1
    assert v.infra_errors == []  # not infrastructure: its own list
    [entry] = v.undecided
    assert entry.startswith("undecided: comparison.decision expect_column_values_to_not_be_in_set failed "
                            "(1 of 12 rows: ['inconclusive'])")
    assert "not a regression" in entry and "paired mode" in entry and entry.endswith("non-inferiority")
    assert "undecided" in v.reason and "infrastructure" not in v.reason


def test_undecided_met_does_not_change_a_pass():
    v = decide_verdict([outcome(), comparison_outcome("undecided", "inconclusive", success=True, unexpected=0)], [])
    assert (v.status, v.infra_errors, v.undecided, v.baseline_eligible) == ("pass", [], [], True)


def test_undecided_does_not_hide_a_regression():
    # Another metric's interval lies beyond the bound: that is shown, whatever the undecided one does.
    v = decide_verdict([comparison_outcome(None, "regression"), comparison_outcome("undecided", "inconclusive")], [])
    assert (v.status, v.exit_code, [b.column for b in v.breaches]) == ("fail", 1, ["decision"])
    assert v.baseline_eligible is False and v.undecided[0].startswith("undecided: ")


def test_undecided_with_missing_history_is_not_a_baseline():
    history = comparison_outcome("insufficient_data", "insufficient_data")
    alone = decide_verdict([outcome(), history], [])
    assert alone.status == "inconclusive" and alone.baseline_eligible  # a new key builds its history
    both = decide_verdict([outcome(), history, comparison_outcome("undecided", "inconclusive")], [])
    assert both.status == "inconclusive" and both.baseline_eligible is False
    assert both.reason.startswith("1 infrastructure problem(s)")  # the undecided metric is not infra
    assert [e.split(":")[0] for e in both.infra_errors] == ["insufficient data"]
    assert [e.split(":")[0] for e in both.undecided] == ["undecided"]


def test_renderings_and_json_roundtrip():
    v = decide_verdict([outcome(success=False, observed={"unexpected_count": 1, "element_count": 3,
                                                 "unexpected_values": ["failed"]}),
                        not_produced("occupancy_summary")], ["flush | busy"], {"occupancy": "not_applicable"})
    text = format_verdict_table(v)
    assert text.startswith("VERDICT: INCONCLUSIVE (exit 2)")
    assert "serving_summary" in text and "<= 0" in text and "flush | busy" in text
    assert "occupancy_summary (stage skipped / not applicable)" in text
    md = verdict_markdown(v)
    assert "Verdict: **inconclusive**" in md and "- flush | busy" in md
    assert ("| serving_summary | failed | `expect_column_values_to_be_between` | 1 of 3 rows: \\['failed'\\] | <= 0 |"
            in md)
    assert "1 of 3 rows: ['failed']" in text
    again = Verdict.model_validate(json.loads(v.model_dump_json()))
    assert again == v and again.exit_code == 2


HOSTILE = "<img src=x onerror=alert(1)> | `rm -rf` [click](http://evil.example) **bold**\n\x1b[31mred"


def test_markdown_escapes_server_text():
    """A server's error text reaches the verdict's infra errors and breaches; in the Prefect
    artifact it must render as that text, not as HTML, a link, a code span or an extra column."""
    v = decide_verdict([outcome(success=False, observed=HOSTILE, allowed="<= 0 | x", source=HOSTILE)], [HOSTILE])
    md = verdict_markdown(v)
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)>" in md
    assert "[click](" not in md and "\\[click\\](http://evil.example)" in md
    assert "`rm" not in md.replace("\\`rm", "") and "\\*\\*bold\\*\\*" in md
    assert "\x1b" not in md
    infra = next(line for line in md.splitlines() if line.startswith("- "))
    assert infra.startswith("- &lt;img") and "red" in infra  # one list item: the line break is gone
    row = next(line for line in md.splitlines() if line.startswith("| serving_summary"))
    assert len(re.findall(r"(?<!\\)\|", row)) == 7  # six cells: the pipes in the text are escaped


def test_terminal_table_drops_escape_sequences():
    v = decide_verdict([outcome(success=False, observed=HOSTILE)], [HOSTILE])
    text = format_verdict_table(v)
    assert "\x1b" not in text and "red" in text


def test_exit_codes_are_defined_once_on_the_verdict():
    assert [(c.name, int(c)) for c in ExitCode] == [("PASS", 0), ("FAIL", 1), ("UNDECIDED", 2)]
    assert [ExitCode.of(s) for s in ("pass", "fail", "inconclusive")] == [0, 1, 2]
    v = decide_verdict([outcome(success=False, observed=3)], [])
    assert v.exit_code is ExitCode.FAIL and f"{v.exit_code}" == "1"
    assert "(exit 1)" in format_verdict_table(v) and "(exit 1)" in verdict_markdown(v)


def test_the_verdict_module_stays_light():
    # The command line takes ExitCode from it on every error path.
    code = ("import sys, servegate.verdict; "
            "print(sorted(m for m in ('pandas', 'great_expectations', 'servegate.validate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_undecided_entries_are_shown_under_their_own_heading_not_as_infrastructure():
    from servegate.render import UNDECIDED_HEADING, format_verdict_table, verdict_markdown

    v = decide_verdict([outcome(), comparison_outcome("undecided", "inconclusive")], [])
    for text in (format_verdict_table(v), verdict_markdown(v)):
        assert UNDECIDED_HEADING in text and "Infrastructure" not in text
        assert "undecided: comparison.decision" in text


def test_metric_rows_show_each_measured_number_with_its_bound_and_mark():
    from servegate.render import metric_rows

    outcomes = [o.model_dump(mode="json") for o in (
        outcome(column="p90_ttft_ms", observed=288.71, allowed="<= 5000"),
        outcome(column="failed", success=False, observed=3, allowed="<= 0"),
        outcome(table="one_batch", column="output_throughput", observed={"element_count": 2, "unexpected_count": 1},
                allowed=">= 3"),
        # a conditional check with no row to check (accept length without speculation): no row shown
        outcome(table="occupancy_summary", column="spec_accept_length_median",
                observed={"element_count": 0, "unexpected_count": 0}),
        not_produced("quality_accuracy"),
    )]
    outcomes.append({**outcomes[0], "column": "fwd_occupancy_median", "applicable": False, "observed": 12.0})
    comparison = [
        {"metric": "itl_median_ms", "case": "", "gated": True, "decision": "regression", "ratio": 1.2,
         "ci_low": 1.1, "ci_high": 1.3, "bound": 0.05, "current_median": 60.0, "baseline_median": 50.0},
        {"metric": "ttft_p90_ms", "case": "bs=1", "gated": True, "decision": "inconclusive", "ratio": 1.01,
         "ci_low": 0.9, "ci_high": 1.12, "bound": 0.05, "current_median": 10.1, "baseline_median": 10.0},
        {"metric": "output_throughput", "case": "", "gated": False, "decision": "report_only", "ratio": 1.0,
         "ci_low": 1.0, "ci_high": 1.0, "bound": 0.05, "current_median": 1.0, "baseline_median": 1.0},
    ]
    rows = metric_rows(outcomes, comparison)
    assert [r[:3] for r in rows] == [
        ["ok", "serving_summary.p90_ttft_ms", "288.7"],
        ["FAIL", "serving_summary.failed", "3"],
        ["ok", "one_batch.output_throughput", "2 row(s), 1 outside"],
        ["n/a", "serving_summary.fwd_occupancy_median", "12"],
        ["FAIL", "itl_median_ms", "60 vs 50"],
        ["UNDECIDED", "ttft_p90_ms [bs=1]", "10.1 vs 10"],
    ]
    assert rows[0][3] == "<= 5000" and rows[4][3] == "×1.2000 [1.1000, 1.3000] vs bound 5.0%"
    table = format_verdict_table(decide_verdict([outcome()], []), metrics=rows)
    assert table.index("serving_summary.p90_ttft_ms") < table.index("VERDICT: PASS")


def test_github_annotations_name_each_breach_and_undecided_metric_and_cannot_be_forged():
    from servegate.ci_output import annotations, comment_marker

    v = decide_verdict([outcome(success=False, observed=3, source="absolute: 50%\nnext"),
                        comparison_outcome("undecided", "inconclusive")], ["worker died: ::error::forged\r\nline"])
    lines = annotations(v, "smoke/embedded/cpu-2core/smollm2-135m")
    assert lines[0] == ("::error title=servegate smoke/embedded/cpu-2core/smollm2-135m%3A regression::"
                        "serving_summary.failed: observed 3, allowed <= 0 (absolute: 50%25%0Anext)")
    assert [line.split("::")[1].split(" title=")[0] for line in lines] == ["error", "warning", "warning"]
    assert "undecided::" in lines[1] and "comparison.decision" in lines[1]
    # a server's text cannot end the command early or start another one
    assert lines[2].endswith("could not decide::worker died: ::error::forged\N{REPLACEMENT CHARACTER}%0Aline")
    assert all("\n" not in line and "\r" not in line for line in lines)
    assert comment_marker("a,b:c") == "<!-- servegate:a%2Cb%3Ac -->"
