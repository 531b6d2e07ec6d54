"""The baseline comparison: decisions, intervals, sample-size rules (synthetic contract-shaped tables)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from servegate.bootstrap import ratio_ci_median, ratio_ci_quantile
from servegate.compare import compare_tables, decide_change
from servegate.gated_metrics import GATED_METRICS, extract_requests, extract_samples
from servegate.errors import ConfigError
from servegate.tables import COMPARISON_COLUMNS


def _serving(seed: int, *, n: int = 256, scale: float = 1.0, run_shift: float = 1.0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    itls = [list(rng.lognormal(np.log(40.0), 0.15, 16) * scale * run_shift) for _ in range(n)]
    ttft = rng.lognormal(np.log(120.0), 0.2, n) * scale * run_shift
    success = np.ones(n, dtype=bool)
    success[0] = False  # a failed request: its latencies must not count
    ttft[0] = 1e6
    return pd.DataFrame({"request_id": range(n), "ttft_ms": ttft, "itls_ms": itls,
                         "tpot_ms": [np.mean(x) for x in itls], "e2e_latency_ms": ttft + [sum(x) for x in itls],
                         "success": success})


def _one_batch(seed: int, *, repeats: int = 1, scale: float = 1.0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = [{"batch_size": bs, "input_len": 128, "output_len": 32, "status": "measured",
             "latency": 0.5 * bs ** 0.5 * scale * rng.normal(1, 0.01), "output_throughput": 64 * bs / scale}
            for _ in range(repeats) for bs in (1, 8)]
    rows.append({"batch_size": 64, "input_len": 128, "output_len": 32, "status": "skipped", "latency": np.nan,
                 "output_throughput": np.nan})
    return pd.DataFrame(rows)


def _occupancy(seed: int, level: float = 80.0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    occ = rng.normal(level, 2.0, 40)
    occ[0] = np.nan
    return pd.DataFrame({"t_s": np.arange(40) * 0.5, "fwd_occupancy": occ})


def _run(seed: int, *, scale: float = 1.0, occupancy: float = 80.0, repeats: int = 1,
         run_shift: float = 1.0) -> dict[str, pd.DataFrame]:
    return {"serving_requests": _serving(seed, scale=scale, run_shift=run_shift),
            "one_batch": _one_batch(seed, repeats=repeats, scale=scale),
            "occupancy_samples": _occupancy(seed, occupancy)}


def _baseline(n_runs: int = 5, **kw: float) -> list[tuple[str, dict[str, pd.DataFrame]]]:
    return [(f"b{i}", _run(100 + i, **kw)) for i in range(n_runs)]


def _by_metric(df: pd.DataFrame, metric: str, case: str = "") -> dict:
    rows = df[(df["metric"] == metric) & (df["case"] == case)]
    assert len(rows) == 1, (metric, case, df[["metric", "case"]])
    return rows.iloc[0].to_dict()


@pytest.mark.parametrize(("low", "high", "direction", "expected"), [
    (1.10, 1.40, "lower_is_better", "regression"),
    (0.80, 0.90, "lower_is_better", "improvement"),
    (0.97, 1.04, "lower_is_better", "no_change"),
    (0.90, 1.04, "lower_is_better", "no_change"),  # better or equal: a regression >= 5 % is excluded
    (1.01, 1.08, "lower_is_better", "inconclusive"),  # maybe a regression, not shown
    (0.60, 0.90, "higher_is_better", "regression"),
    (1.06, 1.20, "higher_is_better", "improvement"),
    (0.96, 1.10, "higher_is_better", "no_change"),
    (0.93, 1.02, "higher_is_better", "inconclusive"),
    (math.nan, 1.5, "lower_is_better", "inconclusive"),
])
def test_decide_change(low: float, high: float, direction: str, expected: str) -> None:
    assert decide_change(low, high, direction, 0.05) == expected


def test_extract_samples_counts_only_successful_requests_and_measured_cases() -> None:
    run = _run(1)
    itl = next(m for m in GATED_METRICS if m.name == "serving.itl_ms" and m.statistic == "median")
    ttft = next(m for m in GATED_METRICS if m.name == "serving.ttft_ms")
    thr = next(m for m in GATED_METRICS if m.name == "one_batch.output_throughput")
    occ = next(m for m in GATED_METRICS if m.name == "occupancy.fwd_occupancy")
    assert extract_samples(itl, run)[""].size == 255 * 16
    assert extract_samples(ttft, run)[""].max() < 1e6
    assert sorted(extract_samples(thr, run)) == ["bs=1,in=128,out=32", "bs=8,in=128,out=32"]
    assert extract_samples(occ, run)[""].size == 39  # the NaN window start is dropped
    assert extract_samples(ttft, {}) == {}


def test_aa_runs_show_no_change_and_the_table_has_the_contract_columns() -> None:
    df = compare_tables(_run(7), _baseline(), baseline_policy="last 5 passing")
    assert list(df.columns) == COMPARISON_COLUMNS
    for metric in ("serving.ttft_ms.median", "serving.itl_ms.median", "serving.tpot_ms.median",
                   "serving.e2e_latency_ms.median", "occupancy.fwd_occupancy.median"):
        row = _by_metric(df, metric)
        assert row["decision"] == "no_change", row
        assert row["ci_low"] < row["ratio"] < row["ci_high"] and row["gated"]
        assert row["n_baseline_runs"] == 5 and row["baseline_runs"] == "b0,b1,b2,b3,b4"
    assert not (df["decision"] == "regression").any()


def test_a_30_percent_slowdown_is_a_regression_with_its_ratio_and_interval() -> None:
    df = compare_tables(_run(7, scale=1.3, occupancy=60.0), _baseline(n_runs=1))
    for metric in ("serving.ttft_ms.median", "serving.itl_ms.median", "serving.tpot_ms.median",
                   "serving.e2e_latency_ms.median"):
        row = _by_metric(df, metric)
        assert row["decision"] == "regression", row
        assert 1.05 < row["ci_low"] <= row["ratio"] <= row["ci_high"] and 1.15 < row["ratio"] < 1.45
    occ = _by_metric(df, "occupancy.fwd_occupancy.median")
    assert occ["decision"] == "regression" and occ["ci_high"] < 0.95 and occ["direction"] == "higher_is_better"


def test_too_little_history_or_too_few_samples_is_insufficient_data_never_a_pass() -> None:
    df = compare_tables(_run(7), [], baseline_reason="0 passing run(s): too little history")
    gated = df[df["gated"]]
    assert set(gated["decision"]) == {"insufficient_data"}
    assert gated["reason"].str.contains("too little history").all()
    few = {"serving_requests": _serving(3, n=6)}
    row = _by_metric(compare_tables(few, _baseline()), "serving.ttft_ms.median")
    assert row["decision"] == "insufficient_data" and "5 sample(s) on a side, 10 needed" in row["reason"]


def test_one_batch_cases_are_gated_only_when_repeated() -> None:
    once = compare_tables(_run(7), _baseline())
    row = _by_metric(once, "one_batch.output_throughput.median", "bs=8,in=128,out=32")
    assert row["decision"] == "report_only" and not row["gated"] and "repeat each case" in row["reason"]
    first_night = _by_metric(compare_tables(_run(7), []), "one_batch.latency.median", "bs=8,in=128,out=32")
    assert first_night["decision"] == "report_only" and not first_night["gated"]  # same rule without history
    repeated = compare_tables(_run(7, repeats=3, scale=1.3), _baseline(repeats=3))
    row = _by_metric(repeated, "one_batch.latency.median", "bs=8,in=128,out=32")
    assert row["gated"] and row["decision"] == "regression" and row["n_current"] == 3


def test_p99_is_reported_but_gated_only_with_enough_samples() -> None:
    small = compare_tables(_run(7, scale=1.3), _baseline(n_runs=1))
    row = _by_metric(small, "serving.ttft_ms.p99")
    assert row["decision"] == "report_only" and not row["gated"] and "order-statistic" in row["reason"]
    assert row["current_value"] > row["current_median"]
    rng = np.random.default_rng(0)
    base, cur = rng.lognormal(0, 0.3, 3000), rng.lognormal(0, 0.3, 3000) * 1.3
    ratio, low, high = ratio_ci_quantile(cur, base, 0.99)
    assert 1.1 < low < ratio < high and decide_change(low, high, "lower_is_better", 0.10) == "regression"
    ratio, low, high = ratio_ci_quantile(rng.lognormal(0, 0.3, 3000), base, 0.99)
    assert low < 1 < high


def test_baseline_run_to_run_noise_widens_the_interval() -> None:
    rng = np.random.default_rng(0)
    cur = rng.lognormal(0, 0.2, 400)
    steady = [rng.lognormal(0, 0.2, 400) for _ in range(5)]
    shifted = [rng.lognormal(0, 0.2, 400) * s for s in (0.9, 0.95, 1.0, 1.05, 1.1)]
    _, lo1, hi1 = ratio_ci_median(cur, steady, seed=1)
    _, lo2, hi2 = ratio_ci_median(cur, shifted, seed=1)
    assert (hi2 - lo2) > 1.5 * (hi1 - lo1)


def test_deterministic_for_a_seed_and_bounds_are_checked() -> None:
    a = compare_tables(_run(7), _baseline(), seed=3)
    b = compare_tables(_run(7), _baseline(), seed=3)
    pd.testing.assert_frame_equal(a, b)
    with pytest.raises(ConfigError, match="confidence"):
        compare_tables(_run(7), _baseline(), confidence=1.5)
    with pytest.raises(ConfigError, match="bounds"):
        compare_tables(_run(7), _baseline(), bound=-0.1)


def _requests(rng: np.random.Generator, n: int, tokens: int, scale: float = 1.0) -> list[np.ndarray]:
    """Per-request ITLs whose tokens share the request's level (its batch, its neighbours)."""
    levels = rng.lognormal(np.log(40.0), 0.3, n)
    return [lvl * scale * rng.lognormal(0, 0.02, tokens) for lvl in levels]


