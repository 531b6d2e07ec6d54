"""Change points in a gate key's nightly series: where a metric's level or trend changed.

A pure function over one series (one value per run, oldest first): :func:`find_change_points`.
The search is `ruptures <https://centre-borelli.github.io/ruptures-docs/>`_' PELT (exact
minimum of a penalised cost, pruned), with its piecewise *linear* regression cost
(``CostLinear``: every segment its own level and slope) on the log of the values:

- a **step** (a regression that lands in one night) is a jump between two segments: found at
  the run it lands in;
- a **creep** (1-2 % a night, which never trips a "last 5 passing" baseline because the
  baseline creeps with it) is a change of *slope*: a mean-shift cost would cut a creep into a
  staircase somewhere in its middle; a linear cost sees one segment whose slope turned;
- logs, because a nightly change is relative (2 % of 40 ms and 2 % of 900 ms are the same news).

**The penalty scales with the series' noise.** Each extra segment costs
``penalty_factor * 3 * sigma**2 * ln(n)``: three parameters (location, level, slope) at twice the
BIC weight, with ``sigma`` the run-to-run noise estimated robustly from the first differences
(``1.4826 * MAD(diff) / sqrt(2)``): a step or a creep moves a few differences, not their median,
so the noise is not inflated by the change being looked for. A series with more night-to-night
noise needs a larger change to be marked; a quiet one shows a small one.

**Where a creep began.** PELT's cut between two freely fitted lines lands a run or three early
for a creep (the line before tilts to meet it). Each change is therefore refined inside its two
neighbouring segments: a continuous hinge (flat, then sloping; least squares over every kink)
against a jump at PELT's cut; the jump is kept when it explains the data better by more than
``2 * sigma**2 * ln(n)`` (one parameter at BIC weight), else the hinge's kink is where the trend
began.

Measured (``tests/unit/test_changepoints.py``; 30 runs, 2 % noise, factor 2): pure noise marks
nothing in ~97 % of series; a 12 % step is found within one run ~97 %; a creep of 2 %/run from run
20 is found within two runs ~95 % (1.5 %/run ~85 %, 1 %/run ~60 %: at 2 % noise a 1 % creep needs
more nights to stand out). A step of a few per cent is the compare stage's job (it fails that
night); change points are for what it cannot see.

**Each change is tested before it is drawn** (as Apache Otava tests what E-Divisive proposes): Welch's
t-test (scipy's ``ttest_ind``, unequal variances) between the runs of the segment before the change and
those of the segment after it, on the log scale. The change carries its magnitude, the ratio of the two
segments' geometric means with its 95 % interval, and the test's p-value; one whose p-value is not
below ``alpha`` (0.01) is dropped, not drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from servegate.errors import ConfigError

ALPHA = 0.01
"""A proposed change is kept when the Welch test between its two segments gives a p-value below this."""

__all__ = ["ALPHA", "ChangePoint", "find_change_points", "noise_sigma", "DEFAULT_PENALTY_FACTOR", "MIN_SEGMENT",
           "MIN_POINTS"]

DEFAULT_PENALTY_FACTOR = 2.0
"""Twice the BIC penalty per change (see the module docstring for the false-alarm rate it gives)."""
MIN_SEGMENT = 3
"""Runs per segment: a line through two points fits them exactly (zero cost), so fewer would mark noise."""
MIN_POINTS = 10
"""Shorter series are not searched: the noise estimate from under ten differences is too rough."""
NOISE_FLOOR = 0.002
"""The smallest noise assumed (0.2 %, relative): a series of identical values has none, and any
rounding would otherwise be a change."""


@dataclass(frozen=True)
class ChangePoint:
    """A change in a series: from ``index`` on (the first run of the new regime) the level
    jumped (``step``) or a trend began (``trend``)."""

    index: int
    kind: Literal["step", "trend"]
    before: float
    """The fitted level at the run before the change (the series' units)."""
    after: float
    """The fitted level at the end of the new regime (its last run before the next change, or the latest run)."""
    ratio: float = math.nan
    """The segment after over the segment before: the ratio of their geometric means (of their means for a
    series that is not all positive)..."""
    ratio_low: float = math.nan
    ratio_high: float = math.nan
    """...with its 95 % Welch interval."""
    p_value: float = math.nan
    """Welch's t-test between the two segments (two-sided)."""

    @property
    def change(self) -> float:
        """``after / before - 1``: +0.12 is 12 % higher."""
        return self.after / self.before - 1 if self.before else math.nan


def noise_sigma(values: np.ndarray) -> float:
    """Run-to-run noise of a series, robust to steps and trends: 1.4826 x MAD of the first
    differences / sqrt(2). Falls back to their standard deviation when over half the
    differences are equal (a quantised series, e.g. a capacity sweep's rates)."""
    d = np.diff(np.asarray(values, dtype=float))
    if d.size == 0:
        return 0.0
    mad = float(np.median(np.abs(d - np.median(d))))
    if mad > 0:
        return 1.4826 * mad / math.sqrt(2)
    return float(np.std(d)) / math.sqrt(2)


def _sse(x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    return float(residual @ residual), coef


def _segment_test(before: np.ndarray, after: np.ndarray, relative: bool) -> tuple[float, float, float, float]:
    """(ratio, its 95 % low, high, p-value) of the Welch t-test between two segments' (log) values."""
    from scipy import stats

    result = stats.ttest_ind(after, before, equal_var=False)
    low, high = result.confidence_interval(0.95)
    diff = float(np.mean(after) - np.mean(before))
    if relative:
        return math.exp(diff), math.exp(float(low)), math.exp(float(high)), float(result.pvalue)
    base = float(np.mean(before))
    if base == 0:
        return math.nan, math.nan, math.nan, float(result.pvalue)
    return 1 + diff / base, 1 + float(low) / base, 1 + float(high) / base, float(result.pvalue)


def _refine(y: np.ndarray, start: int, cut: int, end: int, unit: float, min_size: int) -> tuple[int, str, np.ndarray]:
    """The change PELT put at ``cut`` (segments ``[start, cut)`` and ``[cut, end)``) as a jump or a
    hinge; returns (first index of the new regime, kind, the fitted log values on [start, end))."""
    t = np.arange(start, end, dtype=float)
    seg = y[start:end]
    ones = np.ones_like(t)
    hinge: tuple[float, int, np.ndarray] | None = None
    for kink in range(start + min_size - 1, end - min_size + 1):
        x = np.column_stack([ones, t, np.maximum(t - kink, 0.0)])
        cost, coef = _sse(x, seg)
        if hinge is None or cost < hinge[0]:
            hinge = (cost, kink, x @ coef)
    after = (t >= cut).astype(float)
    x = np.column_stack([ones, t, after, after * (t - cut)])
    jump_cost, coef = _sse(x, seg)
    if hinge is None or hinge[0] - jump_cost > 2 * unit:
        return cut, "step", x @ coef
    return hinge[1] + 1, "trend", hinge[2]


def find_change_points(values: Sequence[float], *, penalty_factor: float = DEFAULT_PENALTY_FACTOR,
                       min_size: int = MIN_SEGMENT, min_points: int = MIN_POINTS,
                       alpha: float = ALPHA) -> list[ChangePoint]:
    """The change points of ``values`` (one per run, oldest first), oldest first; [] for a series
    shorter than ``min_points``. Values must be finite; positive values are compared on a log
    scale (relative change), a series with a zero or negative value on its own scale. Each carries
    the Welch test between its two segments; those with a p-value not below ``alpha`` are left out."""
    import ruptures
    from ruptures.costs import CostLinear

    y = np.asarray(values, dtype=float)
    if y.ndim != 1:
        raise ConfigError(f"a change-point series is one value per run (1-D), got shape {y.shape}")
    if not np.isfinite(y).all():
        raise ConfigError("a change-point series must hold finite values only; drop the runs without the metric")
    if not (penalty_factor > 0 and math.isfinite(penalty_factor)):
        raise ConfigError(f"penalty_factor must be a finite number > 0, got {penalty_factor!r}")
    if not 0 < alpha < 1:
        raise ConfigError(f"alpha must be in (0, 1), got {alpha!r}")
    if min_size < 3:
        raise ConfigError(f"min_size must be at least 3 runs (a line through 2 points fits exactly), got {min_size}")
    n = y.size
    if n < max(min_points, 2 * min_size):
        return []
    relative = bool((y > 0).all())
    scaled = np.log(y) if relative else y
    floor = NOISE_FLOOR if relative else NOISE_FLOOR * max(float(np.median(np.abs(y))), 1e-12)
    sigma = max(noise_sigma(scaled), floor)
    unit = sigma * sigma * math.log(n)
    t = np.arange(n, dtype=float)
    signal = np.column_stack([scaled, np.ones(n), t])
    algo = ruptures.Pelt(custom_cost=CostLinear(), min_size=min_size, jump=1).fit(signal)
    cuts = [int(c) for c in algo.predict(pen=penalty_factor * 3 * unit)]
    edges = [0, *cuts]
    found = []
    for i, cut in enumerate(cuts[:-1]):
        start, end = edges[i], edges[i + 2]
        index, kind, fitted = _refine(scaled, start, cut, end, unit, min_size)
        # the level just before the change, and where the new regime has got to by its last run
        before, after = fitted[index - 1 - start], fitted[end - 1 - start]
        if relative:
            before, after = math.exp(before), math.exp(after)
        ratio, low, high, p_value = _segment_test(scaled[start:index], scaled[index:end], relative)
        if not p_value < alpha:
            continue
        found.append(ChangePoint(index=index, kind=kind, before=float(before), after=float(after), ratio=ratio,
                                 ratio_low=low, ratio_high=high, p_value=p_value))
    return found
