"""The report's plots: inline SVG drawn with matplotlib's object API (no pyplot global state).

Every plot is a ``<figure class="plot" data-plot="NAME">`` holding one ``<svg>``; a plot without
data is a figure with ``data-empty="why"`` and a sentence instead. matplotlib is imported when
the first plot is drawn.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from servegate.gated_metrics import GatedMetric, extract_samples
from servegate.history import RunRecord

__all__ = ["one_batch_plot", "cdf_plot", "occupancy_plot", "trend_plot"]


def _figure(width: float = 6.4, height: float = 3.4) -> Any:
    import matplotlib

    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: smaller files, searchable
    from matplotlib.figure import Figure

    # A fixed layout: constrained layout draws every figure twice (half the report's build time).
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.13, right=0.97, bottom=0.2, top=0.95)
    return fig


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline SVG in HTML5


def _plot(name: str, title: str, fig: Any | None, empty_reason: str | None = None) -> str:
    attrs = f'class="plot" data-plot="{html.escape(name)}"'
    if fig is None:
        return (f'<figure {attrs} data-empty="{html.escape(empty_reason or "no data")}"><figcaption>'
                f'{html.escape(title)}</figcaption><p class="empty">No plot: {html.escape(empty_reason or "no data")}'
                f'</p></figure>')
    return f"<figure {attrs}><figcaption>{html.escape(title)}</figcaption>{_svg(fig)}</figure>"


def one_batch_plot(df: pd.DataFrame | None) -> str:
    title = "One batch: latency vs batch size"
    if df is None or df.empty or "latency" not in df.columns:
        return _plot("one_batch_latency", title, None, "the one-batch stage produced no table")
    measured = df[df["status"] == "measured"] if "status" in df.columns else df
    measured = measured[np.isfinite(pd.to_numeric(measured["latency"], errors="coerce"))]
    if measured.empty:
        return _plot("one_batch_latency", title, None, "no one-batch case was measured")
    fig = _figure()
    ax = fig.subplots()
    for (inp, out), g in measured.groupby(["input_len", "output_len"], sort=True):
        g = g.groupby("batch_size", as_index=False)["latency"].median()
        ax.plot(g["batch_size"], g["latency"], marker="o", label=f"in={inp}, out={out}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("latency (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _plot("one_batch_latency", title, fig)


def _cdf(ax: Any, values: np.ndarray, label: str, **kw: Any) -> None:
    xs = np.sort(values)
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=f"{label} (n={xs.size})", **kw)


def cdf_plot(name: str, title: str, metric: GatedMetric, current: Mapping[str, pd.DataFrame],
              baseline: Sequence[Mapping[str, pd.DataFrame]]) -> str:
    cur = extract_samples(metric, current).get("")
    if cur is None:
        return _plot(name, title, None, f"no {metric.column} samples in {metric.table}")
    fig = _figure()
    ax = fig.subplots()
    base = [extract_samples(metric, t).get("") for t in baseline]
    base = [b for b in base if b is not None]
    if base:
        _cdf(ax, np.concatenate(base), "baseline (pooled)", color="#8c959f")
    _cdf(ax, cur, "this run", color="#0969da")
    ax.set_xlabel(f"{metric.column} ({metric.unit})")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    return _plot(name, title, fig)


def occupancy_plot(df: pd.DataFrame | None) -> str:
    title = "Forward occupancy over time"
    if df is None or df.empty or "fwd_occupancy" not in df.columns:
        return _plot("occupancy_over_time", title, None, "the occupancy stage produced no samples")
    fig = _figure()
    ax = fig.subplots()
    ax.plot(df["t_s"], df["fwd_occupancy"], marker=".", label="fwd_occupancy (%)")
    finite = pd.to_numeric(df["fwd_occupancy"], errors="coerce").dropna()
    if not finite.empty:
        ax.axhline(float(finite.median()), linestyle="--", color="#8c959f", label=f"median {finite.median():.1f}")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("forward occupancy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _plot("occupancy_over_time", title, fig)


def trend_plot(rows: Sequence[Mapping[str, Any]], metric: GatedMetric,
                history: Sequence[tuple[RunRecord, dict[str, Any]]], run_id: str, baseline_ids: set[str]) -> str:
    """One metric's per-run statistic over the key's runs; one line per case (one-batch grid
    points), and for a single-case metric the baseline band: baseline value x [1 - bound, 1 + bound]."""
    name = f"trend:{metric.metric}"
    title = f"Trend: {metric.metric} ({metric.unit}, {metric.direction.replace('_', ' ')})"
    fig = _figure(6.4, 2.8)
    ax = fig.subplots()
    plotted = False
    for row in rows:
        case = row.get("case") or ""
        points = []
        for rec, tables in history:
            values = extract_samples(metric, tables).get(case)
            if values is not None:
                points.append((rec.started_at, float(np.quantile(values, metric.quantile)), rec.run_id))
        if not points:
            continue
        plotted = True
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, linewidth=1,
                label=case or "runs", color=None if case else "#57606a")
        cur = [(x, y) for x, y, rid in points if rid == run_id]
        if cur:
            colour = "#cf222e" if row.get("decision") == "regression" else "#0969da"
            ax.scatter([cur[0][0]], [cur[0][1]], color=colour, s=50, zorder=4)
        if len(rows) > 1:
            continue
        base = [(x, y) for x, y, rid in points if rid in baseline_ids]
        if base:
            ax.scatter([b[0] for b in base], [b[1] for b in base], color="#8c959f", zorder=3, label="baseline runs")
        value, bound = row.get("baseline_value"), row.get("bound")
        if value is not None and bound is not None and math.isfinite(value) and math.isfinite(bound):
            ax.axhspan(value * (1 - bound), value * (1 + bound), color="#2da44e", alpha=0.15,
                       label=f"baseline ±{bound:.0%}")
            ax.axhline(value, color="#2da44e", linewidth=1)
    if not plotted:
        return _plot(name, title, None, "no run of this gate has this metric")
    ax.set_ylabel(f"{metric.statistic} ({metric.unit})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="best")
    fig.autofmt_xdate()
    return _plot(name, title, fig)
