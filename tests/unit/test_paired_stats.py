"""The paired interval (servegate.paired.stats) on known data: its estimate, its width, its coverage
when it is looked at after every round, and the decisions the paired stage takes from it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servegate.compare import decide_change
from servegate.paired.stats import asymptotic_cs_halfwidth, ratio_interval

ROUND_SD = 0.026
"""Per-round sd of the ITL log ratio the smoke-ab gate measured on the 2-core machine."""


def test_the_estimate_is_the_geometric_mean_ratio_and_its_sd() -> None:
    logs = [0.01, 0.03, -0.01, 0.05, math.nan, 0.02]  # a NaN round (a side without samples) is left out
    iv = ratio_interval(logs)
    finite = np.array([v for v in logs if math.isfinite(v)])
    assert iv.rounds == 5
    assert iv.ratio == pytest.approx(math.exp(finite.mean()))
    assert iv.sd_log == pytest.approx(finite.std(ddof=1))
    assert iv.ci_low < iv.ratio < iv.ci_high
    half = asymptotic_cs_halfwidth(5, finite.std(ddof=1), 0.05, 30)
    assert math.log(iv.ci_high) - math.log(iv.ratio) == pytest.approx(half)


def test_no_rounds_or_one_round_decide_nothing() -> None:
    empty = ratio_interval([])
    assert empty.rounds == 0 and math.isnan(empty.ratio) and math.isnan(empty.ci_low)
    one = ratio_interval([0.02])
    assert one.rounds == 1 and one.ratio == pytest.approx(math.exp(0.02))
    assert one.ci_low == 0.0 and one.ci_high == math.inf
    assert decide_change(one.ci_low, one.ci_high, "lower_is_better", 0.015) == "inconclusive"


def test_the_sd_floor_guards_a_lucky_small_spread() -> None:
    identical = [0.01] * 8  # sd 0: without the floor the interval would be a point
    assert ratio_interval(identical).ci_low == pytest.approx(ratio_interval(identical).ci_high)
    floored = ratio_interval(identical, sd_floor=0.005)
    assert floored.ci_high / floored.ci_low > 1.005
    assert floored.sd_log == pytest.approx(0.0)  # reported before the floor


def test_the_interval_narrows_as_rounds_accumulate() -> None:
    widths = [2 * asymptotic_cs_halfwidth(t, ROUND_SD, 0.05, 30) for t in range(2, 400)]
    assert all(b < a for a, b in zip(widths, widths[1:]))
    # On data: the same draws, more of them.
    x = np.random.default_rng(3).normal(math.log(1.02), ROUND_SD, 200)
    width = {t: math.log(ratio_interval(x[:t]).ci_high / ratio_interval(x[:t]).ci_low) for t in (6, 12, 50, 200)}
    assert width[6] > width[12] > width[50] > width[200]
    # Anytime validity costs width: wider than the fixed-t 95 % interval, by less than 2x at 30 rounds.
    fixed = 2 * 1.96 * ROUND_SD / math.sqrt(30)
    assert fixed < 2 * asymptotic_cs_halfwidth(30, ROUND_SD, 0.05, 30) < 2 * fixed


@pytest.mark.parametrize(("ratio", "sd", "direction", "expected"), [
    (1.10, 0.01, "lower_is_better", "regression"),      # ITL 10 % up
    (0.90, 0.01, "lower_is_better", "improvement"),
    (1.00, 0.005, "lower_is_better", "no_change"),      # a regression of 1.5 % excluded
    (1.00, 0.20, "lower_is_better", "inconclusive"),    # too noisy for 20 rounds
    (0.90, 0.01, "higher_is_better", "regression"),     # throughput 10 % down
    (1.10, 0.01, "higher_is_better", "improvement"),
])
def test_clear_cases_are_decided(ratio: float, sd: float, direction: str, expected: str) -> None:
    x = np.random.default_rng(5).normal(math.log(ratio), sd, 20)
    iv = ratio_interval(x, sd_floor=0.005)
    assert decide_change(iv.ci_low, iv.ci_high, direction, 0.015) == expected  # type: ignore[arg-type]


# ---- coverage under optional stopping ------------------------------------------------------------
SIMS, HORIZON, TRUE_RATIO = 1200, 40, 1.02
"""A measurement of up to 40 rounds (about what smoke-ab's 600 s budget allows), looked at after
every round; 1200 seeded simulations (sd of a miss rate near 5 %: 0.6 points)."""


@pytest.fixture(scope="module")
def missed() -> np.ndarray:
    """``missed[i, t]``: simulation i's interval after round t did not cover the true ratio (per-round
    log ratios iid normal; rounds before 6 are never looked at and left False)."""
    rng = np.random.default_rng(0)
    out = np.zeros((SIMS, HORIZON + 1), dtype=bool)
    for i in range(SIMS):
        x = rng.normal(math.log(TRUE_RATIO), ROUND_SD, HORIZON)
        for t in range(6, HORIZON + 1):
            iv = ratio_interval(x[:t], sd_floor=0.005)
            out[i, t] = not iv.ci_low <= TRUE_RATIO <= iv.ci_high
    return out


def test_from_10_rounds_the_interval_covers_at_every_round_at_the_nominal_rate(missed: np.ndarray) -> None:
    # Time-uniform coverage: whatever round from the 10th the gate stops at (it stops when it likes
    # what it sees), its interval covered the true ratio. Seed 0: 4.3 % missed; seeds 1-4: 3.4-3.6 %.
    assert missed[:, 10:].any(axis=1).mean() <= 0.05


@pytest.mark.xfail(strict=True, reason=(
    "the asymptotic sequence is anti-conservative in its first rounds (the sample sd of 6 rounds is "
    "unreliable): looked at from 6 rounds (smoke-ab's paired.min_rounds) it misses the true ratio at some "
    "round in ~6-7 % of measurements (here 6.25 %; 7.2 % of 3000 over 44 rounds), over the nominal 5 %; "
    "benchmarks/paired_sequential.py shows the effect on decisions at the bound"))
def test_from_6_rounds_the_interval_covers_at_every_round_at_the_nominal_rate(missed: np.ndarray) -> None:
    assert missed[:, 6:].any(axis=1).mean() <= 0.05
