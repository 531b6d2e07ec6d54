"""Early-stopping percentiles: the tail latency a sample of a given size can support, MLPerf LoadGen's way.

A p99 of 32 requests is, in effect, their largest value: nothing in 32 samples says where the 99th
percentile lies. MLPerf's LoadGen (``loadgen/early_stopping.cc`` and ``PerformanceSummary::EarlyStopping``
in ``loadgen/results.cc``, mlcommons/inference; ported to MLCommons' endpoints project, mlcommons/endpoints
#417) reports instead the conservative order statistic the sample supports, and below a floor none:

- ``min_passing(t, p, d, c)``: the fewest queries ``h`` under a latency such that, with ``t`` more over it,
  "the p-quantile is at or below that latency" holds at confidence ``c`` -- the smallest ``h`` with
  ``P[Binomial(h + t, 1 - (p - d)) <= t] < 1 - c``, which is the regularized incomplete beta
  ``I_{p-d}(h, t + 1)`` (LoadGen's ``odds``; here scipy's ``betainc``, not LoadGen's hand-written series).
- The estimate from ``n`` samples: the largest ``t >= 1`` with ``min_passing(t) + t <= n``; the
  ``t``-th largest sample (LoadGen "would discard t - 1 highest latency queries"). Fewer than
  ``min_passing(1) + 1`` samples support no estimate: LoadGen's single-stream floor, 64 samples for p90 and
  662 for p99 at its defaults (``c = 0.99``, ``d = 0``).

The estimate is an upper confidence bound on the true quantile: it lies above it with probability at least
``c`` (``tests/unit/test_early_stopping.py`` checks that on a distribution whose quantile is known).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.special import betainc

__all__ = ["CONFIDENCE", "TOLERANCE", "EarlyStoppingEstimate", "early_stopping_percentile", "min_passing",
           "min_samples"]

CONFIDENCE = 0.99
"""LoadGen's confidence for every early-stopping decision."""
TOLERANCE = 0.0
"""LoadGen's tolerance ``d``: the quantile is held to ``p - d``."""


def _odds(h: int, t: int, p: float, d: float) -> float:
    """P[at most ``t`` of ``h + t`` queries are over] when each is over with probability ``1 - (p - d)``."""
    return float(betainc(h, t + 1, p - d)) if h > 0 else 1.0


@lru_cache(maxsize=4096)
def min_passing(t: int, p: float, d: float = TOLERANCE, c: float = CONFIDENCE) -> int:
    """The fewest queries under the latency that, beside ``t`` over it, show the ``p``-quantile at or below it
    at confidence ``c``: the smallest ``h`` with ``I_{p-d}(h, t + 1) < 1 - c`` (LoadGen's
    ``MinPassingQueriesFinder``; ``min_passing(0, 0.99) == 459``)."""
    if t < 0:
        raise ValueError(f"t must be >= 0, got {t}")
    if not 0.0 < p - d < 1.0 or not 0.0 < c < 1.0:
        raise ValueError(f"need 0 < p - d < 1 and 0 < c < 1, got p={p}, d={d}, c={c}")
    # The odds fall as h grows; bracket, then bisect for the first h below 1 - c.
    low, high = 1, max(1, math.ceil(math.log(1 - c) / math.log(p - d)))
    while _odds(high, t, p, d) >= 1 - c:
        low, high = high + 1, 2 * high
    while low < high:
        mid = (low + high) // 2
        if _odds(mid, t, p, d) < 1 - c:
            high = mid
        else:
            low = mid + 1
    return low


def min_samples(p: float, d: float = TOLERANCE, c: float = CONFIDENCE) -> int:
    """The fewest samples that support any early-stopping estimate of the ``p``-quantile: ``min_passing(1) +
    1`` (64 for p90, 662 for p99 at LoadGen's defaults)."""
    return min_passing(1, p, d, c) + 1


@dataclass(frozen=True)
class EarlyStoppingEstimate:
    """The early-stopping estimate of one quantile of one sample."""

    quantile: float
    samples: int
    needed: int
    """The fewest samples any estimate needs (:func:`min_samples`)."""
    value: float | None
    """The estimate; None when ``samples < needed`` (insufficient samples)."""
    rank_from_top: int | None
    """Which largest sample it is (1: the maximum); LoadGen discards ``rank_from_top - 1`` above it."""
    empirical: float | None
    """The plain empirical quantile of the same sample, for the report (numpy's default interpolation)."""

    @property
    def sufficient(self) -> bool:
        return self.value is not None

    def message(self, what: str = "the metric") -> str:
        """What a person reads: the estimate, or how many samples it needs."""
        pct = f"p{self.quantile * 100:g}"
        if self.value is None:
            return (f"insufficient samples: {what}'s {pct} needs at least {self.needed} samples for an "
                    f"early-stopping estimate at {CONFIDENCE:.0%} confidence (MLPerf LoadGen's rule), it has "
                    f"{self.samples}; run more requests")
        return (f"{what}'s {pct}: early-stopping estimate {self.value:g} (the {self.rank_from_top}. largest of "
                f"{self.samples}), empirical {self.empirical:g}")


def early_stopping_percentile(samples: Sequence[float] | np.ndarray, p: float, *, d: float = TOLERANCE,
                              c: float = CONFIDENCE) -> EarlyStoppingEstimate:
    """The early-stopping estimate of the ``p``-quantile of ``samples`` (non-finite values dropped): the
    ``t``-th largest, ``t`` the most over-quantile samples the count can afford (LoadGen's single-stream
    rule); no value below :func:`min_samples`."""
    values = np.sort(np.asarray(samples, dtype=float))
    values = values[np.isfinite(values)]
    n, needed = int(values.size), min_samples(p, d, c)
    empirical = float(np.quantile(values, p)) if n else None
    if n < needed:
        return EarlyStoppingEstimate(p, n, needed, None, None, empirical)
    t = 1
    while min_passing(t + 1, p, d, c) + t + 1 <= n:
        t += 1
    return EarlyStoppingEstimate(p, n, needed, float(values[n - t]), t, empirical)
