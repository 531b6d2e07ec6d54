"""Confidence intervals for the ratio of two runs' statistics: pure numpy/scipy maths, no I/O.

- **medians** (:func:`ratio_ci_median`): the ratio ``current median / baseline median`` with a
  percentile bootstrap confidence interval (numpy, seeded, vectorised; each replicate's median
  is drawn exactly from its Beta order-statistic law, so no resample is materialised: ~20 ms per
  metric for 20 000 samples). The baseline side is resampled in two stages — runs with
  replacement, then samples from the chosen runs — so that run-to-run noise between baseline
  nights widens the interval instead of being averaged away. Sides larger than
  :data:`MAX_SAMPLES_PER_SIDE` are subsampled (seeded) first to bound memory; that only widens
  the interval (conservative). Inter-token latencies are not independent samples: the tokens
  of one request share its batch and its neighbours, so ITL is bootstrapped **per request** (a
  cluster bootstrap: requests are resampled with all their tokens), which is what keeps its
  interval honest.
- **run-to-run noise** (:func:`between_run_sd`): a gate run's median carries its own "night"
  effect (machine state, the worker's start) that no amount of samples inside the run averages
  away. Its size ``run_sd`` (the standard deviation of log medians between runs) is estimated
  from the baseline runs when there are at least two (floored by the caller with the figure
  ``servegate calibrate`` measured), and every bootstrap replicate of the current median is
  multiplied by ``exp(N(0, run_sd))``. With one baseline run and no calibration the interval
  holds within-run noise only, and the minimum effect is the only guard against a noisy night.
- **tails** (:func:`ratio_ci_quantile`): exact distribution-free order-statistic intervals for
  the quantile on each side (``scipy.stats.quantile_test``, each at confidence ``sqrt(c)`` so
  the two together hold at ``c``): ``[low_cur / high_base, high_cur / low_base]``. With few
  samples the upper order statistic does not exist (about 440 samples are needed for a p99 at
  95 %) and an end is NaN: the interval is unbounded. Those intervals assume independent
  samples; for clustered samples (ITL) :func:`ratio_ci_quantile_clustered` bootstraps requests
  at the quantile instead.

What the intervals mean for a gate (the decision rule, the comparison table) is
:mod:`servegate.compare`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "DEFAULT_CONFIDENCE",
    "DEFAULT_N_BOOT",
    "MAX_SAMPLES_PER_SIDE",
    "MAX_CLUSTERED_VALUES",
    "Samples",
    "between_run_sd",
    "ratio_ci_median",
    "ratio_ci_quantile",
    "ratio_ci_quantile_clustered",
]

DEFAULT_CONFIDENCE = 0.95
DEFAULT_N_BOOT = 2000
MAX_SAMPLES_PER_SIDE = 1_000_000

Samples = np.ndarray | Sequence[np.ndarray]
"""A side's samples: a flat array of independent samples, or a list of clusters (one array
per request) whose samples are resampled together."""

MAX_CLUSTERED_VALUES = 200_000
"""Clustered sides are thinned (whole requests, seeded) beyond this many values: the
per-request bootstrap costs O(n_boot * n)."""


def _flat(samples: Samples) -> np.ndarray:
    return samples if isinstance(samples, np.ndarray) else np.concatenate(list(samples))


def _thin_clusters(clusters: Sequence[np.ndarray], rng: np.random.Generator, cap: int) -> list[np.ndarray]:
    total = sum(c.size for c in clusters)
    if total <= cap:
        return list(clusters)
    keep = max(1, int(len(clusters) * cap / total))
    return [clusters[i] for i in sorted(rng.choice(len(clusters), size=keep, replace=False))]


def _cluster_weights(b: int, rng: np.random.Generator, sizes: Sequence[np.ndarray], run_of_cluster: np.ndarray,
                     lengths: np.ndarray) -> np.ndarray:
    """(b, clusters) weight of one value of each cluster in ``b`` two-stage bootstrap replicates
    (runs drawn with replacement at equal mass, then each run's clusters); each row's values sum to 1."""
    r = len(sizes)
    run_mass = (rng.multinomial(r, np.full(r, 1 / r), size=b) / r) if r > 1 else np.ones((b, 1))
    mult = np.concatenate([rng.multinomial(s.size, np.full(s.size, 1 / s.size), size=b) for s in sizes], axis=1)
    resampled = np.stack([(mult[:, run_of_cluster == j] * lengths[run_of_cluster == j]).sum(axis=1)
                          for j in range(r)], axis=1)  # (b, r) values per resampled run
    return run_mass[:, run_of_cluster] * mult / resampled[:, run_of_cluster]


def _thin_clustered_sides(current: Sequence[np.ndarray], baseline_groups: Sequence[Sequence[np.ndarray]],
                          rng: np.random.Generator) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Each side cut to :data:`MAX_CLUSTERED_VALUES` values by dropping whole requests (seeded);
    the baseline runs keep their proportions."""
    pooled = sum(_flat(g).size for g in baseline_groups)
    cap = max(1, MAX_CLUSTERED_VALUES * max(_flat(g).size for g in baseline_groups) // max(pooled, 1))
    return (_thin_clusters(current, rng, MAX_CLUSTERED_VALUES),
            [_thin_clusters(g, rng, cap) for g in baseline_groups])


def _bootstrap_median_clustered(runs: Sequence[Sequence[np.ndarray]], n_boot: int,
                                rng: np.random.Generator, *, band: bool = True, q: float = 0.5) -> np.ndarray:
    """``n_boot`` bootstrap replicates of the median (the ``q``-quantile) over runs made of
    clusters (requests).

    Each replicate draws the runs with replacement (each drawn run has equal mass, as in
    :func:`_bootstrap_median`), then each run's clusters with replacement; a value's weight is
    its run's mass times its cluster's multiplicity over the run's resampled size, and the
    replicate's median is the weighted median over the pooled sorted values.

    The weighted CDF is only accumulated over a band of the sorted values around the pooled
    median (its width from 64 pilot replicates, with a wide margin); the mass below the band
    comes from per-cluster counts. A replicate whose median falls outside the band is computed
    over all values, so the result is that of the full computation (``band=False``) up to
    floating-point rounding where a CDF crosses 0.5 (a neighbouring value), and faster on
    large runs (``benchmarks/compare_cost.py``). Chunked so that memory stays ~32 MB whatever the sample size.
    """
    sizes = [np.array([c.size for c in run]) for run in runs]
    values = np.concatenate([np.concatenate(list(run)) for run in runs])
    n = values.size
    cluster_of = np.repeat(np.arange(sum(s.size for s in sizes)), np.concatenate(sizes))
    run_of_cluster = np.repeat(np.arange(len(runs)), [s.size for s in sizes])
    order = np.argsort(values, kind="stable")
    v, cluster_sorted = values[order], cluster_of[order]
    lengths = np.concatenate(sizes).astype(float)

    def full_index(w: np.ndarray) -> np.ndarray:
        cdf = np.cumsum(w[:, cluster_sorted], axis=1)
        return np.minimum((cdf < q * cdf[:, -1:]).sum(axis=1), n - 1)

    pilot_rng = np.random.default_rng(rng.integers(2**63))  # drawn either way: band on/off agree
    lo_i, hi_i = 0, n
    if band and n > 20_000:
        pos = full_index(_cluster_weights(64, pilot_rng, sizes, run_of_cluster, lengths)) / n
        delta = min(0.5, max(0.02, 8 * float(pos.std()) + 0.01))
        lo_i, hi_i = max(0, int((q - delta) * n)), min(n, int(math.ceil((q + delta) * n)))
    below = np.bincount(cluster_sorted[:lo_i], minlength=lengths.size).astype(float)
    band_clusters = cluster_sorted[lo_i:hi_i]
    out = np.empty(n_boot)
    chunk = max(1, int(4_000_000 // n))  # as without the band: the same random stream either way
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        w = _cluster_weights(b, rng, sizes, run_of_cluster, lengths)
        base = w @ below
        half = q * (w @ lengths)
        k = (base[:, None] + np.cumsum(w[:, band_clusters], axis=1) < half[:, None]).sum(axis=1)
        idx = np.minimum(lo_i + k, n - 1)
        outside = ((lo_i > 0) & (base >= half)) | ((hi_i < n) & (k == hi_i - lo_i))
        if outside.any():
            idx[outside] = full_index(w[outside])
        out[start:start + b] = v[idx]
    return out


def between_run_sd(groups: Sequence[Samples], rng: np.random.Generator, n_boot: int = 200) -> float:
    """Between-run standard deviation of log medians (0 with fewer than two runs).

    A random-effects moment estimate: the spread of the runs' log medians minus the part their
    own sampling noise explains (each run's bootstrap variance of its log median), floored at 0.
    """
    logs, within = [], []
    for g in groups:
        boot = (_bootstrap_median_clustered([g], n_boot, rng) if not isinstance(g, np.ndarray)
                else _bootstrap_median([g], n_boot, rng))
        median = float(np.median(_flat(g)))
        if median <= 0 or np.any(boot <= 0):
            return 0.0
        logs.append(math.log(median))
        within.append(float(np.var(np.log(boot), ddof=1)))
    if len(logs) < 2:
        return 0.0
    return math.sqrt(max(0.0, float(np.var(logs, ddof=1)) - float(np.mean(within))))


def _thin(values: np.ndarray, rng: np.random.Generator, cap: int) -> np.ndarray:
    return values if values.size <= cap else rng.choice(values, size=cap, replace=False)


def _bootstrap_median(groups: Sequence[np.ndarray], n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` bootstrap replicates of the median of the pooled groups, drawn exactly without
    materialising resamples.

    The k-th smallest of n iid draws from a distribution F is ``F^-1(U)`` with
    ``U ~ Beta(k, n + 1 - k)``, so a bootstrap median (k = (n + 1) // 2) is the empirical
    quantile at a Beta draw: O(n log n) for one group instead of O(n_boot * n).
    Several groups (one per baseline run): a two-stage bootstrap — draw as many runs as there
    are, with replacement, then n samples from the drawn runs' mixture — so between-run
    variation is in the interval; each replicate's mixture quantile is found by a vectorised
    binary search over the pooled sorted samples (O(n_boot * runs * log n)).
    """
    values = np.concatenate(groups)
    n, r = values.size, len(groups)
    k = (n + 1) // 2
    u = rng.beta(k, n + 1 - k, size=n_boot)
    order = np.argsort(values, kind="stable")
    v = values[order]
    if r == 1:
        return v[np.clip(np.ceil(u * n).astype(np.int64) - 1, 0, n - 1)]
    sizes = np.array([g.size for g in groups])
    run_of = np.repeat(np.arange(r), sizes)[order]
    drawn = rng.multinomial(r, np.full(r, 1 / r), size=n_boot)
    weight = drawn / (r * sizes)  # (n_boot, r): mass of one sample of run j in replicate b
    # counts[j, i]: samples of run j among the i+1 smallest; the mixture CDF at i is weight @ counts[:, i].
    counts = np.cumsum(run_of[None, :] == np.arange(r)[:, None], axis=1)
    lo, hi = np.zeros(n_boot, dtype=np.int64), np.full(n_boot, n - 1, dtype=np.int64)
    while np.any(lo < hi):  # vectorised binary search for the first i with CDF(i) >= u
        mid = (lo + hi) // 2
        ge = np.einsum("br,rb->b", weight, counts[:, mid]) >= u
        hi = np.where(ge, mid, hi)
        lo = np.where(ge, lo, mid + 1)
    return v[lo]


def ratio_ci_median(current: Samples, baseline_groups: Sequence[Samples], *,
                    confidence: float = DEFAULT_CONFIDENCE, n_boot: int = DEFAULT_N_BOOT,
                    seed: int = 0, run_sd: float = 0.0) -> tuple[float, float, float]:
    """``(ratio, ci_low, ci_high)`` of current median / baseline median (percentile bootstrap).

    Each side is a flat array (independent samples) or a list of clusters (per-request
    bootstrap); ``baseline_groups`` has one entry per baseline run. ``run_sd`` is the
    between-run noise (sd of log medians) added to the current run's replicates.
    """
    rng = np.random.default_rng(seed)
    clustered = not isinstance(current, np.ndarray)
    if clustered:
        current, baseline_groups = _thin_clustered_sides(current, baseline_groups, rng)
    else:
        current = _thin(current, rng, MAX_SAMPLES_PER_SIDE)
        pooled = sum(g.size for g in baseline_groups)
        if pooled > MAX_SAMPLES_PER_SIDE:
            keep = MAX_SAMPLES_PER_SIDE / pooled
            baseline_groups = [_thin(g, rng, max(1, int(g.size * keep))) for g in baseline_groups]
    base_point = float(np.median(np.concatenate([_flat(g) for g in baseline_groups])))
    ratio = float(np.median(_flat(current))) / base_point if base_point != 0 else math.nan
    if clustered:
        cur_boot = _bootstrap_median_clustered([current], n_boot, rng)
        base_boot = _bootstrap_median_clustered(baseline_groups, n_boot, rng)
    else:
        cur_boot = _bootstrap_median([current], n_boot, rng)
        base_boot = _bootstrap_median(baseline_groups, n_boot, rng)
    if run_sd > 0:
        cur_boot = cur_boot * np.exp(rng.normal(0.0, run_sd, n_boot))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = cur_boot / base_boot
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size < n_boot // 2:
        return ratio, math.nan, math.nan
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha])
    return ratio, float(low), float(high)


def _quantile_interval(values: np.ndarray, p: float, confidence: float) -> tuple[float, float]:
    point = float(np.quantile(values, p))
    from scipy import stats  # here, not at the top: scipy costs ~1.3 s of every gate's start-up

    ci = stats.quantile_test(values, q=point, p=p).confidence_interval(confidence_level=confidence)
    return float(ci.low), float(ci.high)


def ratio_ci_quantile(current: np.ndarray, baseline: np.ndarray, p: float = 0.99, *,
                      confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float, float]:
    """``(ratio, ci_low, ci_high)`` of the p-quantiles from exact order-statistic intervals; an
    end is NaN when the sample is too small to bound the quantile on that side."""
    per_side = math.sqrt(confidence)
    c_low, c_high = _quantile_interval(current, p, per_side)
    b_low, b_high = _quantile_interval(baseline, p, per_side)
    base_point = float(np.quantile(baseline, p))
    ratio = float(np.quantile(current, p)) / base_point if base_point != 0 else math.nan
    low = c_low / b_high if b_high and math.isfinite(b_high) and math.isfinite(c_low) else math.nan
    high = c_high / b_low if b_low and math.isfinite(b_low) and math.isfinite(c_high) else math.nan
    return ratio, low, high


def ratio_ci_quantile_clustered(current: Sequence[np.ndarray], baseline_groups: Sequence[Sequence[np.ndarray]],
                                p: float, *, confidence: float = DEFAULT_CONFIDENCE, n_boot: int = DEFAULT_N_BOOT,
                                seed: int = 0) -> tuple[float, float]:
    """``(ci_low, ci_high)`` of the ratio of p-quantiles when samples come in clusters (per-request
    percentile bootstrap, baseline runs resampled first)."""
    rng = np.random.default_rng(seed)
    current, baseline_groups = _thin_clustered_sides(current, baseline_groups, rng)
    cur = _bootstrap_median_clustered([current], n_boot, rng, q=p)
    base = _bootstrap_median_clustered(baseline_groups, n_boot, rng, q=p)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = cur / base
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size < n_boot // 2:
        return math.nan, math.nan
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha])
    return float(low), float(high)
