"""The gated metrics: what the gate compares with its baseline, and where each one's raw
samples are in a run's tables.

A metric declared ``report_only`` (the worker's start-up time and memory high-water mark, the cost
per million output tokens) is compared, shown in the comparison table and trended like the others,
but its row is never gated: whatever its change, the verdict does not move. Gating one is an
absolute threshold in the profile's expectations (the ``worker`` and ``cost`` tables), off by default.

A :class:`GatedMetric` names a table and column, a unit, which direction is better, and the
statistic compared (median or p99); :data:`GATED_METRICS` is the catalogue the compare stage,
calibration and the report share. :func:`extract_samples` and :func:`extract_requests` read one
run's finite samples (per request, per token, per scrape, per one-batch case) for a metric;
:func:`resolution_log` how finely a per-run value (the capacity) was resolved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

__all__ = ["Direction", "GatedMetric", "GATED_METRICS", "extract_samples", "extract_requests", "resolution_log"]

Direction = Literal["lower_is_better", "higher_is_better"]

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
    per_run: bool = False
    """One value per run (the capacity sweep's result): the current side is that value, its spread is
    between runs only, and ``min_samples`` counts baseline runs."""
    report_only: bool = False
    """Compared, shown and trended, never gated: its row's decision is ``report_only`` whatever the
    interval says (the interval is still there to read)."""
    resolution_columns: tuple[str, str] | None = None
    """(low, high) columns bracketing a per-run value (the sweep's last good and first bad rate): the
    value is only known to within their ratio, which floors the run-to-run noise term."""

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
    # Capacity: one value per run, compared over baseline runs (at least 2, for their spread).
    GatedMetric("capacity.capacity_rps", "capacity", "capacity_rps", "req/s", "higher_is_better", min_samples=2,
                per_run=True, resolution_columns=("last_good_rate", "first_bad_rate")),
    # Report-only, one value per run: what a run costs, tracked beside what it measures. Start-up time
    # moves with the page cache and the disk (a cold model load is seconds slower), memory with the
    # allocator: neither says the serving path regressed, so neither fails a gate unless a profile says so.
    GatedMetric("worker.startup_s", "worker", "startup_s", "s", "lower_is_better", min_samples=2, per_run=True,
                report_only=True),
    GatedMetric("worker.peak_rss_mib", "worker", "peak_rss_mib", "MiB", "lower_is_better", min_samples=2,
                per_run=True, report_only=True),
    GatedMetric("cost.cost_per_mtok_output", "cost", "cost_per_mtok_output", "per Mtok", "lower_is_better",
                min_samples=2, per_run=True, report_only=True),
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


def resolution_log(metric: GatedMetric, tables: Mapping[str, pd.DataFrame]) -> float:
    """``log(high / low)`` of a per-run metric's bracketing columns in one run (the sweep's last good
    and first bad rate): the relative width within which its value is known. NaN when not bracketed
    (no such columns, a capacity at max_rate or below the start rate)."""
    df = tables.get(metric.table)
    if metric.resolution_columns is None or df is None or df.empty:
        return float("nan")
    low_col, high_col = metric.resolution_columns
    if low_col not in df.columns or high_col not in df.columns:
        return float("nan")
    low = pd.to_numeric(df[low_col], errors="coerce").to_numpy(dtype=float)
    high = pd.to_numeric(df[high_col], errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(low) & np.isfinite(high) & (low > 0) & (high > low)
    return float(np.max(np.log(high[ok] / low[ok]))) if ok.any() else float("nan")
