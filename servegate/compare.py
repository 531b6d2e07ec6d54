"""Compare a gate run with its baseline, metric by metric, from the raw samples.

For each gated metric (:data:`GATED_METRICS`) the current run's raw samples (per request,
per token, per scrape) are compared with the baseline runs' pooled raw samples:

- **median metrics**: the ratio ``current median / baseline median`` with a percentile bootstrap
  confidence interval (numpy, seeded, vectorised; each replicate's median is drawn exactly
  from its Beta order-statistic law, so no resample is materialised: ~20 ms per metric for
  20 000 samples). The baseline side is resampled in two stages — runs with replacement, then
  samples from the chosen runs — so that run-to-run noise between baseline nights widens the
  interval instead of being averaged away. Sides larger than :data:`MAX_SAMPLES_PER_SIDE` are
  subsampled (seeded) first to bound memory; that only widens the interval (conservative).
  Inter-token latencies are not independent samples: the tokens of one request share its
  batch and its neighbours, so ITL is bootstrapped **per request** (a cluster bootstrap:
  requests are resampled with all their tokens), which is what keeps its interval honest.
- **run-to-run noise**: a gate run's median carries its own "night" effect (machine state,
  the worker's start) that no amount of samples inside the run averages away. Its size
  ``run_sd`` (the standard deviation of log medians between runs) is estimated from the
  baseline runs when there are at least two, floored by the figure ``servegate calibrate``
  measured for the metric (``run_noise``), and every bootstrap replicate of the current median
  is multiplied by ``exp(N(0, run_sd))``. With one baseline run and no calibration the interval
  holds within-run noise only, and the minimum effect is the only guard against a noisy night.
- **tail metrics (p99)**: reported always, gated only when the sample size supports a bound.
  The interval comes from exact distribution-free order-statistic intervals for the quantile
  on each side (``scipy.stats.quantile_test``, each at confidence ``sqrt(c)`` so the two together
  hold at ``c``): ``[low_cur / high_base, high_cur / low_base]``. With few samples the upper
  order statistic does not exist (about 440 samples are needed for a p99 at 95 %), the
  interval is unbounded and the row is ``report_only`` — a p99 from 16 requests is its
  maximum and gating on it only produces false alarms. Tails also get a wider minimum effect
  (:data:`DEFAULT_TAIL_BOUND`). Those intervals assume independent samples, so for ITL they
  only decide *whether* the tail is gated; its interval then comes from the per-request
  bootstrap at the 0.99 quantile (:func:`ratio_ci_quantile_clustered`).

Decisions, with ``bound`` the minimum effect that matters (``DEFAULT_BOUND`` = 5 %) — a
non-inferiority test, so that "no regression" is shown, not assumed:

================== ====================================================================
regression         the whole interval is beyond the bound in the bad direction
improvement        the whole interval is beyond the bound in the good direction
no_change          the bad end of the interval is inside the bound (a regression of at
                   least ``bound`` is excluded)
inconclusive       the interval straddles the bound on the bad side (more samples needed)
insufficient_data  no baseline runs (too little history) or too few samples on a side
report_only        shown, not gated: a tail whose interval is unbounded at this sample
                   size, or a one-batch case measured fewer than ``min_samples`` times
================== ====================================================================

The result is a DataFrame (the ``comparison`` table) that Great Expectations validates like
every other table, e.g. ``decision`` not in ``["regression"]`` and, on rows where ``gated``,
not in ``["insufficient_data"]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
from scipy import stats

from servegate.baseline import Baseline, BaselinePolicy, resolve_baseline
from servegate.errors import ConfigError
from servegate.store import GateKey, Store
from servegate.tables import COMPARISON_COLUMNS

__all__ = [
    "GatedMetric",
    "GATED_METRICS",
    "DECISIONS",
    "DEFAULT_BOUND",
    "DEFAULT_TAIL_BOUND",
    "MAX_SAMPLES_PER_SIDE",
    "extract_samples",
    "extract_requests",
    "estimate_run_noise",
    "calibration_figures",
    "calibration_summary",
    "ratio_ci_median",
    "ratio_ci_quantile",
    "ratio_ci_quantile_clustered",
    "decide",
    "compare_tables",
    "compare_run",
]

DEFAULT_BOUND = 0.05
"""Minimum effect that counts as a change (5 %): run-to-run shifts smaller than this are
within the noise PyTorch's and vLLM's dashboards tolerate, and below what a nightly can act on."""
DEFAULT_TAIL_BOUND = 0.10
"""Tails move more between runs than medians; vLLM reviewers dropped p99 gating for this."""
DEFAULT_CONFIDENCE = 0.95
DEFAULT_N_BOOT = 2000
MAX_SAMPLES_PER_SIDE = 1_000_000

Direction = Literal["lower_is_better", "higher_is_better"]
DECISIONS = ("regression", "improvement", "no_change", "inconclusive", "insufficient_data", "report_only")

@dataclass(frozen=True)
class GatedMetric:
    """One metric the gate compares with its baseline."""

    name: str  # "serving.ttft_ms"; the row's metric is "<name>.<statistic>"
    table: str
    column: str
    unit: str
    direction: Direction
    statistic: Literal["median", "p99"] = "median"
    min_samples: int = 10
    list_column: bool = False  # the column holds a list per row (itls_ms): pool the elements
    case_columns: tuple[str, ...] = ()  # compare per case (one-batch grid point)
    gate_below_min: bool = True  # False: fewer than min_samples -> report_only, not insufficient_data

    @property
    def metric(self) -> str:
        return f"{self.name}.{self.statistic}"

    @property
    def quantile(self) -> float:
        return 0.5 if self.statistic == "median" else 0.99


_ONE_BATCH_CASE = ("batch_size", "input_len", "output_len")
GATED_METRICS: tuple[GatedMetric, ...] = (
    # Serving: one sample per successful request (per token for ITL).
    GatedMetric("serving.ttft_ms", "serving_requests", "ttft_ms", "ms", "lower_is_better"),
    GatedMetric("serving.itl_ms", "serving_requests", "itls_ms", "ms", "lower_is_better", list_column=True),
    GatedMetric("serving.tpot_ms", "serving_requests", "tpot_ms", "ms", "lower_is_better"),
    GatedMetric("serving.e2e_latency_ms", "serving_requests", "e2e_latency_ms", "ms", "lower_is_better"),
    GatedMetric("serving.ttft_ms", "serving_requests", "ttft_ms", "ms", "lower_is_better", statistic="p99"),
    GatedMetric("serving.itl_ms", "serving_requests", "itls_ms", "ms", "lower_is_better", statistic="p99",
                list_column=True),
    GatedMetric("serving.e2e_latency_ms", "serving_requests", "e2e_latency_ms", "ms", "lower_is_better",
                statistic="p99"),
    # One batch: one row per grid case and measurement; gated only when a case is repeated.
    GatedMetric("one_batch.output_throughput", "one_batch", "output_throughput", "tok/s", "higher_is_better",
                min_samples=3, case_columns=_ONE_BATCH_CASE, gate_below_min=False),
    GatedMetric("one_batch.latency", "one_batch", "latency", "s", "lower_is_better",
                min_samples=3, case_columns=_ONE_BATCH_CASE, gate_below_min=False),
    # Occupancy: one sample per scrape (NaN window starts dropped).
    GatedMetric("occupancy.fwd_occupancy", "occupancy_samples", "fwd_occupancy", "%", "higher_is_better",
                min_samples=5),
)


# ---- samples ------------------------------------------------------------------------------
def _case_label(values: Sequence[Any]) -> str:
    short = {"batch_size": "bs", "input_len": "in", "output_len": "out"}
    return ",".join(f"{short.get(c, c)}={v}" for c, v in zip(_ONE_BATCH_CASE, values))


def extract_samples(metric: GatedMetric, tables: Mapping[str, pd.DataFrame]) -> dict[str, np.ndarray]:
    """The metric's finite raw samples in one run's tables, per case ("" when not per case).
    Only successful requests and measured one-batch cases count. Missing table or column: {}."""
    df = tables.get(metric.table)
    if df is None or metric.column not in df.columns or df.empty:
        return {}
    if "success" in df.columns:
        df = df[df["success"].fillna(False).astype(bool)]
    if "status" in df.columns and metric.table == "one_batch":
        df = df[df["status"] == "measured"]
    groups: list[tuple[str, pd.DataFrame]]
    if metric.case_columns and all(c in df.columns for c in metric.case_columns):
        groups = [(_case_label(k), g) for k, g in df.groupby(list(metric.case_columns), sort=True)]
    else:
        groups = [("", df)]
    out: dict[str, np.ndarray] = {}
    for label, g in groups:
        col = g[metric.column]
        if metric.list_column:
            parts = [np.asarray(v, dtype=float).ravel() for v in col if v is not None and np.ndim(v) > 0]
            values = np.concatenate(parts) if parts else np.empty(0)
        else:
            values = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)
        values = values[np.isfinite(values)]
        if values.size:
            out[label] = values
    return out


def extract_requests(metric: GatedMetric, tables: Mapping[str, pd.DataFrame]) -> dict[str, list[np.ndarray]]:
    """A list-column metric's finite samples grouped by row (one array per request), per case:
    the clusters of the per-request bootstrap. Rows left with no finite sample are dropped."""
    df = tables.get(metric.table)
    if not metric.list_column or df is None or metric.column not in df.columns or df.empty:
        return {}
    if "success" in df.columns:
        df = df[df["success"].fillna(False).astype(bool)]
    out: dict[str, list[np.ndarray]] = {}
    clusters = []
    for v in df[metric.column]:
        if v is None or np.ndim(v) == 0:
            continue
        a = np.asarray(v, dtype=float).ravel()
        a = a[np.isfinite(a)]
        if a.size:
            clusters.append(a)
    if clusters:
        out[""] = clusters
    return out


# ---- statistics ---------------------------------------------------------------------------
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


def _run_sd(groups: Sequence[Samples], rng: np.random.Generator, n_boot: int = 200) -> float:
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


def estimate_run_noise(runs: Sequence[Mapping[str, pd.DataFrame]], metrics: Sequence[GatedMetric] = GATED_METRICS,
                       *, seed: int = 0) -> dict[str, float]:
    """Between-run noise (sd of log medians, sampling noise removed) of each median metric over
    runs of an unchanged worker; per-case metrics take their noisiest case."""
    out: dict[str, float] = {}
    for m_index, metric in enumerate(metrics):
        if metric.statistic != "median":
            continue
        per_run: list[dict[str, Samples]] = []
        for tables in runs:
            per_run.append(dict(extract_requests(metric, tables)) if metric.list_column
                           else dict(extract_samples(metric, tables)))
        cases = sorted({c for r in per_run for c in r})
        rng = np.random.default_rng(seed + 31 * m_index)
        sds = [_run_sd([r[c] for r in per_run if c in r], rng) for c in cases]
        if sds:
            out[metric.metric] = max(out.get(metric.metric, 0.0), max(sds))
    return out


def calibration_figures(calibration: Mapping[str, Any] | None, bound: float,
                        tail_bound: float = DEFAULT_TAIL_BOUND) -> tuple[dict[str, float], dict[tuple[str, str], dict]]:
    """From a stored calibration (``Store.latest_calibration``): the run noise per metric, and per
    ``(metric, case)`` the figures recorded for the bound nearest to the one in force."""
    if not calibration:
        return {}, {}
    noise: dict[str, float] = {}
    best: dict[tuple[str, str], dict] = {}
    for rec in calibration.get("metrics") or []:
        sd = rec.get("run_sd")
        if sd is not None and math.isfinite(float(sd)):
            noise[rec["metric"]] = max(noise.get(rec["metric"], 0.0), float(sd))
        target = bound if rec.get("statistic") == "median" else tail_bound
        k = (rec["metric"], rec.get("case") or "")
        if k not in best or abs(rec["bound"] - target) < abs(best[k]["bound"] - target):
            best[k] = dict(rec)
    return noise, best


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


def decide(ci_low: float, ci_high: float, direction: Direction, bound: float) -> str:
    """regression | improvement | no_change | inconclusive from a ratio interval (see module doc)."""
    if direction == "lower_is_better":
        bad_end, good_end = ci_high, ci_low
        if math.isfinite(good_end) and good_end > 1 + bound:
            return "regression"
        if math.isfinite(bad_end) and bad_end < 1 - bound:
            return "improvement"
        if math.isfinite(bad_end) and bad_end <= 1 + bound:
            return "no_change"
        return "inconclusive"
    bad_end, good_end = ci_low, ci_high
    if math.isfinite(good_end) and good_end < 1 - bound:
        return "regression"
    if math.isfinite(bad_end) and bad_end > 1 + bound:
        return "improvement"
    if math.isfinite(bad_end) and bad_end >= 1 - bound:
        return "no_change"
    return "inconclusive"


# ---- the comparison table -----------------------------------------------------------------
def _row(metric: GatedMetric, case: str, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {c: math.nan for c in COMPARISON_COLUMNS}
    row.update(metric=metric.metric, table=metric.table, case=case, statistic=metric.statistic, unit=metric.unit,
               direction=metric.direction, n_baseline=0, n_current=0, n_baseline_runs=0, gated=True, reason=None)
    row.update(values)
    return row


def compare_tables(current: Mapping[str, pd.DataFrame], baseline_runs: Sequence[tuple[str, Mapping[str, pd.DataFrame]]],
                   *, metrics: Sequence[GatedMetric] = GATED_METRICS, bound: float = DEFAULT_BOUND,
                   tail_bound: float = DEFAULT_TAIL_BOUND, confidence: float = DEFAULT_CONFIDENCE,
                   n_boot: int = DEFAULT_N_BOOT, seed: int = 0, baseline_policy: str = "",
                   baseline_reason: str | None = None, run_noise: Mapping[str, float] | None = None) -> pd.DataFrame:
    """The comparison table of ``current`` tables against ``baseline_runs`` = [(run_id, tables)].

    No store needed (calibration compares in memory). A metric whose table the current run
    did not produce gives no row; one the baseline lacks gives ``insufficient_data``.
    ``run_noise``: metric (``serving.itl_ms.median``) -> calibrated between-run sd of log
    medians, the floor of the run-to-run noise term (module docstring).
    """
    run_noise = dict(run_noise or {})
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence!r}")
    if not (0 <= bound < 1 and 0 <= tail_bound < 1):
        raise ConfigError(f"bounds are fractions in [0, 1), got bound={bound!r}, tail_bound={tail_bound!r}")
    run_ids = ",".join(rid for rid, _ in baseline_runs)
    rows: list[dict[str, Any]] = []
    for m_index, metric in enumerate(metrics):
        cur_cases = extract_samples(metric, current)
        if not cur_cases:
            continue
        base_by_run = [extract_samples(metric, tables) for _, tables in baseline_runs]
        # Tokens of one request are not independent: list-column metrics are resampled by request.
        cur_requests = extract_requests(metric, current)
        base_requests = [extract_requests(metric, tables) for _, tables in baseline_runs]
        metric_bound = tail_bound if metric.statistic != "median" else bound
        for c_index, (case, cur) in enumerate(cur_cases.items()):
            groups = [b[case] for b in base_by_run if case in b]
            n_base = int(sum(g.size for g in groups))
            common = dict(bound=metric_bound, confidence=confidence, n_current=int(cur.size), n_baseline=n_base,
                          n_baseline_runs=len(groups), current_median=float(np.median(cur)),
                          current_value=float(np.quantile(cur, metric.quantile)), baseline_policy=baseline_policy,
                          baseline_runs=run_ids)
            if groups:
                pooled = np.concatenate(groups)
                common.update(baseline_median=float(np.median(pooled)),
                              baseline_value=float(np.quantile(pooled, metric.quantile)))
            if not metric.gate_below_min and cur.size < metric.min_samples:
                # Not gated at this run's sample size whatever the history holds: say so the same way
                # on the first night as on the tenth.
                rows.append(_row(metric, case, decision="report_only", gated=False,
                                 reason=f"{cur.size} sample(s) in this run, {metric.min_samples} needed; "
                                        f"repeat each case to gate it", **common))
                continue
            if not groups:
                reason = baseline_reason or ("no baseline run has this metric" if baseline_runs
                                             else "no baseline runs: too little history")
                rows.append(_row(metric, case, decision="insufficient_data", reason=reason, **common))
                continue
            if min(cur.size, n_base) < metric.min_samples:
                short = (f"{min(cur.size, n_base)} sample(s) on a side, {metric.min_samples} needed")
                if not metric.gate_below_min:
                    rows.append(_row(metric, case, decision="report_only", gated=False,
                                     reason=f"{short}; repeat each case to gate it", **common))
                else:
                    rows.append(_row(metric, case, decision="insufficient_data", reason=short, **common))
                continue
            cur_side: Samples = cur
            base_sides: Sequence[Samples] = groups
            if metric.list_column:
                cur_side = cur_requests.get(case, [cur])
                base_sides = [b[case] for b in base_requests if case in b]
            if metric.statistic == "median":
                rng = np.random.default_rng(seed + 7919 * m_index + c_index)
                run_sd = max(_run_sd(base_sides, rng), float(run_noise.get(metric.metric, 0.0)))
                ratio, low, high = ratio_ci_median(cur_side, base_sides, confidence=confidence, n_boot=n_boot,
                                                   seed=seed + 1009 * m_index + c_index, run_sd=run_sd)
                common["run_sd"] = run_sd
                gated, reason = True, None
            else:
                ratio, low, high = ratio_ci_quantile(cur, np.concatenate(groups), metric.quantile,
                                                     confidence=confidence)
                gated = math.isfinite(low) and math.isfinite(high)
                reason = None if gated else (f"{metric.statistic} of n={cur.size} vs n={n_base} has no finite "
                                             f"order-statistic bound at {confidence:.0%}; reported, not gated")
                if gated and metric.list_column:
                    # The order-statistic interval assumes independent samples; a request's tokens are
                    # not, so a tail of tokens is bounded by resampling requests instead.
                    low, high = ratio_ci_quantile_clustered(cur_side, base_sides, metric.quantile, confidence=confidence,
                                                            n_boot=n_boot, seed=seed + 1009 * m_index + c_index)
            if not math.isfinite(ratio):
                rows.append(_row(metric, case, decision="insufficient_data", ratio=ratio, ci_low=low, ci_high=high,
                                 reason="baseline statistic is 0: a ratio is undefined", **common))
                continue
            decision = decide(low, high, metric.direction, metric_bound) if gated else "report_only"
            rows.append(_row(metric, case, ratio=ratio, ci_low=low, ci_high=high, gated=gated, decision=decision,
                             reason=reason, **common))
    df = pd.DataFrame(rows, columns=COMPARISON_COLUMNS)
    for col in ("n_baseline", "n_current", "n_baseline_runs"):
        df[col] = df[col].astype("int64")
    df["gated"] = df["gated"].astype(bool)
    return df


def compare_run(store: Store, run: str | Mapping[str, pd.DataFrame], key: GateKey | None = None, *,
                policy: BaselinePolicy | None = None, metrics: Sequence[GatedMetric] = GATED_METRICS,
                bound: float = DEFAULT_BOUND, tail_bound: float = DEFAULT_TAIL_BOUND,
                confidence: float = DEFAULT_CONFIDENCE, n_boot: int = DEFAULT_N_BOOT, seed: int = 0,
                exclude_run: str | None = None, calibration: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """Compare a run with its key's baseline (chosen by ``policy``) and return the comparison table.

    ``run``: a recorded run id (its tables are read from the store, its key and run group
    found there) or the tables of a run not yet recorded (then ``key`` is required; pass its
    ``exclude_run`` when it is a re-run of a recorded run, to keep its own group out).
    The table's ``attrs["baseline"]`` holds :meth:`Baseline.as_dict`, ``attrs["calibration"]``
    :func:`calibration_summary` of the key's latest calibration (``calibration``, when given,
    is used instead of the stored one); its run noise floors the run-to-run term.
    """
    if isinstance(run, str):
        record = store.get_run(run)
        if key is not None and key != record.key:
            raise ConfigError(f"run {run} belongs to gate {record.key}, not {key}")
        key, current, exclude_run = record.key, store.tables(run), run
    else:
        if key is None:
            raise ConfigError("compare_run with tables needs the gate key (GateKey.from_run(manifest, config))")
        current = run
    baseline: Baseline = resolve_baseline(store, key, policy, exclude_run=exclude_run)
    baseline_tables = [(r.run_id, store.tables(r.run_id, {m.table for m in metrics})) for r in baseline.runs]
    if not baseline.sufficient:
        baseline_tables = []
    if calibration is None:
        calibration = store.latest_calibration(key)
    run_noise, figures = calibration_figures(calibration, bound, tail_bound)
    df = compare_tables(current, baseline_tables, metrics=metrics, bound=bound, tail_bound=tail_bound,
                        confidence=confidence, n_boot=n_boot, seed=seed, baseline_policy=baseline.policy,
                        baseline_reason=baseline.reason, run_noise=run_noise)
    for i, (metric, case) in enumerate(zip(df["metric"], df["case"])):
        fig = figures.get((metric, case))
        if fig is not None:
            for col in ("false_alarm_upper95", "min_detectable"):
                value = fig.get(col)
                df.loc[df.index[i], col] = math.nan if value is None else float(value)
    df.attrs["baseline"] = baseline.as_dict()
    df.attrs["calibration"] = calibration_summary(calibration, bound, tail_bound)
    return df


def calibration_summary(calibration: Mapping[str, Any] | None, bound: float = DEFAULT_BOUND,
                        tail_bound: float = DEFAULT_TAIL_BOUND) -> dict[str, Any] | None:
    """What a verdict carries about the key's calibration: when, how many runs, the gate-level
    false alarms, and per gated metric (at the bound in force, or the nearest calibrated one)
    its false-alarm bound and smallest detectable change."""
    if not calibration:
        return None
    _, figures = calibration_figures(calibration, bound, tail_bound)
    summary = calibration.get("summary") or {}
    at = calibration.get("at")
    gate_level = summary.get("gate_false_alarms") or {}
    nearest = min(gate_level, key=lambda b: abs(float(b) - bound)) if gate_level else None
    return {
        "id": calibration.get("id"),
        "bound": float(nearest) if nearest is not None else None,
        "gate_false_alarms_at_bound": gate_level.get(nearest) if nearest is not None else None,
        "at": at.isoformat() if hasattr(at, "isoformat") else at,
        "aa_runs": summary.get("aa_runs"),
        "ab_runs": summary.get("ab_runs"),
        "measurement_s_per_decision": summary.get("measurement_s_per_decision"),
        "gate_false_alarms": summary.get("gate_false_alarms"),
        "metrics": [{k: rec.get(k) for k in ("metric", "case", "bound", "run_sd", "false_alarms", "aa_comparisons",
                                             "false_alarm_upper95", "min_detectable", "min_detected_injected")}
                    for rec in figures.values() if rec.get("aa_comparisons")],
    }