def test_itl_is_bootstrapped_per_request_not_per_token() -> None:
    rng = np.random.default_rng(5)
    cur, base = _requests(rng, 40, 64), [_requests(rng, 40, 64)]
    _, lo_flat, hi_flat = ratio_ci_median(np.concatenate(cur), [np.concatenate(base[0])], seed=1)
    ratio, lo, hi = ratio_ci_median(cur, base, seed=1)
    # 2560 tokens but 40 independent requests: the honest interval is several times wider.
    assert lo < ratio < hi and (hi - lo) > 3 * (hi_flat - lo_flat)
    # Clustered A/A comparisons: the per-token interval cries wolf, the per-request one does not.
    flat_alarms = cluster_alarms = 0
    for seed in range(20):
        r = np.random.default_rng(100 + seed)
        c, b = _requests(r, 40, 64), _requests(r, 40, 64)
        _, lo_f, hi_f = ratio_ci_median(np.concatenate(c), [np.concatenate(b)], seed=seed, n_boot=500)
        _, lo_c, hi_c = ratio_ci_median(c, [b], seed=seed, n_boot=500)
        flat_alarms += decide_change(lo_f, hi_f, "lower_is_better", 0.05) == "regression"
        cluster_alarms += decide_change(lo_c, hi_c, "lower_is_better", 0.05) == "regression"
    assert cluster_alarms <= 1 < flat_alarms, (flat_alarms, cluster_alarms)
    # A real 40 % slowdown is still found through the wider interval.
    slow = _requests(np.random.default_rng(9), 80, 64, scale=1.4)
    _, lo, _ = ratio_ci_median(slow, base, seed=2)
    assert lo > 1.05


