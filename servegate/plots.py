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
from servegate.render import ratio_number_text

__all__ = ["one_batch_plot", "cdf_plot", "occupancy_plot", "speculated", "speculation_plot", "trend_plot",
           "paired_ratio_plot", "paired_interval_plot"]


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


def speculated(tables: Mapping[str, pd.DataFrame]) -> bool:
    """True when the run's worker speculated: ``occupancy_summary.speculative_decoding``, or (a table
    without that column) an accept length above 0 in the scrapes (servers report 0 with speculation off)."""
    summary = tables.get("occupancy_summary")
    if summary is not None and not summary.empty and "speculative_decoding" in summary.columns:
        return bool(summary["speculative_decoding"].fillna(False).astype(bool).any())
    samples = tables.get("occupancy_samples")
    if samples is None or samples.empty or "spec_accept_length" not in samples.columns:
        return False
    return bool((pd.to_numeric(samples["spec_accept_length"], errors="coerce") > 0).any())


def _token_times(requests: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each inter-token latency of the serving load at the time its token arrived (s since the first send)."""
    times: list[float] = []
    itls: list[float] = []
    ok = requests[requests["success"].fillna(False).astype(bool)] if "success" in requests.columns else requests
    start = pd.to_numeric(ok["actual_send_s"], errors="coerce").min() if len(ok) else math.nan
    for send, ttft, row_itls in zip(ok["actual_send_s"], ok["ttft_ms"], ok["itls_ms"]):
        values = np.asarray(row_itls if row_itls is not None else [], dtype=float)
        if values.size == 0 or not np.isfinite(send) or not np.isfinite(ttft):
            continue
        arrive = send - start + (ttft + np.cumsum(values)) / 1000.0
        times.extend(arrive.tolist())
        itls.extend(values.tolist())
    return np.asarray(times), np.asarray(itls)


def speculation_plot(tables: Mapping[str, pd.DataFrame]) -> str:
    """Speculative decoding next to latency: the accept length over the occupancy request (the
    worker's gauge, one point per scrape) beside the serving load's inter-token latencies over time.
    A speculating worker emits its accepted drafts together: ITLs near 0 between the tokens of one
    verification pass, one pass's time before the next; an accept length falling towards 1 shows
    as the near-zero ITLs disappearing."""
    name, title = "speculation_over_time", "Speculative decoding: accept length over time, and ITL"
    samples = tables.get("occupancy_samples")
    accept = pd.Series(dtype=float)
    if samples is not None and not samples.empty and "spec_accept_length" in samples.columns:
        accept = pd.to_numeric(samples["spec_accept_length"], errors="coerce")
    requests = tables.get("serving_requests")
    times, itls = (np.array([]), np.array([]))
    if requests is not None and not requests.empty and {"actual_send_s", "ttft_ms", "itls_ms"} <= set(requests.columns):
        times, itls = _token_times(requests)
    if accept.dropna().empty and itls.size == 0:
        return _plot(name, title, None, "no accept length was scraped and no serving request has inter-token latencies")
    fig = _figure(width=9.6, height=3.4)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.2, top=0.92, wspace=0.28)
    left, right = fig.subplots(1, 2)
    if accept.dropna().empty:
        left.text(0.5, 0.5, "no accept length scraped", ha="center", va="center", transform=left.transAxes)
    else:
        left.plot(samples["t_s"], accept, marker=".", color="#8250df", label="spec_accept_length")
        median = float(accept.dropna().median())
        left.axhline(median, linestyle="--", color="#8c959f", label=f"median {median:.2f}")
        left.axhline(1.0, linestyle=":", color="#cf222e", label="1 (no draft accepted)")
        left.set_ylim(bottom=0)
        left.legend(fontsize="small")
    left.set_title("occupancy stage: accept length", fontsize="medium")
    left.set_xlabel("time since the request started (s)")
    left.set_ylabel("tokens per verification pass")
    left.grid(alpha=0.3)
    if itls.size == 0:
        right.text(0.5, 0.5, "no inter-token latencies", ha="center", va="center", transform=right.transAxes)
    else:
        right.plot(times, itls, linestyle="none", marker=".", markersize=3, color="#0969da", label="ITL")
        right.axhline(float(np.median(itls)), linestyle="--", color="#8c959f",
                      label=f"median {np.median(itls):.1f} ms")
        right.legend(fontsize="small")
    right.set_title("serving stage: inter-token latency", fontsize="medium")
    right.set_xlabel("time since the first request (s)")
    right.set_ylabel("ITL (ms)")
    right.grid(alpha=0.3)
    return _plot(name, title, fig)


_DECISION_COLOURS = {"regression": "#cf222e", "suspicious": "#9a6700"}
"""The current run's point in a trend plot, when its decision is one of these (else blue): the
report's colours for a regression and for the history rule's not-yet-called one."""


def trend_plot(rows: Sequence[Mapping[str, Any]], metric: GatedMetric,
                history: Sequence[tuple[RunRecord, dict[str, Any]]], run_id: str, baseline_ids: set[str]) -> str:
    """One metric's per-run statistic over the key's runs; one line per case (one-batch grid
    points), and for a single-case metric the baseline band: baseline value x [1 - bound, 1 + bound]."""
    name = f"trend:{metric.metric}"
    title = (f"Trend: {metric.metric} ({metric.unit}, {metric.direction.replace('_', ' ')}"
             f"{', report only: never gated' if metric.report_only else ''})")
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
            decision = row.get("decision")
            ax.scatter([cur[0][0]], [cur[0][1]], color=_DECISION_COLOURS.get(decision, "#0969da"), s=50, zorder=4,
                       label=f"this run: {decision}" if decision in _DECISION_COLOURS else None)
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


# ---- the paired stage -----------------------------------------------------------------------
def _metric_rounds(row: Mapping[str, Any], rounds: pd.DataFrame | None) -> pd.DataFrame:
    """The ``paired_rounds`` rows of ``row``'s metric, in round order (empty when there are none)."""
    if rounds is None or rounds.empty or not {"metric", "round"} <= set(rounds.columns):
        return pd.DataFrame()
    return rounds[rounds["metric"] == row.get("metric")].sort_values("round")


def _bound_lines(ax: Any, row: Mapping[str, Any]) -> None:
    """The decision's bounds on the ratio scale: ×(1 + bound) and ×(1 − bound), the one a
    regression must clear in red (which side depends on the metric's direction)."""
    bound = row.get("bound")
    if bound is None or not math.isfinite(bound):
        return
    worse_up = row.get("direction") != "higher_is_better"
    for value, bad in ((1 + bound, worse_up), (1 - bound, not worse_up)):
        ax.axhline(value, linestyle="--", linewidth=1, color="#cf222e" if bad else "#1a7f37",
                   label=f"{'regression' if bad else 'improvement'} bound ×{ratio_number_text(value)}")
    ax.axhline(1.0, color="#8c959f", linewidth=0.8)


def _restart_lines(ax: Any, g: pd.DataFrame) -> None:
    """A dotted line before each round that ran on freshly restarted workers."""
    if "instance" not in g.columns:
        return
    changed = g["round"][g["instance"].ne(g["instance"].shift()) & g["instance"].shift().notna()]
    for i, r in enumerate(changed):
        ax.axvline(float(r) - 0.5, linestyle=":", color="#57606a", label="workers restarted" if i == 0 else None)


def _round_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are counted, not measured


def _paired_title(row: Mapping[str, Any], what: str) -> str:
    return f"Paired: {row.get('metric')} ({row.get('unit')}), {what}"


def paired_ratio_plot(row: Mapping[str, Any], rounds: pd.DataFrame | None) -> str:
    """One metric of the ``paired`` table: each round's candidate / baseline (``b_value / a_value``),
    the ratio over all rounds (geometric mean) and the bound lines at 1 ± bound."""
    name, title = f"paired_ratio:{row.get('metric')}", _paired_title(row, "candidate / baseline per round")
    g = _metric_rounds(row, rounds)
    if g.empty:
        return _plot(name, title, None, "no round of the paired stage measured this metric")
    per_round = pd.to_numeric(g["b_value"], errors="coerce") / pd.to_numeric(g["a_value"], errors="coerce")
    finite = np.isfinite(per_round.to_numpy(dtype=float))
    if not finite.any():
        return _plot(name, title, None, "no round has a finite value on both sides")
    fig = _figure()
    ax = fig.subplots()
    ax.plot(g["round"][finite], per_round[finite], marker="o", markersize=4, linewidth=0.8, color="#0969da",
            label="candidate / baseline in the round", gid=f"{name}:rounds")  # the points, findable in the SVG
    ratio = row.get("ratio")
    if ratio is not None and math.isfinite(ratio):
        ax.axhline(ratio, color="#0969da", linewidth=1.5, alpha=0.6,
                   label=f"over all rounds ×{ratio_number_text(ratio)}")
    _bound_lines(ax, row)
    _restart_lines(ax, g)
    _round_axis(ax)
    ax.set_ylabel("candidate / baseline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="best")
    return _plot(name, title, fig)


def paired_interval_plot(row: Mapping[str, Any], rounds: pd.DataFrame | None) -> str:
    """One metric's interval as it narrowed: after each round, the ratio so far and its
    repeated confidence interval (``ci_low``..``ci_high``, valid at every look), with the bound
    lines and the round at which the metric was first decided. The early looks' intervals are
    astronomically wide (the design spends almost no error rate there): the y axis spans the
    ratios and the bounds, and what lies beyond is cut at its edge."""
    name, title = f"paired_interval:{row.get('metric')}", _paired_title(row, "interval after each round")
    g = _metric_rounds(row, rounds)
    if g.empty:
        return _plot(name, title, None, "no round of the paired stage measured this metric")
    x = g["round"].to_numpy(dtype=float)
    ratio = pd.to_numeric(g["ratio"], errors="coerce").to_numpy(dtype=float)
    low = pd.to_numeric(g["ci_low"], errors="coerce").to_numpy(dtype=float)
    high = pd.to_numeric(g["ci_high"], errors="coerce").to_numpy(dtype=float)
    bounded = np.isfinite(low) & np.isfinite(high) & (low > 0)  # round 1: no spread yet, no interval
    if not bounded.any():
        return _plot(name, title, None, "the interval was never bounded (fewer than 2 rounds)")
    fig = _figure()
    ax = fig.subplots()
    confidence = row.get("confidence")
    level = f"{confidence:.0%} " if confidence is not None and math.isfinite(confidence) else ""
    ax.fill_between(x[bounded], low[bounded], high[bounded], color="#0969da", alpha=0.2, linewidth=0,
                    label=f"{level}repeated confidence interval")
    ax.plot(x[np.isfinite(ratio)], ratio[np.isfinite(ratio)], marker=".", color="#0969da", linewidth=1,
            label="ratio after the round")
    _bound_lines(ax, row)
    _restart_lines(ax, g)
    if "decision" in g.columns:
        decided = g[g["decision"].isin(["regression", "improvement", "no_change"])]
        if not decided.empty:
            first = decided.iloc[0]
            ax.axvline(float(first["round"]), color="#57606a", linewidth=1,
                       label=f"decided: {first['decision']} (round {int(first['round'])})")
    _round_axis(ax)
    bound = row.get("bound")
    shown = [*ratio[np.isfinite(ratio)], 1.0, *((1 + bound, 1 - bound) if bound is not None and math.isfinite(bound)
                                               else ())]
    span = max(shown) - min(shown)
    ax.set_ylim(max(0.0, min(shown) - span), max(shown) + span)
    ax.set_ylabel("candidate / baseline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="best")
    return _plot(name, title, fig)
