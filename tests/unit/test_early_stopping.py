"""Early-stopping percentiles against MLPerf LoadGen's published values and a distribution whose
quantiles are known (issue 42)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from servegate.early_stopping import early_stopping_percentile, min_passing, min_samples


def test_loadgens_reference_values() -> None:
    # LoadGen's single-stream floors (64 samples for p90, 662 for p99) and h_min(t=0, p99) = 459, the value
    # MLCommons' endpoints port validates against.
    assert min_samples(0.90) == 64 and min_samples(0.99) == 662
    assert min_passing(0, 0.99) == 459 == math.ceil(math.log(0.01) / math.log(0.99))


@pytest.mark.parametrize("p", [0.5, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("t", [0, 1, 5, 40])
def test_min_passing_is_the_first_count_whose_binomial_odds_fall_below_one_minus_c(p: float, t: int) -> None:
    # Checked with the binomial CDF itself, not the incomplete beta the module uses.
    h = min_passing(t, p)
    assert binom.cdf(t, h + t, 1 - p) < 0.01 <= binom.cdf(t, h - 1 + t, 1 - p)


def test_32_requests_cannot_claim_a_p99_and_say_how_many_are_needed() -> None:
    estimate = early_stopping_percentile(np.arange(32.0), 0.99)
    assert not estimate.sufficient and estimate.value is None and estimate.needed == 662
    assert estimate.empirical == pytest.approx(np.quantile(np.arange(32.0), 0.99))
    assert "needs at least 662 samples" in estimate.message("TTFT") and "it has 32" in estimate.message("TTFT")


def test_at_the_floor_the_estimate_is_the_largest_sample() -> None:
    samples = np.random.default_rng(3).permutation(np.arange(662.0))
    estimate = early_stopping_percentile(samples, 0.99)
    assert estimate.value == 661.0 and estimate.rank_from_top == 1
    assert not early_stopping_percentile(samples[:661], 0.99).sufficient


@pytest.mark.parametrize(("p", "n"), [(0.9, 200), (0.99, 2000), (0.99, 700)])
def test_the_estimate_is_above_the_true_quantile_with_the_confidence_it_claims(p: float, n: int) -> None:
    # Exponential latencies: the true p-quantile is -ln(1 - p). The estimate is a 99 % upper bound, so in 2000
    # draws at most as many fall below it as a 1 % rate allows at the 0.1 % level; the empirical quantile
    # falls below it about half the time.
    rng = np.random.default_rng(42)
    true = -math.log(1 - p)
    estimates = [early_stopping_percentile(rng.exponential(size=n), p) for _ in range(2000)]
    below = sum(e.value < true for e in estimates)
    assert below <= binom.ppf(0.999, 2000, 0.01), below
    assert 0.3 < np.mean([e.empirical < true for e in estimates]) < 0.7
    # And it tightens with more samples: the bound's excess over the truth shrinks.
    if n == 2000:
        assert np.median([e.value for e in estimates]) < 1.2 * true


def test_non_finite_samples_are_dropped() -> None:
    samples = np.concatenate([np.arange(100.0), [np.nan, np.inf]])
    estimate = early_stopping_percentile(samples, 0.9)
    assert estimate.samples == 100 and estimate.value is not None and estimate.value <= 99.0


def test_the_serving_summary_gives_each_percentile_its_estimate_beside_the_empirical_one() -> None:
    from servegate.bench.stats import latency_block
    from servegate.tables import SERVING_SUMMARY_COLUMNS

    block = latency_block("ttft", np.arange(100.0))  # 100 requests: enough for p90 (64), not p95 (130) or p99
    assert block["p90_ttft_ms"] == pytest.approx(89.1) and block["es_p90_ttft_ms"] == 97.0
    assert math.isnan(block["es_p95_ttft_ms"]) and math.isnan(block["es_p99_ttft_ms"])
    assert set(block) <= set(SERVING_SUMMARY_COLUMNS)