def test_comparison_itl_row_uses_the_request_clusters() -> None:
    df = compare_tables(_run(7), _baseline(n_runs=1))
    row = _by_metric(df, "serving.itl_ms.median")
    assert row["n_current"] == 255 * 16 and row["decision"] == "no_change"
    clusters = extract_requests(next(m for m in GATED_METRICS if m.list_column), _run(7))[""]
    assert len(clusters) == 255 and all(c.size == 16 for c in clusters)


def test_run_to_run_noise_is_estimated_from_baseline_runs_and_floored_by_calibration() -> None:
    # Baseline nights that really differ (about 6 % sd): a 10 % slower current night is not
    # shown to be a >5 % regression, because one night alone can be that far off.
    shifts = (0.92, 0.97, 1.0, 1.04, 1.09, 0.95)
    noisy = [(f"b{i}", _run(100 + i, run_shift=s)) for i, s in enumerate(shifts)]
    row = _by_metric(compare_tables(_run(7, run_shift=1.10), noisy), "serving.tpot_ms.median")
    assert 0.03 < row["run_sd"] < 0.12 and row["decision"] != "regression", row
    steady = _by_metric(compare_tables(_run(7), _baseline()), "serving.tpot_ms.median")
    assert steady["run_sd"] < 0.02
    # One baseline run: nothing to estimate from; a calibrated figure widens the interval.
    plain = _by_metric(compare_tables(_run(7), _baseline(n_runs=1)), "serving.tpot_ms.median")
    floored = _by_metric(compare_tables(_run(7), _baseline(n_runs=1), run_noise={"serving.tpot_ms.median": 0.04}),
                         "serving.tpot_ms.median")
    assert plain["run_sd"] == 0 and floored["run_sd"] == 0.04
    assert (floored["ci_high"] - floored["ci_low"]) > 2 * (plain["ci_high"] - plain["ci_low"])


