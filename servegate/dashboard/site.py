"""The dashboard's pages: ``index.html`` and one page per gate key under ``keys/``.

Self-contained static HTML (no script, no CDN, no external file but the runs' own reports):
plots are inline SVG drawn with matplotlib's object API (the report's helpers in
:mod:`servegate.plots`). Every string from the database (keys, run ids, reasons, actors) is
HTML-escaped; every link is relative, so the folder can be published as a CI artifact.

Markers a reader (or a test) can find in the SVG by id:
``changepoint:<run id>`` (a change point, at the first run of the new regime),
``pin:<run id>`` (a pinned baseline run), ``distribution-change:<n>`` (a distribution change),
``run:<metric>`` (the points, each linking to its run's report when there is one).
"""

from __future__ import annotations

import hashlib
import html
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from servegate.compare import DEFAULT_BOUND
from servegate.dashboard.series import KeyHistory, MetricSeries, latest_change_point, report_path
from servegate.errors import ConfigError
from servegate.plots import _figure, _svg  # the report's figure and SVG helpers: one look for both

__all__ = ["write_site", "key_slug", "Site"]

_STATUS_COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "inconclusive": "#9a6700"}
_CHANGE_COLOUR = "#bc4c00"

_CSS = """
*{box-sizing:border-box} body{font-family:system-ui,-apple-system,sans-serif;margin:0 auto;padding:.75rem;
max-width:72rem;color:#1f2328;line-height:1.4;overflow-wrap:anywhere}
h1{font-size:1.3rem} h2{font-size:1.1rem;margin:.2rem 0} h3{font-size:1rem;margin:.8rem 0 .2rem}
a{color:#0969da} code{font-size:.85em}
.verdict{display:inline-block;padding:.05rem .5rem;border-radius:1rem;color:#fff;font-weight:600;font-size:.85rem}
.key{border:1px solid #d0d7de;border-radius:.5rem;padding:.6rem;margin:.6rem 0}
.meta{color:#57606a;font-size:.85rem;margin:.2rem 0}
.metrics{display:grid;grid-template-columns:repeat(auto-fill,minmax(16rem,1fr));gap:.4rem .8rem;margin-top:.4rem}
.metric{min-width:0} .metric .name{font-size:.8rem;font-weight:600} .metric .value{font-size:.8rem;color:#57606a}
.change{color:#bc4c00;font-size:.8rem;font-weight:600}
figure{margin:.4rem 0;min-width:0} figure svg{width:100%;max-width:100%;height:auto;display:block}
figure.spark svg{max-height:4rem}
figcaption{font-weight:600;font-size:.9rem}
.scroll{overflow-x:auto;max-width:100%} table{border-collapse:collapse;font-size:.8rem}
td,th{border:1px solid #d0d7de;padding:.15rem .4rem;text-align:left;vertical-align:top} th{background:#f6f8fa}
"""


def key_slug(key: Any) -> str:
    """A file name for a key's page: readable, and unique (a hash of the whole key)."""
    text = str(key)
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80]
    return f"{readable}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _href(target: Path, page_dir: Path) -> str:
    """A relative link from a page in ``page_dir`` to ``target``, URL-quoted."""
    return quote(os.path.relpath(target, page_dir).replace(os.sep, "/"))


def _badge(status: str) -> str:
    return (f'<span class="verdict" data-status="{_e(status)}" style="background:'
            f'{_STATUS_COLOURS.get(status, "#57606a")}">{_e(status)}</span>')


def _number(value: float) -> str:
    return f"{value:.4g}"


def _mpl(text: Any) -> str:
    """Text for a matplotlib label: a ``$`` from the database would start mathtext (or fail to parse)."""
    return str(text).replace("$", r"\$")


def _change_text(series: MetricSeries, cp: Any) -> str:
    what = "step" if cp.kind == "step" else "trend began"
    tested = f"; segments x{cp.ratio:.3f} [{cp.ratio_low:.3f}, {cp.ratio_high:.3f}], Welch p={cp.p_value:.2g}"
    return f"{what} {cp.change:+.1%}" + (" (worse)" if series.worse(cp) else " (better)") + tested


