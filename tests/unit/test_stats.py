"""Summary statistics of the serving benchmark against numpy on known rows."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from servegate.bench.stats import arrival_ks_pvalue, describe, goodput_mask, summarize_serving
from servegate.errors import InsufficientDataError


def _requests() -> pd.DataFrame:
    """Five requests: four succeeded (one with a single output token), one failed."""
    return pd.DataFrame({
        "request_id": [0, 1, 2, 3, 4],
        "input_tokens": pd.array([100, 200, 300, 400, 500], dtype="Int64"),
        "output_tokens": pd.array([10, 20, 1, 5, 0], dtype="Int64"),
        "ttft_ms": [50.0, 80.0, 30.0, 120.0, math.nan],
        "e2e_latency_ms": [140.0, 270.0, 30.0, 200.0, math.nan],
        "tpot_ms": [10.0, 10.0, math.nan, 20.0, math.nan],
        "itls_ms": [[10.0] * 9, [9.0, 11.0] * 9 + [10.0], [], [20.0] * 4, []],
        "dispatch_lag_ms": [0.5, 1.0, 2.0, 0.1, 90.0],
        "success": [True, True, True, True, False],
        "error": [None, None, None, None, "HTTP 500: boom"],
    })


def test_describe_matches_numpy() -> None:
    x = np.array([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0])
    d = describe(x, "x")
    assert d["mean"] == pytest.approx(np.mean(x))
    assert d["median"] == pytest.approx(np.median(x))
    assert d["std"] == pytest.approx(np.std(x))  # population std, as numpy and SGLang
    for q in (90, 95, 99):
        assert d[f"p{q}"] == pytest.approx(np.percentile(x, q))
    assert d["max"] == 9.0


def test_describe_drops_nan_and_refuses_an_empty_sample() -> None:
    assert describe([1.0, math.nan, 3.0], "x")["mean"] == 2.0
    with pytest.raises(InsufficientDataError, match="no samples of ttft"):
        describe([], "ttft")
    with pytest.raises(InsufficientDataError):
        describe([math.nan, math.nan], "tpot")


def test_summary_against_numpy() -> None:
    df = _requests()
    s = summarize_serving(df, duration_s=2.0, max_dispatch_lag_p99_ms=50.0)
    ok = df[df["success"]]
    assert s["completed"] == 4 and s["failed"] == 1
    assert s["total_input_tokens"] == 1000 and s["total_output_tokens"] == 36
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["input_throughput"] == pytest.approx(500.0)
    assert s["output_throughput"] == pytest.approx(18.0)
    assert s["mean_ttft_ms"] == pytest.approx(np.mean(ok["ttft_ms"]))
    assert s["median_ttft_ms"] == pytest.approx(np.median(ok["ttft_ms"]))
    assert s["std_ttft_ms"] == pytest.approx(np.std(ok["ttft_ms"]))
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(ok["ttft_ms"], 99))
    assert s["p90_e2e_latency_ms"] == pytest.approx(np.percentile(ok["e2e_latency_ms"], 90))
    # TPOT leaves out the one-token output (no decode phase), never counts it as 0.
    assert s["mean_tpot_ms"] == pytest.approx(np.mean([10.0, 10.0, 20.0]))
    all_itls = [x for lst in ok["itls_ms"] for x in lst]
    assert s["mean_itl_ms"] == pytest.approx(np.mean(all_itls))
    assert s["p95_itl_ms"] == pytest.approx(np.percentile(all_itls, 95))
    assert s["tpot_itl_applicable"] is True
    # Dispatch lag covers every request, failed ones included (it is the client's health).
    assert s["dispatch_lag_p50_ms"] == pytest.approx(np.median(df["dispatch_lag_ms"]))
    assert s["dispatch_lag_p99_ms"] == pytest.approx(np.percentile(df["dispatch_lag_ms"], 99))
    assert s["client_fell_behind"] is True  # p99 lag ~86 ms > 50 ms
    assert math.isnan(s["goodput"])  # no SLO set: goodput is undefined, not 0


def test_goodput_counts_requests_meeting_every_slo() -> None:
    df = _requests()
    mask = goodput_mask(df, slo_ttft_ms=100.0, slo_tpot_ms=15.0, slo_e2e_ms=None)
    # request 3 breaks the TTFT and TPOT SLOs; request 2 (one token) has no TPOT and passes.
    assert mask.tolist() == [True, True, True, False, False]
    s = summarize_serving(df, 2.0, slo_ttft_ms=100.0, slo_tpot_ms=15.0)
    assert s["goodput"] == pytest.approx(1.5) and s["good_completed"] == 3
    s = summarize_serving(df, 2.0, slo_e2e_ms=1.0)
    assert s["goodput"] == 0.0  # a real count of zero good requests


def test_all_failed_is_insufficient_data_not_zero() -> None:
    df = _requests()
    df["success"] = False
    with pytest.raises(InsufficientDataError, match="all 5 requests failed"):
        summarize_serving(df, 2.0)


def test_single_token_outputs_make_tpot_and_itl_not_applicable() -> None:
    df = _requests().iloc[[2]].copy()
    s = summarize_serving(df, 1.0)
    assert s["tpot_itl_applicable"] is False
    assert math.isnan(s["mean_tpot_ms"]) and math.isnan(s["p99_itl_ms"])
    assert s["mean_ttft_ms"] == 30.0


def test_zero_duration_is_refused() -> None:
    with pytest.raises(InsufficientDataError):
        summarize_serving(_requests(), 0.0)


def test_ks_accepts_exponential_gaps_and_rejects_the_wrong_rate() -> None:
    rng = np.random.default_rng(7)
    times = np.cumsum(rng.exponential(1 / 20.0, size=500))
    assert arrival_ks_pvalue(times, 20.0) > 0.05
    assert arrival_ks_pvalue(times, 5.0) < 1e-6
    # Evenly spaced sends are not Poisson at any rate.
    assert arrival_ks_pvalue(np.arange(500) / 20.0, 20.0) < 1e-6
    with pytest.raises(InsufficientDataError):
        arrival_ks_pvalue([0.0, 0.1], 10.0)


def test_ks_against_the_gamma_law_of_bursty_arrivals() -> None:
    rate, shape = 10.0, 0.25  # bursty: most gaps tiny, a few long ones, mean still 1/rate
    times = np.cumsum(np.random.default_rng(3).gamma(shape, 1 / (rate * shape), size=300))
    assert arrival_ks_pvalue(times, rate, burstiness=shape) > 0.05
    # The same sends are far from Poisson at that rate, and from a gamma law of another shape.
    assert arrival_ks_pvalue(times, rate) < 1e-6
    assert arrival_ks_pvalue(times, rate, burstiness=4.0) < 1e-6
    # Regular (shape 4) arrivals are not Poisson either, and fit their own law.
    regular = np.cumsum(np.random.default_rng(4).gamma(4.0, 1 / (rate * 4.0), size=300))
    assert arrival_ks_pvalue(regular, rate, burstiness=4.0) > 0.05
    assert arrival_ks_pvalue(regular, rate) < 1e-6
    # Shape 1 is the exponential: the same p-value as the Poisson test.
    expo = np.cumsum(np.random.default_rng(5).exponential(1 / rate, size=200))
    assert arrival_ks_pvalue(expo, rate, burstiness=1.0) == arrival_ks_pvalue(expo, rate)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_ks_pvalue(times, rate, burstiness=0.0)
