"""The history rule (``compare.consecutive``): ``compare_run`` against a real SQLite history store whose
nights were compared and recorded the way the gate does it (comparison table recorded with the run)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from servegate.baseline import mark_distribution_change
from servegate.compare import DECISIONS, compare_run
from servegate.errors import ConfigError
from servegate.gated_metrics import GATED_METRICS
from servegate.history import GateKey, Store

KEY = GateKey("smoke", "embedded", "cpu", "smollm2-135m")
T0 = datetime(2026, 11, 1, 2, 0, tzinfo=timezone.utc)
# Two median metrics of the serving stage: enough to see the rule per metric, cheap to bootstrap.
METRICS = [m for m in GATED_METRICS if m.metric in ("serving.itl_ms.median", "serving.ttft_ms.median")]
ITL = "serving.itl_ms.median"
SLOW = 1.6  # every latency 60 % higher: far beyond the 5 % bound, whatever the seed


def serving_tables(seed: int, slowdown: float = 1.0, n: int = 96) -> dict[str, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    itls = [list(rng.lognormal(np.log(40.0), 0.1, 16) * slowdown) for _ in range(n)]
    ttft = rng.lognormal(np.log(120.0), 0.1, n) * slowdown
    return {"serving_requests": pd.DataFrame({
        "request_id": [f"r{i}" for i in range(n)], "ttft_ms": ttft, "itls_ms": itls,
        "tpot_ms": [float(np.mean(x)) for x in itls], "e2e_latency_ms": ttft + [sum(x) for x in itls],
        "success": np.ones(n, dtype=bool)})}


@pytest.fixture()
def store(tmp_path: Path) -> Store:
    with Store(f"sqlite:///{tmp_path / 'history.db'}") as s:
        yield s


def night(store: Store, run_id: str, day: float, *, slowdown: float = 1.0, consecutive: int = 1,
          attempt_of: str | None = None, compare: bool = True) -> tuple[str, pd.DataFrame]:
    """One night as the gate runs it: compare (the run not recorded yet), then record the run with its
    comparison table; a regression or suspicious row makes it no baseline (fail / inconclusive).
    ``compare=False``: compare disabled that night (a passing run without a comparison table)."""
    tables = serving_tables(int(day * 10), slowdown)
    comparison = compare_run(store, tables, KEY, metrics=METRICS, n_boot=400, exclude_run=attempt_of,
                             consecutive=consecutive)
    decisions = set(comparison.loc[comparison["gated"], "decision"]) if compare else {"no_change"}
    status = "fail" if "regression" in decisions else "pass" if decisions <= {"no_change", "improvement"} \
        else "inconclusive"
    manifest = {"schema_version": "1", "run_id": run_id, "gate": KEY.workload, "engine": KEY.engine,
                "hardware": KEY.hardware, "model": KEY.model, "started_at": (T0 + timedelta(days=day)).isoformat(),
                "stages": []}
    config = {"name": KEY.workload, "hardware": KEY.hardware, "worker": {"engine": KEY.engine, "model": KEY.model}}
    verdict = {"status": status, "baseline_eligible": status == "pass" or decisions == {"insufficient_data"}}
    recorded = store.record_run(manifest, config, {**tables, "comparison": comparison} if compare else tables, [],
                                verdict, attempt_of=attempt_of)
    return recorded, comparison


def row(comparison: pd.DataFrame, metric: str = ITL) -> dict:
    [found] = comparison[comparison["metric"] == metric].to_dict("records")
    return found


def clean_history(store: Store) -> list[str]:
    """Three nights of the unchanged worker: the first has no history, the next two no change."""
    ids = [night(store, f"night-{i}", i)[0] for i in range(3)]
    recorded = store.tables(ids[-1], {"comparison"})["comparison"]  # the rule reads what was recorded
    assert row(recorded)["decision"] == "no_change", recorded
    return ids


def test_suspicious_is_a_decision() -> None:
    assert "suspicious" in DECISIONS


def test_one_regressed_night_is_suspicious_and_the_second_in_a_row_a_regression(store: Store) -> None:
    clean_history(store)
    first, cmp_a = night(store, "slow-a", 3, slowdown=SLOW, consecutive=2)
    itl = row(cmp_a)
    assert itl["decision"] == "suspicious" and itl["ci_low"] > 1.05, itl
    assert itl["reason"] == ("regression in 1 of the last 2 run(s) (compare.consecutive = 2; the streak breaks at "
                             "run night-2 (no_change)): not yet called; the next run decides"), itl["reason"]
    assert set(cmp_a.loc[cmp_a["gated"], "decision"]) == {"suspicious"}, cmp_a
    # The suspicious night is no baseline: the next night is still compared with the clean ones.
    _, cmp_b = night(store, "slow-b", 4, slowdown=SLOW, consecutive=2)
    itl = row(cmp_b)
    assert itl["decision"] == "regression" and itl["reason"] == "2 consecutive runs: this run, slow-a", itl
    assert set(itl["baseline_runs"].split(",")) == {"night-0", "night-1", "night-2"}, itl
    # Three in a row: the suspicious night and the regressed one both count.
    _, cmp_c = night(store, "slow-c", 5, slowdown=SLOW, consecutive=3)
    assert row(cmp_c)["reason"] == "3 consecutive runs: this run, slow-b, slow-a", row(cmp_c)


def test_a_clean_night_between_breaks_the_streak(store: Store) -> None:
    clean_history(store)
    night(store, "slow-a", 3, slowdown=SLOW, consecutive=2)
    night(store, "clean", 4, consecutive=2)
    _, cmp = night(store, "slow-b", 5, slowdown=SLOW, consecutive=2)
    assert row(cmp)["decision"] == "suspicious" and "breaks at run clean (no_change)" in row(cmp)["reason"], cmp
    _, cmp3 = night(store, "slow-c", 6, slowdown=SLOW, consecutive=3)
    itl = row(cmp3)
    assert itl["decision"] == "suspicious", itl
    assert itl["reason"].startswith("regression in 2 of the last 3 run(s) (compare.consecutive = 3; the streak "
                                    "breaks at run clean (no_change)): not yet called; the next run decides")
    # Three in a row asked right after a clean night: two more regressed nights decide.
    night(store, "clean-2", 7, consecutive=3)
    _, cmp4 = night(store, "slow-d", 8, slowdown=SLOW, consecutive=3)
    assert row(cmp4)["reason"].endswith("breaks at run clean-2 (no_change)): not yet called; 2 more runs in a row "
                                        "decide"), row(cmp4)


def test_runs_that_did_not_compare_are_skipped_and_a_distribution_change_restarts_every_streak(store: Store) -> None:
    night(store, "night-0", 0)
    _, cmp = night(store, "slow-a", 1, slowdown=SLOW, consecutive=2)
    assert row(cmp)["reason"].startswith(  # a row that decided nothing breaks a streak too
        "regression in 1 of the last 2 run(s) (compare.consecutive = 2; the streak breaks at run night-0 "
        "(insufficient_data))"), row(cmp)
    night(store, "no-compare", 2, compare=False)  # compare disabled that night: it says nothing either way
    _, cmp = night(store, "slow-b", 3, slowdown=SLOW, consecutive=3)
    assert row(cmp)["reason"].startswith(
        "regression in 2 of the last 3 run(s) (compare.consecutive = 3; the streak breaks at run night-0 "
        "(insufficient_data))"), row(cmp)
    mark_distribution_change(store, KEY, reason="new tokenizer", at=T0 + timedelta(days=3, hours=1))
    night(store, "night-4", 4, compare=False)  # the new baseline
    _, cmp = night(store, "slow-c", 5, slowdown=SLOW, consecutive=3)
    assert row(cmp)["reason"] == ("regression in 1 of the last 1 run(s) (compare.consecutive = 3; only 0 earlier "
                                  "run(s) of the gate key compared it): not yet called; 2 more runs in a row decide")
    _, cmp = night(store, "slow-d", 6, slowdown=SLOW, consecutive=3)
    assert row(cmp)["reason"] == ("regression in 2 of the last 2 run(s) (compare.consecutive = 3; only 1 earlier "
                                  "run(s) of the gate key compared it): not yet called; the next run decides")
    _, cmp = night(store, "slow-e", 7, slowdown=SLOW, consecutive=3)
    assert row(cmp)["decision"] == "regression", row(cmp)
    assert row(cmp)["reason"] == "3 consecutive runs: this run, slow-d, slow-c"  # slow-a, slow-b: before the change


def test_consecutive_1_calls_every_regression_at_once(store: Store) -> None:
    clean_history(store)
    _, one = night(store, "slow-a", 3, slowdown=SLOW, consecutive=1)
    itl = row(one)
    assert itl["decision"] == "regression" and itl["reason"] is None, itl
    # The rule only relabels: the same run with consecutive=2 has the same intervals, one decision changed.
    two = compare_run(store, serving_tables(30, SLOW), KEY, metrics=METRICS, n_boot=400, exclude_run="slow-a",
                      consecutive=2)
    pd.testing.assert_frame_equal(one.drop(columns=["decision", "reason"]), two.drop(columns=["decision", "reason"]))
    assert set(two.loc[two["gated"], "decision"]) == {"suspicious"}


def test_a_rerun_of_the_same_night_is_not_a_second_night(store: Store) -> None:
    clean_history(store)
    first, _ = night(store, "slow-a", 3, slowdown=SLOW, consecutive=2)
    # servegate rerun slow-a: its own group is left out, so the night before it decides.
    rerun, cmp = night(store, "slow-a", 3.1, slowdown=SLOW, consecutive=2, attempt_of=first)
    assert rerun == "slow-a.attempt-2"
    assert row(cmp)["decision"] == "suspicious" and "breaks at run night-2" in row(cmp)["reason"], row(cmp)
    # The next night sees the group once (its latest attempt): with three in a row asked, night-2 breaks it.
    _, cmp = night(store, "slow-b", 4, slowdown=SLOW, consecutive=3)
    itl = row(cmp)
    assert itl["decision"] == "suspicious" and itl["reason"].startswith(
        "regression in 2 of the last 3 run(s) (compare.consecutive = 3; the streak breaks at run night-2"), itl
    assert "slow-a.attempt-2" not in itl["reason"]
    _, cmp = night(store, "slow-c", 5, slowdown=SLOW, consecutive=2)
    assert row(cmp)["reason"] == "2 consecutive runs: this run, slow-b", row(cmp)


def test_a_recorded_run_judged_again_sees_only_the_runs_before_it(store: Store) -> None:
    clean_history(store)
    night(store, "slow-a", 3, slowdown=SLOW, consecutive=2)
    night(store, "slow-b", 4, slowdown=SLOW, consecutive=2)
    again = compare_run(store, "slow-a", metrics=METRICS, n_boot=400, consecutive=2)
    assert row(again)["decision"] == "suspicious" and "night-2" in row(again)["reason"], row(again)
    again = compare_run(store, "slow-b", metrics=METRICS, n_boot=400, consecutive=2)
    assert row(again)["reason"] == "2 consecutive runs: this run, slow-a", row(again)


@pytest.mark.parametrize("bad", [0, 11, 2.0, True])
def test_consecutive_out_of_range_is_a_clear_error(store: Store, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"consecutive must be an integer from 1 to 10 \(compare.consecutive\)"):
        compare_run(store, serving_tables(1), KEY, metrics=METRICS, n_boot=100, consecutive=bad)


def test_status_names_the_suspicious_metrics_with_the_rule_s_reason(store: Store) -> None:
    from servegate.commands.history import format_status, status_rows

    clean_history(store)
    _, cmp = night(store, "slow-a", 3, slowdown=SLOW, consecutive=2)
    [latest] = status_rows(store)
    assert latest["run_id"] == "slow-a" and latest["failing"] == [], latest
    shown = {s["metric"]: s for s in latest["suspicious"]}
    assert sorted(shown) == sorted(m.metric for m in METRICS), latest["suspicious"]
    assert shown[ITL]["reason"] == row(cmp)["reason"] and shown[ITL]["ratio"] == pytest.approx(row(cmp)["ratio"])
    text = format_status([latest])
    assert f"- suspicious: {ITL} ×" in text and "(regression in 1 of the last 2 run(s)" in text, text