def _page(title: str, body: Sequence[str]) -> str:
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>" + "\n".join(body) + "</body></html>")


@dataclass
class Site:
    """What :func:`write_site` wrote."""

    out: Path
    index: Path
    pages: dict[str, Path]
    change_points: int


class _Reports:
    """Where a run's report is linked from the site: its run folder (relative link), or a copy in
    ``<out>/reports/`` when the site must travel without the run folders."""

    def __init__(self, out: Path, copy: bool) -> None:
        self.out, self.copy, self.done = out, copy, {}

    def target(self, record: Any) -> Path | None:
        source = report_path(record)
        if source is None or not self.copy:
            return source
        if record.run_id not in self.done:
            dest = self.out / "reports" / f"{key_slug(record.run_id)}.html"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest)
            self.done[record.run_id] = dest
        return self.done[record.run_id]


# ---- plots ------------------------------------------------------------------------------
def _sparkline(series: MetricSeries, history: KeyHistory) -> str:
    fig = _figure(2.6, 0.55)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.08, top=0.92)
    ax = fig.subplots()
    x = np.arange(len(series.values))
    ax.plot(x, series.values, color="#57606a", linewidth=1)
    colour = _STATUS_COLOURS.get(history.run(series.run_ids[-1]).status, "#57606a")
    ax.scatter([x[-1]], [series.values[-1]], color=colour, s=12, zorder=3)
    for cp, run_id in series.change_point_runs():
        ax.axvline(cp.index - 0.5, color=_CHANGE_COLOUR, linewidth=1.2, gid=f"changepoint:{run_id}")
    ax.set_axis_off()
    return (f'<figure class="spark" data-plot="spark:{_e(series.label)}" role="img" '
            f'aria-label="{_e(series.label)} over {len(x)} runs">{_svg(fig)}</figure>')


def _trend(series: MetricSeries, history: KeyHistory, reports: _Reports, page_dir: Path) -> str:
    by_id = {r.run_id: r for r in history.runs}
    dates = [by_id[i].started_at for i in series.run_ids]
    values = np.asarray(series.values)
    fig = _figure(7.2, 3.0)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.22, top=0.95)
    ax = fig.subplots()
    ax.plot(dates, values, color="#8c959f", linewidth=1, zorder=2)
    # each run a point, coloured by its verdict, linking to its report
    urls = []
    for run_id in series.run_ids:
        target = reports.target(by_id[run_id])
        urls.append(_href(target, page_dir) if target is not None else None)
    points = ax.scatter(dates, values, c=[_STATUS_COLOURS.get(by_id[i].status, "#57606a") for i in series.run_ids],
                        s=18, zorder=4, gid=f"run:{series.label}")
    points.set_urls(urls)
    # the baseline: the runs a run now would be compared with, and the band the compare stage allows
    base = [(d, v) for d, v, i in zip(dates, values, series.run_ids) if i in history.baseline_run_ids]
    if base:
        ax.scatter([b[0] for b in base], [b[1] for b in base], s=70, facecolors="none", edgecolors="#2da44e",
                   linewidths=1.2, zorder=5, label=_mpl(f"baseline runs ({history.baseline_policy})"),
                   gid="baseline-runs")
        level = float(np.median([b[1] for b in base]))
        ax.axhspan(level * (1 - DEFAULT_BOUND), level * (1 + DEFAULT_BOUND), color="#2da44e", alpha=0.12,
                   label=f"baseline ±{DEFAULT_BOUND:.0%}", gid="baseline-band")
    recorded = [(d, *series.bands[i]) for d, i in zip(dates, series.run_ids) if i in series.bands]
    if recorded:
        ax.fill_between([r[0] for r in recorded], [r[2] for r in recorded], [r[3] for r in recorded], step="mid",
                        color="#0969da", alpha=0.12, label="compared with (recorded)", gid="recorded-band")
    for action in history.actions:
        if action["action"] == "pin" and action.get("run_id") in series.run_ids:
            k = series.run_ids.index(action["run_id"])
            ax.scatter([dates[k]], [values[k]], marker="*", s=160, color="#8250df", zorder=6,
                       label="pinned baseline", gid=f"pin:{action['run_id']}")
    changes = [a for a in history.actions if a["action"] == "distribution_change"]
    for n, action in enumerate(changes):
        ax.axvline(action["at"], color="#8250df", linestyle="--", linewidth=1,
                   label="distribution change" if n == 0 else None, gid=f"distribution-change:{n}")
    for n, (cp, run_id) in enumerate(series.change_point_runs()):
        ax.axvline(dates[cp.index], color=_CHANGE_COLOUR, linewidth=1.5, zorder=3,
                   label="change point" if n == 0 else None, gid=f"changepoint:{run_id}")
        ax.annotate(_change_text(series, cp), (dates[cp.index], 1.0), xycoords=("data", "axes fraction"),
                    xytext=(3, -10), textcoords="offset points", fontsize=7, color=_CHANGE_COLOUR)
    ax.set_ylabel(f"{series.metric.statistic} ({series.metric.unit})")
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize="x-small", loc="best")
    fig.autofmt_xdate()
    return (f'<figure class="trend" data-plot="trend:{_e(series.label)}"><figcaption>{_e(series.label)} '
            f'({_e(series.metric.unit)}, {_e(series.metric.direction.replace("_", " "))})</figcaption>'
            f'{_svg(fig)}</figure>')