def test_banded_per_request_bootstrap_equals_the_full_computation() -> None:
    from servegate.bootstrap import _bootstrap_median_clustered

    rng = np.random.default_rng(3)
    runs = [_requests(rng, 300, 48, scale=s) for s in (1.0, 1.05, 0.97)]  # 43 200 values: banded
    banded = _bootstrap_median_clustered(runs, 400, np.random.default_rng(11))
    full = _bootstrap_median_clustered(runs, 400, np.random.default_rng(11), band=False)
    # The same replicates; a CDF summed in another order may cross 0.5 one value earlier or later.
    assert (banded == full).mean() > 0.97
    np.testing.assert_allclose(banded, full, rtol=1e-3)


def test_itl_tail_interval_resamples_requests_once_the_tail_is_gated() -> None:
    from servegate.bootstrap import ratio_ci_quantile_clustered

    rng = np.random.default_rng(8)
    cur, base = _requests(rng, 200, 64), [_requests(rng, 200, 64)]
    flat = ratio_ci_quantile(np.concatenate(cur), np.concatenate(base[0]), 0.99)
    low, high = ratio_ci_quantile_clustered(cur, base, 0.99, n_boot=500)
    assert low < 1 < high and (high - low) > 2 * (flat[2] - flat[1])  # correlated tokens: a wider, honest CI
    df = compare_tables({"serving_requests": pd.DataFrame({"itls_ms": [list(c) for c in cur], "success": True})},
                        [("b", {"serving_requests": pd.DataFrame({"itls_ms": [list(c) for c in base[0]],
                                                                  "success": True})})], n_boot=500)
    row = _by_metric(df, "serving.itl_ms.p99")
    assert row["gated"] and row["ci_low"] < 1 < row["ci_high"] and row["decision"] in ("no_change", "inconclusive")
    assert (row["ci_high"] - row["ci_low"]) > 2 * (flat[2] - flat[1])
