"""A gate key's history as the dashboard draws it: one value per run for each gated metric,
the baseline, the release manager's actions, and the change points.

Every run group counts once, as its effective (latest) attempt, oldest first. A metric's value
for a run is the statistic the compare stage compares (the median of its raw samples, or the
one value per run of the capacity sweep), per one-batch case where the metric has cases. Only
the median metrics are trended (as the report's trends): a p99 from a nightly's few hundred
requests moves too much from night to night to read a trend in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from servegate.errors import ConfigError
from servegate.dashboard.changepoints import ChangePoint, find_change_points
from servegate.gated_metrics import GATED_METRICS, GatedMetric, extract_samples
from servegate.history import GateKey, RunRecord, Store

__all__ = ["MetricSeries", "KeyHistory", "key_history", "latest_change_point", "TRENDED_METRICS", "MAX_RUNS"]

TRENDED_METRICS: tuple[GatedMetric, ...] = tuple(m for m in GATED_METRICS if m.statistic == "median")
MAX_RUNS = 200
"""Runs per key read by default (the newest): a change point older than that is old news, and the
search is quadratic in the series' length (0.1 s for 100 runs)."""


@dataclass
class MetricSeries:
    """One gated metric (one case of it) over a key's runs."""

    metric: GatedMetric
    case: str
    run_ids: list[str]
    values: list[float]
    change_points: list[ChangePoint] = field(default_factory=list)
    bands: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """run id -> (baseline value, low, high) the run was compared with (its recorded comparison)."""

    @property
    def label(self) -> str:
        return self.metric.metric + (f" [{self.case}]" if self.case else "")

    def change_point_runs(self) -> list[tuple[ChangePoint, str]]:
        return [(cp, self.run_ids[cp.index]) for cp in self.change_points]

    def worse(self, cp: ChangePoint) -> bool:
        """True when the change goes the metric's bad way (up for a latency)."""
        up = cp.after > cp.before
        return up if self.metric.direction == "lower_is_better" else not up


@dataclass
class KeyHistory:
    key: GateKey
    runs: list[RunRecord]
    series: list[MetricSeries]
    baseline_policy: str
    baseline_run_ids: list[str]
    baseline_reason: str | None
    actions: list[dict[str, Any]]
    """Every baseline action (pin, unpin, distribution_change), in the order recorded."""
    pinned_run_id: str | None
    reference_at: datetime | None
    """Where the key's baseline starts: the active pin's run start, else the last distribution change."""

    @property
    def latest(self) -> RunRecord:
        return self.runs[-1]

    def run(self, run_id: str) -> RunRecord:
        return next(r for r in self.runs if r.run_id == run_id)


def report_path(record: RunRecord) -> Path | None:
    """The run's report.html when its run folder holds one."""
    if record.run_dir:
        path = Path(record.run_dir) / "report.html"
        if path.is_file():
            return path
    return None


def _value(metric: GatedMetric, samples: np.ndarray) -> float:
    return float(samples[-1]) if metric.per_run else float(np.quantile(samples, metric.quantile))


def key_history(store: Store, key: GateKey, *, since: datetime | None = None, max_runs: int = MAX_RUNS,
                metrics: Sequence[GatedMetric] = TRENDED_METRICS) -> KeyHistory:
    """``key``'s runs (effective attempts, oldest first, at most the newest ``max_runs``), each
    trended metric's series with its change points, the baseline and the baseline actions."""
    from servegate.baseline import active_pin, last_distribution_change, resolve_baseline

    runs = list(reversed(store.runs(key, since=since, include_attempts=False)[:max_runs]))
    needed = {m.table for m in metrics} | {"comparison"}
    points: dict[tuple[str, str], tuple[list[str], list[float]]] = {}
    bands: dict[tuple[str, str], dict[str, tuple[float, float, float]]] = {}
    for rec in runs:
        tables = store.tables(rec.run_id, needed)
        for metric in metrics:
            for case, samples in extract_samples(metric, tables).items():
                ids, values = points.setdefault((metric.metric, case), ([], []))
                ids.append(rec.run_id)
                values.append(_value(metric, samples))
        comparison = tables.get("comparison")
        if comparison is not None and {"metric", "baseline_value", "bound"} <= set(comparison.columns):
            for row in comparison.to_dict("records"):
                value, bound = row.get("baseline_value"), row.get("bound")
                if value is None or bound is None or not (np.isfinite(value) and np.isfinite(bound)):
                    continue
                case = row.get("case") or ""
                bands.setdefault((row["metric"], case if isinstance(case, str) else ""), {})[rec.run_id] = (
                    float(value), float(value) * (1 - bound), float(value) * (1 + bound))
    series = []
    for metric in metrics:
        for (name, case), (ids, values) in sorted(points.items()):
            if name != metric.metric:
                continue
            finite = np.isfinite(values)
            ids = [i for i, ok in zip(ids, finite) if ok]
            values = [v for v, ok in zip(values, finite) if ok]
            series.append(MetricSeries(metric, case, ids, values, find_change_points(values),
                                       bands.get((name, case), {})))
    baseline = resolve_baseline(store, key)
    pinned = active_pin(store, key)
    change = last_distribution_change(store, key)
    reference = None
    pinned_run_id = None
    if pinned is not None and pinned.get("run_id"):
        pinned_run_id = pinned["run_id"]
        try:
            reference = store.effective(pinned_run_id).started_at
        except ConfigError:  # a pinned run no longer in the database: the pin's own time
            reference = pinned["at"]
    elif change is not None:
        reference = change["at"]
    return KeyHistory(key=key, runs=runs, series=series, baseline_policy=baseline.policy,
                      baseline_run_ids=baseline.run_ids, baseline_reason=baseline.reason,
                      actions=store.baseline_actions(key), pinned_run_id=pinned_run_id, reference_at=reference)


def latest_change_point(history: KeyHistory) -> dict[str, Any] | None:
    """The newest change point of any trended metric that happened after the key's baseline
    reference (the pinned run, else the last distribution change, else the first run): the run
    before it and the run it is marked at both started after that reference, so a shift the
    release manager already accepted (a distribution change, a pin after it) is not named again.
    None when there is none."""
    best: tuple[datetime, dict[str, Any]] | None = None
    starts = {r.run_id: r.started_at for r in history.runs}
    for s in history.series:
        for cp, run_id in s.change_point_runs():
            previous = s.run_ids[cp.index - 1]
            if history.reference_at is not None and starts[previous] < history.reference_at:
                continue
            at = starts[run_id]
            if best is None or at > best[0]:
                runs_since = sum(1 for r in history.runs if r.started_at >= at)
                best = (at, {"metric": s.metric.metric, "case": s.case or None, "unit": s.metric.unit,
                             "run_id": run_id, "started_at": at.isoformat(), "kind": cp.kind,
                             "before": cp.before, "after": cp.after, "change": cp.change,
                             "worse": s.worse(cp), "runs_since": runs_since,
                             "in_baseline": bool(set(history.baseline_run_ids)
                                                 & {r for r in s.run_ids[cp.index:]})})
    return None if best is None else best[1]