# ---- pages --------------------------------------------------------------------------------
def _change_list(series: MetricSeries, history: KeyHistory) -> str:
    items = []
    for cp, run_id in series.change_point_runs():
        rec = history.run(run_id)
        items.append(f'<li class="changepoint" data-run="{_e(run_id)}" data-metric="{_e(series.label)}" '
                     f'data-index="{cp.index}" data-kind="{_e(cp.kind)}">{_e(_change_text(series, cp))} at run '
                     f'<code>{_e(run_id)}</code> ({rec.started_at:%Y-%m-%d %H:%M} UTC): '
                     f'{_e(_number(cp.before))} → {_e(_number(cp.after))} {_e(series.metric.unit)}</li>')
    return f'<ul class="changepoints">{"".join(items)}</ul>' if items else ""


def _latest_line(history: KeyHistory, reports: _Reports, page_dir: Path) -> str:
    latest = history.latest
    target = reports.target(latest)
    report = (f' · <a class="report" href="{_e(_href(target, page_dir))}">report</a>' if target is not None
              else ' · <span class="no-report">no report file</span>')
    return (f'<p class="meta">{_badge(latest.status)} {latest.started_at:%Y-%m-%d %H:%M} UTC · run '
            f'<code>{_e(latest.run_id)}</code>{report} · {len(history.runs)} run(s)</p>')


def _index_card(history: KeyHistory, page: Path, reports: _Reports, out: Path) -> str:
    parts = [f'<section class="key" data-key="{_e(history.key)}"><h2><a href="{_e(_href(page, out))}">'
             f'{_e(history.key)}</a></h2>', _latest_line(history, reports, out)]
    latest_cp = latest_change_point(history)
    if latest_cp is not None:
        parts.append(f'<p class="change" data-run="{_e(latest_cp["run_id"])}">latest change point: '
                     f'{_e(latest_cp["metric"])}{_e(" [" + latest_cp["case"] + "]" if latest_cp["case"] else "")} '
                     f'{_e(latest_cp["kind"])} {latest_cp["change"]:+.1%} at run <code>{_e(latest_cp["run_id"])}'
                     f'</code></p>')
    parts.append('<div class="metrics">')
    for s in history.series:
        marks = "".join(f'<div class="change" data-run="{_e(run_id)}">{_e(_change_text(s, cp))} at '
                        f'{history.run(run_id).started_at:%Y-%m-%d}</div>' for cp, run_id in s.change_point_runs())
        parts.append(f'<div class="metric" data-metric="{_e(s.label)}"><div class="name">{_e(s.label)}</div>'
                     f'<div class="value">latest {_e(_number(s.values[-1]))} {_e(s.metric.unit)}</div>'
                     f'{_sparkline(s, history)}{marks}</div>')
    if not history.series:
        parts.append("<p class='meta'>No gated metric recorded in these runs.</p>")
    parts.append("</div></section>")
    return "".join(parts)


