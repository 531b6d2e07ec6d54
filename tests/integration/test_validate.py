"""Real Great Expectations validation of stage tables built here, against real suite files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from servegate.config import available_profiles, load_config
from servegate.errors import ValidationSetupError
from servegate.suites import allowed_text, resolve_expectations_dir
from servegate.validate import TABLE_NOT_PRODUCED, load_suites, validate_tables
from servegate.verdict import decide_verdict

pytestmark = pytest.mark.timeout(120)

SHIPPED = ["smoke", "cpu-nightly", "sglang-h100", "vllm-h100"]
SKIPPED = {"type": "comparison", "column": {"name": "status"}, "operator": "==", "parameter": "skipped"}


def one_batch_table() -> pd.DataFrame:
    rows = []
    for bs, status in [(1, "measured"), (8, "measured"), (64, "skipped")]:
        measured = status == "measured"
        rows.append({
            "run_name": "default", "mode": "server", "batch_size": bs, "input_len": 64, "output_len": 16,
            "status": status, "skip_reason": None if measured else "batch_size 64 > max running requests 16",
            "latency": 1.5 if measured else None, "last_ttft": 0.2 if measured else None,
            "ttft_ms": 200.0 if measured else None, "input_throughput": 300.0 * bs if measured else None,
            "output_throughput": 20.0 * bs if measured else None, "overall_throughput": 50.0 * bs if measured else None,
            "prefill_latency": None, "median_decode_latency": None, "error": None,
        })
    return pd.DataFrame(rows)


def serving_requests_table(n: int = 24) -> pd.DataFrame:
    return pd.DataFrame({
        "request_id": range(n), "input_tokens": [64] * n, "output_tokens": [24] * n,
        "scheduled_send_s": [i * 0.25 for i in range(n)], "actual_send_s": [i * 0.25 + 0.001 for i in range(n)],
        "dispatch_lag_ms": [1.0] * n, "ttft_ms": [150.0 + i for i in range(n)],
        "e2e_latency_ms": [900.0 + i for i in range(n)], "tpot_ms": [30.0] * n,
        "itls_ms": [[30.0] * 23 for _ in range(n)], "success": [True] * n, "error": [None] * n,
    })


def serving_summary_table(n: int = 1000) -> pd.DataFrame:
    row = {"completed": n, "failed": 0, "duration_s": 60.0, "request_throughput": 4.0, "input_throughput": 256.0,
           "output_throughput": 96.0, "total_input_tokens": 64 * n, "total_output_tokens": 24 * n,
           "goodput": 4.0, "dispatch_lag_p50_ms": 0.5, "dispatch_lag_p99_ms": 3.0, "client_fell_behind": False,
           "num_prompts": n, "client_valid": True}
    for metric, base in [("ttft", 150.0), ("tpot", 30.0), ("itl", 30.0), ("e2e_latency", 900.0)]:
        for stat, factor in [("mean", 1.0), ("median", 1.0), ("std", 0.1), ("p90", 1.5), ("p95", 1.7), ("p99", 2.0)]:
            row[f"{stat}_{metric}_ms"] = base * factor
    return pd.DataFrame([row])


def occupancy_summary_table(occ: float = 97.0, accept: float | None = None) -> pd.DataFrame:
    return pd.DataFrame([{"n_samples": 30, "fwd_occupancy_median": occ, "fwd_occupancy_min": occ - 5,
                          "spec_accept_length_median": math.nan if accept is None else accept,
                          "token_usage_max": 0.1, "num_running_reqs_max": 1, "num_queue_reqs_max": 0,
                          "speculative_decoding": accept is not None}])


def comparison_table(decisions=("no_change", "improvement", "report_only"), gated=(True, True, False)):
    return pd.DataFrame({"metric": [f"m{i}" for i in range(len(decisions))], "decision": list(decisions),
                         "gated": list(gated), "ratio": [1.0] * len(decisions)})


def passing_tables() -> dict[str, pd.DataFrame]:
    return {"one_batch": one_batch_table(), "serving_requests": serving_requests_table(),
            "serving_summary": serving_summary_table(), "occupancy_summary": occupancy_summary_table(),
            "comparison": comparison_table(),
            "quality_accuracy": pd.DataFrame([{"n_items": 250, "accuracy": 0.676, "accuracy_stderr": 0.03}]),
            "quality_agreement": pd.DataFrame([{"n_prompts": 8, "exact_match_rate": 0.5,
                                                "within_tolerance_rate": 1.0}])}


def test_comparison_regression_fails_and_missing_history_is_inconclusive():
    tables = passing_tables()
    tables["comparison"] = comparison_table(("regression", "no_change", "report_only"), (True, True, False))
    verdict = decide_verdict(validate_tables(tables, "smoke"), [])
    assert verdict.status == "fail" and [b.column for b in verdict.breaches] == ["decision"]
    tables["comparison"] = comparison_table(("insufficient_data", "insufficient_data"), (True, False))
    verdict = decide_verdict(validate_tables(tables, "smoke"), [])
    assert verdict.status == "inconclusive" and verdict.breaches == []
    assert any("insufficient data" in e for e in verdict.infra_errors)
    assert verdict.baseline_eligible  # so that a new gate key can build its history


def test_undecided_gated_comparison_is_inconclusive_never_a_pass():
    # decision inconclusive: the ratio's interval straddles the bound (e.g. x1.55, CI 0.90-2.56), so a
    # +55 % regression is neither shown nor excluded. Not a breach, not a pass, and no baseline.
    tables = passing_tables()
    tables["comparison"] = comparison_table(("no_change", "inconclusive", "report_only"), (True, True, False))
    verdict = decide_verdict(validate_tables(tables, "cpu-nightly"), [])
    assert (verdict.status, verdict.exit_code, verdict.breaches) == ("inconclusive", 2, [])
    assert verdict.baseline_eligible is False
    assert verdict.infra_errors == []
    [entry] = verdict.undecided
    assert entry.startswith("undecided: comparison.decision") and "['inconclusive']" in entry, entry
    # With a regression on another gated metric the run fails: an undecided metric hides no regression.
    tables["comparison"] = comparison_table(("regression", "inconclusive"), (True, True))
    verdict = decide_verdict(validate_tables(tables, "cpu-nightly"), [])
    assert verdict.status == "fail" and [b.column for b in verdict.breaches] == ["decision"]


@pytest.mark.parametrize("decisions, gated", [
    (("no_change", "inconclusive"), (True, False)),  # not gated: shown, never decides
    (("no_change", "improvement", "report_only"), (True, True, False)),
])
def test_undecided_rule_leaves_decided_and_ungated_rows_alone(decisions, gated):
    tables = passing_tables()
    tables["comparison"] = comparison_table(decisions, gated)
    verdict = decide_verdict(validate_tables(tables, "cpu-nightly"), [])
    assert (verdict.status, verdict.infra_errors, verdict.undecided, verdict.baseline_eligible) == \
        ("pass", [], [], True)


@pytest.mark.parametrize("profile", available_profiles())
def test_every_comparing_profile_keeps_an_undecided_gated_metric_from_passing(profile):
    config = load_config(profile=profile)
    suites = load_suites(config.validate_.expectation_profile)
    if "comparison" not in suites:
        assert not config.compare.enabled, f"{profile} compares with its baseline but has no comparison suite"
        pytest.skip(f"{profile} has no baseline comparison")
    tables = {"comparison": comparison_table(("no_change", "inconclusive"), (True, True))}
    outcomes = [o for o in validate_tables(tables, config.validate_.expectation_profile) if o.table == "comparison"]
    verdict = decide_verdict(outcomes, [])
    assert verdict.status == "inconclusive" and verdict.breaches == [] and not verdict.baseline_eligible
    assert verdict.infra_errors == [] and [e.split(":")[0] for e in verdict.undecided] == ["undecided"]


def paired_rounds_table(a_values: list[float]) -> pd.DataFrame:
    b = [2.0 * v for v in a_values]
    return pd.DataFrame({"round": range(1, len(a_values) + 1), "metric": "itl_median_ms", "a_value": a_values,
                         "b_value": b, "log_ratio": [math.log(y / x) if x > 0 else math.nan
                                                     for x, y in zip(a_values, b)]})


@pytest.mark.parametrize("profile", [p for p in available_profiles()
                                     if "paired_rounds" in load_suites(load_config(profile=p)
                                                                       .validate_.expectation_profile)])
def test_a_paired_round_without_a_log_ratio_is_an_invalid_measurement_never_a_regression(profile):
    # A block median of 0 (a client that timed events wrongly) or NaN has no log ratio: the round measured
    # nothing an interval can use. That is a broken measurement (inconclusive, exit 2), not a regression.
    suite = load_config(profile=profile).validate_.expectation_profile
    ok = decide_verdict([o for o in validate_tables({"paired_rounds": paired_rounds_table([40.0, 41.0, 39.0])}, suite)
                         if o.table == "paired_rounds"], [])
    assert (ok.status, ok.breaches, ok.infra_errors) == ("pass", [], [])
    for broken in (0.0, math.nan):
        outcomes = [o for o in validate_tables({"paired_rounds": paired_rounds_table([40.0, broken, 39.0])}, suite)
                    if o.table == "paired_rounds"]
        verdict = decide_verdict(outcomes, [])
        assert (verdict.status, verdict.exit_code, verdict.breaches) == ("inconclusive", 2, []), verdict
        assert any(e.startswith("invalid measurement: paired_rounds.log_ratio") for e in verdict.infra_errors)


def write_suite(directory: Path, profile: str, suites: dict) -> Path:
    path = directory / f"{profile}.json"
    path.write_text(json.dumps({"profile": profile, "description": "test", "suites": suites}))
    return directory


def exp(type_: str, **kwargs) -> dict:
    return {"type": type_, "kwargs": kwargs, "meta": {"source": "test threshold", "measured": 1.0}}


# ---- shipped suites ----------------------------------------------------------------------
def test_default_dir_is_repo_expectations():
    assert resolve_expectations_dir() == Path(__file__).resolve().parents[2] / "expectations"


@pytest.mark.parametrize("profile", available_profiles())
def test_no_shipped_expectation_is_lost_when_its_suite_is_built(profile):
    # GX upserts a suite's expectations by type, column and row_condition unless told to match on
    # every kwarg (validate.py: match_type="runtime"): a second check on the same domain
    # (comparison.decision on gated rows: insufficient_data, then undecided) would silently replace the first.
    written = json.loads((resolve_expectations_dir() / f"{profile}.json").read_text())["suites"]
    built = load_suites(profile)
    assert {t: len(spec["expectations"]) for t, spec in written.items()} == \
        {t: len(suite.expectations) for t, suite in built.items()}


@pytest.mark.parametrize("profile", SHIPPED)
def test_shipped_suite_loads_and_passes_plausible_tables(profile):
    suites = load_suites(profile)
    assert {"one_batch", "serving_summary", "serving_requests"} <= set(suites)
    for suite in suites.values():
        for e in suite.expectations:
            assert e.meta["source"], e  # every threshold has a provenance
    outcomes = validate_tables(passing_tables(), profile)
    failed = [o for o in outcomes if o.success is not True]
    assert failed == []
    assert decide_verdict(outcomes, []).status == "pass"


def test_shipped_suites_fail_on_failed_requests_and_low_occupancy():
    tables = passing_tables()
    tables["serving_summary"].loc[0, "failed"] = 3
    tables["occupancy_summary"] = occupancy_summary_table(occ=90.0)
    breaches = {(o.table, o.column) for o in validate_tables(tables, "sglang-h100") if o.success is False}
    assert breaches == {("serving_summary", "failed"), ("occupancy_summary", "fwd_occupancy_median")}


@pytest.mark.parametrize("profile", ["smoke", "cpu-nightly", "sglang-h100"])
def test_an_engine_without_the_occupancy_gauge_is_not_applicable_never_a_breach(profile):
    # An engine whose capabilities say it has no forward-occupancy gauge (vLLM, external): the stage
    # writes fwd_occupancy_applicable=False and NaN occupancy. Judged anyway, the not-null and floor
    # checks would blame the engine for a missing feature (issue 11, finding 8: exit 1).
    tables = passing_tables()
    tables["occupancy_summary"] = occupancy_summary_table(occ=math.nan).assign(fwd_occupancy_applicable=False)
    outcomes = validate_tables(tables, profile)
    skipped = [o for o in outcomes if not o.applicable]
    assert {(o.table, o.column) for o in skipped} == {("occupancy_summary", "fwd_occupancy_median")}
    assert all(o.success is None and o.reason.startswith("not applicable") for o in skipped)
    verdict = decide_verdict(outcomes, [])
    assert verdict.status == "pass" and verdict.breaches == [], verdict
    assert "occupancy_summary.fwd_occupancy_median" in verdict.not_applicable
    assert verdict.summary.not_applicable == len(skipped)
    # With the gauge, the same NaN is a breach of the not-null check: applies_when hides nothing else.
    tables["occupancy_summary"]["fwd_occupancy_applicable"] = True
    assert decide_verdict(validate_tables(tables, profile), []).status == "fail"


def test_spec_accept_length_judged_only_when_present():
    tables = passing_tables()
    tables["occupancy_summary"] = occupancy_summary_table(accept=None)
    spec = [o for o in validate_tables(tables, "sglang-h100") if o.column == "spec_accept_length_median"]
    assert [o.success for o in spec] == [True]
    tables["occupancy_summary"] = occupancy_summary_table(accept=1.2)
    spec = [o for o in validate_tables(tables, "sglang-h100") if o.column == "spec_accept_length_median"]
    assert [o.success for o in spec] == [False]
    observed = spec[0].observed
    assert (observed == 1.2 or observed["unexpected_values"] == [1.2]) and spec[0].allowed.startswith("> 1.8")
    assert "fwd_occupancy_kit.py" in spec[0].meta["source"]


# ---- each failing expectation type, observed/allowed extraction --------------------------------
@pytest.fixture()
def suite_dir(tmp_path: Path) -> Path:
    return write_suite(tmp_path, "t", {
        "one_batch": {"expectations": [
            exp("expect_column_values_to_be_in_set", column="status", value_set=["measured", "skipped"]),
            exp("expect_column_values_to_not_be_null", column="skip_reason", row_condition=SKIPPED),
        ]},
        "serving_summary": {"expectations": [
            exp("expect_column_values_to_be_between", column="failed", max_value=0),
            exp("expect_column_values_to_be_between", column="completed", min_value=24),
            exp("expect_column_values_to_be_between", column="p90_ttft_ms", max_value=1000),
            exp("expect_column_values_to_be_in_set", column="client_fell_behind", value_set=[False]),
        ]},
        "occupancy_summary": {"expectations": [
            exp("expect_column_values_to_be_between", column="fwd_occupancy_median", min_value=50),
        ]},
    })


def by_column(outcomes):
    return {(o.table, o.column): o for o in outcomes}


def test_all_pass(suite_dir):
    outcomes = validate_tables(passing_tables(), "t", suite_dir)
    assert len(outcomes) == 7 and all(o.success is True for o in outcomes)
    ok = by_column(outcomes)
    assert ok[("serving_summary", "p90_ttft_ms")].observed == 225.0  # one-row table: the value itself
    assert ok[("serving_summary", "p90_ttft_ms")].allowed == "<= 1000"
    assert ok[("serving_summary", "failed")].meta == {"source": "test threshold", "measured": 1.0}


def test_each_failing_expectation(suite_dir):
    tables = passing_tables()
    ob = tables["one_batch"]
    ob.loc[1, "status"] = "failed"
    ob.loc[2, "skip_reason"] = None  # skipped without a reason
    summary = tables["serving_summary"]
    summary.loc[0, ["failed", "completed", "p90_ttft_ms", "client_fell_behind"]] = [2, 22, 1500.5, True]
    tables["occupancy_summary"] = occupancy_summary_table(occ=42.0)

    out = by_column(validate_tables(tables, "t", suite_dir))
    assert all(o.success is False for o in out.values()), out

    status = out[("one_batch", "status")]
    assert status.observed == {"unexpected_count": 1, "element_count": 3, "unexpected_values": ["failed"]}
    assert status.allowed == "in [measured, skipped]"
    reason = out[("one_batch", "skip_reason")]
    assert reason.observed["unexpected_count"] == 1 and reason.observed["element_count"] == 1
    assert reason.allowed == "not null where status == 'skipped'"

    assert out[("serving_summary", "failed")].observed == 2
    assert out[("serving_summary", "failed")].allowed == "<= 0"
    assert out[("serving_summary", "completed")].observed == 22
    assert out[("serving_summary", "completed")].allowed == ">= 24"
    assert out[("serving_summary", "p90_ttft_ms")].observed == 1500.5
    assert out[("serving_summary", "client_fell_behind")].observed is True
    assert out[("serving_summary", "client_fell_behind")].allowed == "in [False]"
    assert out[("occupancy_summary", "fwd_occupancy_median")].observed == 42.0
    assert out[("occupancy_summary", "fwd_occupancy_median")].allowed == ">= 50"

    verdict = decide_verdict(list(out.values()), [])
    assert verdict.status == "fail" and len(verdict.breaches) == 7


def test_missing_table_is_not_produced(suite_dir):
    tables = passing_tables()
    del tables["occupancy_summary"]
    outcomes = validate_tables(tables, "t", suite_dir)
    occ = [o for o in outcomes if o.table == "occupancy_summary"]
    assert [(o.success, o.table_produced, o.reason) for o in occ] == [(None, False, TABLE_NOT_PRODUCED)]
    assert decide_verdict(outcomes, [], {"occupancy": "not_applicable"}).status == "pass"
    assert decide_verdict(outcomes, []).status == "inconclusive"


def test_empty_table_and_missing_column_are_infra(suite_dir):
    tables = passing_tables()
    tables["serving_summary"] = serving_summary_table().iloc[0:0]
    tables["occupancy_summary"] = occupancy_summary_table().drop(columns=["fwd_occupancy_median"])
    outcomes = validate_tables(tables, "t", suite_dir)
    bad = [o for o in outcomes if o.success is None]
    assert {o.table for o in bad} == {"serving_summary", "occupancy_summary"} and len(bad) == 5
    assert all(o.table_produced for o in bad)
    assert all("insufficient data" in o.reason for o in bad if o.table == "serving_summary")
    assert "fwd_occupancy_median" in next(o.reason for o in bad if o.table == "occupancy_summary")
    verdict = decide_verdict(outcomes, [])
    assert verdict.status == "inconclusive" and verdict.breaches == []


def test_all_skipped_grid_breaches_contain_set():
    tables = passing_tables()
    tables["one_batch"]["status"] = "skipped"
    tables["one_batch"]["skip_reason"] = "over capacity"
    out = [o for o in validate_tables(tables, "smoke") if o.expectation_type.endswith("_to_contain_set")]
    assert [(o.success, o.observed, o.allowed) for o in out] == [
        (False, {"missing_values": ["measured"]}, "contains [measured]")]


def test_measured_decode_condition_exempts_single_token_cases():
    tables = passing_tables()
    ob = tables["one_batch"]
    ob.loc[0, ["output_len", "output_throughput"]] = [1, math.nan]  # no decode window: NaN by design
    assert all(o.success for o in validate_tables(tables, "smoke") if o.table == "one_batch")
    ob.loc[1, "output_throughput"] = math.nan  # a multi-token measured case without throughput
    bad = [o for o in validate_tables(tables, "smoke") if o.success is False]
    assert [(o.column, o.allowed) for o in bad] == [
        ("output_throughput", "not null where status == 'measured' and output_len > 1")]


def test_table_level_expectation_and_mostly(tmp_path):
    d = write_suite(tmp_path, "t", {"serving_requests": {"expectations": [
        exp("expect_table_row_count_to_be_between", min_value=30),
        exp("expect_column_values_to_be_between", column="ttft_ms", max_value=160, mostly=0.9),
    ]}})
    rows, ttft = validate_tables({"serving_requests": serving_requests_table()}, "t", d)
    assert (rows.success, rows.observed, rows.allowed, rows.column) == (False, 24, ">= 30", None)
    assert ttft.success is False and ttft.allowed == "<= 160 for at least 90% of rows"


# ---- setup errors -----------------------------------------------------------------------
def test_missing_suite_file(tmp_path):
    with pytest.raises(ValidationSetupError, match=r"nope\.json does not exist"):
        load_suites("nope", tmp_path)


def test_env_override(tmp_path, monkeypatch):
    write_suite(tmp_path, "envprof", {"serving_summary": {"expectations": [
        exp("expect_column_values_to_be_between", column="failed", max_value=0)]}})
    monkeypatch.setenv("SERVEGATE_EXPECTATIONS_DIR", str(tmp_path))
    assert list(load_suites("envprof")) == ["serving_summary"]


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    (json.dumps({"profile": "bad", "suites": {"one_batch": {"expectations": [{"type": "x"}]}}}), "meta"),
    (json.dumps({"profile": "bad", "suites": {}, "extra": 1}), "extra"),
    (json.dumps({"profile": "other", "suites": {}}), "must equal the file name"),
    (json.dumps({"profile": "bad", "suites": {"one_bach": {"expectations": []}}}), "unknown table 'one_bach'"),
    (json.dumps({"profile": "bad", "suites": {"one_batch": {"expectations": [
        {"type": "expect_column_values_to_be_between", "kwargs": {"column": "x", "max_value": 1}, "meta": {}}]}}}),
     "no meta.source"),
    (json.dumps({"profile": "bad", "suites": {"one_batch": {"expectations": [
        exp("expect_column_values_to_be_betwen", column="x", max_value=1)]}}}),
     "did you mean \\['expect_column_values_to_be_between'"),
    (json.dumps({"profile": "bad", "suites": {"one_batch": {"expectations": [
        exp("expect_column_values_to_be_between", column="x", max_valu=1)]}}}), "invalid kwargs"),
])
def test_malformed_suite_file(tmp_path, content, message):
    (tmp_path / "bad.json").write_text(content)
    with pytest.raises(ValidationSetupError, match=message) as info:
        load_suites("bad", tmp_path)
    assert "bad.json" in str(info.value)


def test_allowed_text_forms():
    assert allowed_text("expect_column_values_to_be_between", {"min_value": 1.8, "strict_min": True}) == "> 1.8"
    assert allowed_text("expect_column_values_to_be_between", {"min_value": 1, "max_value": 2}) == ">= 1 and <= 2"
    assert allowed_text("expect_column_values_to_not_be_in_set", {"value_set": ["failed"]}) == "not in [failed]"


def test_two_checks_of_one_column_on_the_same_rows_both_run(tmp_path):
    # Both entries name the same type, column and plain row_condition, with different value sets:
    # GX's default matching kept only the second (the "insufficient_data" check was lost).
    gated = {"type": "comparison", "column": {"name": "gated"}, "operator": "==", "parameter": True}
    entries = [{"type": "expect_column_values_to_not_be_in_set",
                "kwargs": {"column": "decision", "value_set": [value], "row_condition": gated},
                "meta": {"source": f"test: not {value}"}} for value in ("insufficient_data", "inconclusive")]
    (tmp_path / "twice.json").write_text(json.dumps({"profile": "twice", "description": "test",
                                                     "suites": {"comparison": {"expectations": entries}}}))
    built = load_suites("twice", tmp_path)
    assert sorted(e.value_set[0] for e in built["comparison"].expectations) == \
        ["inconclusive", "insufficient_data"]