def _key_page(history: KeyHistory, reports: _Reports, page_dir: Path, generated: str) -> str:
    body = [f'<p><a href="../index.html">← all gates</a></p><h1>{_e(history.key)}</h1>',
            _latest_line(history, reports, page_dir),
            f'<p class="meta">Baseline: {_e(history.baseline_policy)}: '
            f'{_e(", ".join(history.baseline_run_ids) or "none")}'
            + (f" ({_e(history.baseline_reason)})" if history.baseline_reason else "") + "</p>"]
    latest_cp = latest_change_point(history)
    if latest_cp is not None:
        body.append(f'<p class="change" data-run="{_e(latest_cp["run_id"])}">Latest change point after the '
                    f'baseline: {_e(latest_cp["metric"])} {_e(latest_cp["kind"])} {latest_cp["change"]:+.1%} at run '
                    f'<code>{_e(latest_cp["run_id"])}</code></p>')
    for s in history.series:
        body.append(_trend(s, history, reports, page_dir))
        body.append(_change_list(s, history))
    if not history.series:
        body.append("<p>No gated metric recorded in these runs.</p>")
    if history.actions:
        rows = "".join(f"<tr><td>{a['at']:%Y-%m-%d %H:%M}</td><td>{_e(a['action'])}</td>"
                       f"<td>{_e(a.get('run_id') or '')}</td><td>{_e(a['actor'])}</td><td>{_e(a['reason'])}</td></tr>"
                       for a in history.actions)
        body.append("<h3>Baseline actions</h3><div class='scroll'><table><tr><th>at (UTC)</th><th>action</th>"
                    f"<th>run</th><th>by</th><th>reason</th></tr>{rows}</table></div>")
    runs = []
    for r in reversed(history.runs):
        target = reports.target(r)
        link = f'<a href="{_e(_href(target, page_dir))}">report</a>' if target is not None else ""
        runs.append(f"<tr><td>{r.started_at:%Y-%m-%d %H:%M}</td><td>{_badge(r.status)}</td>"
                    f"<td><code>{_e(r.run_id)}</code></td><td>{link}</td></tr>")
    body.append("<h3>Runs</h3><div class='scroll'><table><tr><th>started (UTC)</th><th>verdict</th><th>run</th>"
                f"<th></th></tr>{''.join(runs)}</table></div>")
    body.append(f"<p class='meta'>Generated by servegate on {_e(generated)}.</p>")
    return _page(f"servegate {history.key}", body)


def write_site(histories: Sequence[KeyHistory], out: str | os.PathLike[str], *, source: str = "",
               copy_reports: bool = False) -> Site:
    """Write ``index.html`` and ``keys/<slug>.html`` for each key's history into ``out``."""
    out = Path(out)
    try:
        (out / "keys").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the dashboard folder {out}: {exc}; pass --out to a writable folder") from exc
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    reports = _Reports(out, copy_reports)
    pages: dict[str, Path] = {}
    cards = []
    try:
        for history in histories:
            page = out / "keys" / f"{key_slug(history.key)}.html"
            page.write_text(_key_page(history, reports, page.parent, generated), encoding="utf-8")
            pages[str(history.key)] = page
            cards.append(_index_card(history, page, reports, out))
        body = ["<h1>servegate: gates</h1>",
                f"<p class='meta'>{len(histories)} gate key(s) from {_e(source)} · generated {_e(generated)} · "
                "orange lines are change points</p>", *cards]
        if not histories:
            body.append("<p>No gate runs recorded (run <code>servegate run</code>, which records to the history "
                        "database).</p>")
        index = out / "index.html"
        index.write_text(_page("servegate dashboard", body), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the dashboard into {out}: {exc}; pass --out to a writable folder") from exc
    return Site(out=out, index=index, pages=pages,
                change_points=sum(len(s.change_points) for h in histories for s in h.series))
