"""What a release manager and a CI page read: the HTML report, a JUnit file, a markdown summary.

- :func:`write_report` — one self-contained HTML file per run (no scripts, no external files;
  plots are inline SVG drawn with matplotlib's object API, no pyplot global state): the verdict,
  the breaches and the comparison with the baseline (rows grouped under one heading per stage,
  :data:`servegate.tables.TABLE_STAGE`; a note several rows share said once above the tables, the
  rows pointing at it), the worker's start-up time, memory high-water mark and cost per million
  output tokens (the report-only metrics; cost only with ``[cost] price_per_hour``), one-batch
  latency vs batch size, serving TTFT/ITL CDFs against the baseline, occupancy over time (and,
  for a run that speculated, its accept length over time beside the serving ITLs), each compared
  metric's nightly trend (the report-only ones too) with its baseline band (baseline value x [1 - bound, 1 + bound]), and, when the run has a
  ``paired`` table, the paired comparison: per metric ratio, interval and decision, per gated
  metric the per-round ratios and the interval narrowing round by round, the provenance of
  both workers and, after a confirmed regression (``paired.profile``), the operators whose time
  changed most between the two profiler traces, with the traces' paths. The plots are
  :mod:`servegate.plots`.
- :func:`write_junit` — one ``<testcase>`` per expectation; breaches are ``<failure>``,
  expectations that could not be evaluated are ``<skipped>``, infra errors are ``<error>``.
- :func:`write_markdown_summary` — the verdict line (status, exit code, key), a key-metric table
  (:func:`servegate.render.metric_rows`, the terminal's rows), breaches, infrastructure problems,
  undecided metrics, the report-only comparisons, gated paired metrics, then links, as markdown
  (for a CI job summary or a Prefect markdown artifact).

The report reads at phone width (390 px) as on a wide screen: the page never scrolls sideways,
a wide table scrolls inside its own box, plots shrink to the window.
"""

from __future__ import annotations

import html
import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from servegate.baseline import BaselinePolicy
from servegate.compare import compare_run
from servegate.config import CompareConfig
from servegate.errors import ConfigError
from servegate.gated_metrics import GATED_METRICS, GatedMetric
from servegate.hostcheck import environment_differences
from servegate.history import RunRecord, Store
from servegate.plots import (cdf_plot, occupancy_plot, one_batch_plot, paired_interval_plot, paired_ratio_plot,
                             speculated, speculation_plot, trend_plot)
from servegate.render import (UNDECIDED_HEADING, calibration_text, gated_paired_rows, interval_text, markdown_cell, markdown_code,
                              markdown_text, metric_rows, paired_text, percent_text, ratio_number_text)
from servegate.tables import TABLE_STAGE
from servegate.verdict import undecided_kind

__all__ = [
    "PLOT_NAMES",
    "render_report",
    "build_report",
    "write_report",
    "write_junit",
    "write_markdown_summary",
    "failing_rows",
]

PLOT_NAMES = ("one_batch_latency", "serving_ttft_cdf", "serving_itl_cdf", "occupancy_over_time")
"""Fixed plots of every report; trend plots are named ``trend:<metric>`` (one per compared metric),
paired plots ``paired_ratio:<metric>`` and ``paired_interval:<metric>`` (one each per gated metric
of the ``paired`` table)."""

_TREND_RUNS = 30
PROFILE_OPS_SHOWN = 15
"""Rows of ``profile_ops`` the report shows: the largest slow-downs (the table keeps every operator)."""
_STATUS_COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "inconclusive": "#9a6700"}


def _as_dict(obj: Any) -> dict[str, Any]:
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else dict(obj)


# ---- tables -------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        return f"{value:.{digits}g}"
    return str(value)


def _html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], css: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        body.append("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>")
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def failing_rows(comparison: pd.DataFrame | None) -> pd.DataFrame:
    """Comparison rows that regressed."""
    if comparison is None or comparison.empty:
        return pd.DataFrame()
    return comparison[comparison["decision"] == "regression"]



_STAGE_ORDER = ("launch", "one_batch", "serving", "occupancy", "quality", "capacity", "paired", "comparison")
"""The order of the report's stage groups (stage names of :data:`servegate.tables.TABLE_STAGE`;
``comparison`` holds rows of no known table, e.g. the relative check on the comparison itself)."""


def _stage_of(table: Any) -> str:
    stage = TABLE_STAGE.get(str(table), "comparison")
    return "comparison" if stage == "compare" else stage


def _by_stage(rows: Iterable[Any], table_of) -> list[tuple[str, list[Any]]]:
    """``rows`` grouped by the stage of their table, in pipeline order (row order kept inside)."""
    groups: dict[str, list[Any]] = {}
    for row in rows:
        groups.setdefault(_stage_of(table_of(row)), []).append(row)
    order = {stage: i for i, stage in enumerate(_STAGE_ORDER)}
    return sorted(groups.items(), key=lambda item: order.get(item[0], len(order)))


def _stage_heading(section: str, stage: str) -> str:
    return f'<h3 class="stage" id="{section}-{html.escape(stage)}">{html.escape(stage)}</h3>'


def _wrap(table: str) -> str:
    # A wide table scrolls inside its own box on a phone; the page itself never scrolls sideways.
    return f'<div class="scroll">{table}</div>'


def _shared_notes(notes: Sequence[str], label: str = "Note") -> tuple[list[str], dict[str, int]]:
    """Notes that more than one row carries, numbered once: (paragraphs, note -> number)."""
    counts: dict[str, int] = {}
    for note in notes:
        if note:
            counts[note] = counts.get(note, 0) + 1
    numbers = {note: i + 1 for i, note in enumerate(n for n, c in counts.items() if c > 1)}
    anchor = label.lower().replace(" ", "-")
    paragraphs = [f'<p class="note" id="{anchor}-{i}">{label} {i} ({counts[note]} rows): {html.escape(note)}</p>'
                  for note, i in numbers.items()]
    return paragraphs, numbers


def _comparison_table(comparison: pd.DataFrame | None) -> str:
    if comparison is None or comparison.empty:
        return "<p>No comparison with a baseline.</p>"
    calibrated = "min_detectable" in comparison.columns and comparison["min_detectable"].notna().any()
    headers = ["metric", "case", "unit", "baseline", "current", "ratio", "CI", "n base", "n cur", "bound"]
    if calibrated:
        headers += ["min detectable", "false alarms ≤"]
    records = list(comparison.itertuples(index=False))
    # A note such as "1 sample(s) in this run, 3 needed" applies to many rows: said once, above
    # the tables, and the rows point at it.
    paragraphs, numbers = _shared_notes([r.reason if isinstance(r.reason, str) else "" for r in records])
    parts = list(paragraphs)
    for stage, group in _by_stage(records, lambda r: r.table):
        rows = []
        for r in group:
            row = [r.metric, r.case, r.unit, r.baseline_value, r.current_value, r.ratio,
                   f"[{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]", r.n_baseline, r.n_current, f"{r.bound:.0%}"]
            if calibrated:
                row += [percent_text(getattr(r, "min_detectable", math.nan)),
                        percent_text(getattr(r, "false_alarm_upper95", math.nan))]
            reason = r.reason if isinstance(r.reason, str) else ""  # NaN from the store
            rows.append(row + [r.decision, f"see note {numbers[reason]}" if reason in numbers else reason])
        parts.append(_stage_heading("comparison", stage))
        parts.append(_wrap(_mark_decisions(_html_table([*headers, "decision", "note"], rows, "comparison"))))
    return "\n".join(parts)


def _mark_decisions(table: str) -> str:
    # Colour regressions without scripts: mark their decision cells (a suspicious one: not yet called).
    for decision, css in (("regression", "bad"), ("suspicious", "warn"), ("improvement", "good")):
        table = table.replace(f"<td>{decision}</td>", f'<td class="{css}">{decision}</td>')
    return table


def _first(tables: Mapping[str, pd.DataFrame], table: str, column: str) -> Any:
    df = tables.get(table)
    if df is None or df.empty or column not in df.columns:
        return None
    value = df[column].iloc[0]
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _cost_section(tables: Mapping[str, pd.DataFrame]) -> str:
    """What the run's worker cost: start-up time, memory high-water mark, cost per million output
    tokens (only with a configured price: an unset price shows no cost, never 0). Report-only: these
    are compared and trended like the gated metrics but never decide the verdict."""
    items: list[tuple[str, str]] = []
    startup = _first(tables, "worker", "startup_s")
    if startup is not None:
        items.append(("start-up (launch to ready)", f"{startup:.1f} s"))
    ready, peak = _first(tables, "worker", "ready_rss_mib"), _first(tables, "worker", "peak_rss_mib")
    if peak is not None:
        through = _first(tables, "worker", "peak_through")
        items.append(("memory high-water mark (RSS of the worker's process tree)",
                      f"{peak:.0f} MiB through {through}" + (f" ({ready:.0f} MiB when ready)" if ready else "")))
    cost = _first(tables, "cost", "cost_per_mtok_output")
    if cost is not None:
        currency = _first(tables, "cost", "currency") or ""
        items.append(("cost per million output tokens",
                      f"{cost:.4g} {currency} at {_first(tables, 'cost', 'price_per_hour'):g} {currency}/h and "
                      f"{_first(tables, 'cost', 'output_throughput'):.4g} tok/s (the serving load)"))
    if not items:
        return ""
    return ('<dl id="worker-cost">' + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in items)
            + "</dl>")


def _text_or(value: Any, missing: str) -> str:
    return value if isinstance(value, str) and value and value != "null" else missing  # NaN/None from the store


def _paired_section(tables: Mapping[str, pd.DataFrame]) -> list[str]:
    """The paired comparison (candidate / baseline measured side by side in rounds): the summary
    per metric, per gated metric the per-round ratios and the narrowing interval, the workers."""
    paired = tables.get("paired")
    if paired is None or paired.empty:
        return []
    rounds, workers = tables.get("paired_rounds"), tables.get("paired_workers")
    first = paired.iloc[0]
    parts = ['<h2 id="paired">Paired comparison (candidate / baseline)</h2>',
             f'<p id="paired-method">Both workers measured side by side in {first["rounds"]} round(s), '
             f'{html.escape(_text_or(first["mode"], "?"))}, {html.escape(_text_or(first["order"], "?"))} order, '
             f'restarted every {first["rounds_per_worker"]} rounds ({first["instances"]} instance(s) of each), '
             f'{html.escape(_fmt(first["measure_s"], 4))} s of measurement; '
             f'{html.escape(_text_or(first["method"], "interval"))} at {percent_text(first["confidence"])}. '
             f'Stopped: {html.escape(_text_or(first["stopped_because"], "not recorded"))}.</p>']
    rows = []
    records = list(paired.itertuples(index=False))
    notes, numbers = _shared_notes([_text_or(r.reason, "") for r in records], "Paired note")
    parts += notes
    for r in records:
        decision = r.decision if r.decision != "report_only" else f"report only ({r.paired_decision})"
        reason = _text_or(r.reason, "")
        rows.append([r.metric, r.unit, _text_or(r.direction, "").replace("_", " "), _fmt(r.baseline_median, 4),
                     _fmt(r.candidate_median, 4), ratio_number_text(r.ratio), interval_text(r.ci_low, r.ci_high),
                     percent_text(r.bound), decision, r.rounds,
                     f"see paired note {numbers[reason]}" if reason in numbers else reason])
    parts.append(_wrap(_mark_decisions(_html_table(
        ["metric", "unit", "direction", "baseline (median)", "candidate (median)", "ratio", "interval", "bound",
         "decision", "rounds", "note"], rows, "paired"))))
    for row in gated_paired_rows(paired.to_dict("records")):
        parts.append(paired_ratio_plot(row, rounds))
        parts.append(paired_interval_plot(row, rounds))
    parts += _profile_section(tables)
    if workers is not None and not workers.empty:
        parts.append("<h3>Paired workers</h3>")
        parts.append(_wrap(_html_table(
            ["side", "instance", "engine", "model", "python", "extra args", "CPUs", "pid", "launch (s)",
             "warm-up (s)"],
            [[w.side, w.instance, w.engine, w.model, _text_or(w.python, "default"), w.extra_args,
              _text_or(w.cpus, "not pinned"), w.pid, w.launch_s, w.warmup_s]
             for w in workers.itertuples(index=False)], "paired-workers")))
    return parts


def _profile_section(tables: Mapping[str, pd.DataFrame]) -> list[str]:
    """After a confirmed regression: where each side's profiler trace is (or why there is none) and
    the ``PROFILE_OPS_SHOWN`` operators whose self time grew most, candidate against baseline."""
    profiles = tables.get("paired_profiles")
    if profiles is None or profiles.empty:
        return []
    parts = ['<h3 id="profile-ops">Operators whose time changed most</h3>']
    items = []
    for r in profiles.itertuples(index=False):
        if r.status == "recorded":
            try:
                files = json.loads(r.traces) if isinstance(r.traces, str) else []
            except ValueError:
                files = []
            shown = ", ".join(f"<code>{html.escape(str(f))}</code>" for f in files) or "–"
            items.append(f"<li>{html.escape(str(r.side))} ({html.escape(str(r.engine))}): {shown}</li>")
        else:
            items.append(f"<li>{html.escape(str(r.side))} ({html.escape(str(r.engine))}): no trace, "
                         f"{html.escape(str(r.status).replace('_', ' '))}: {html.escape(_text_or(r.reason, ''))}</li>")
    parts.append(f'<p>Profiler traces (in the run folder):</p><ul id="profile-traces">{"".join(items)}</ul>')
    ops = tables.get("profile_ops")
    if ops is None or ops.empty:
        parts.append('<p class="empty">No operator comparison: both traces are needed.</p>')
        return parts
    requests = _first(tables, "paired_profiles", "requests")
    parts.append(f'<p class="note">Self time of each operator (its time less that of the operators it calls) over '
                 f'the same block of {requests or "?"} requests on each side; the {min(PROFILE_OPS_SHOWN, len(ops))} '
                 f'largest increases of {len(ops)} operators, largest first. A: baseline, B: candidate.</p>')
    rows = [[r.op, r.calls_a, r.calls_b, _fmt(r.self_ms_a, 4), _fmt(r.self_ms_b, 4), _fmt(r.delta_ms, 4),
             "only in B" if r.ratio == math.inf else ratio_number_text(r.ratio)]
            for r in ops.head(PROFILE_OPS_SHOWN).itertuples(index=False)]
    parts.append(_wrap(_html_table(["operator", "calls A", "calls B", "self ms A", "self ms B", "Δ ms", "ratio B/A"],
                                   rows, "profile-ops")))
    return parts


_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1rem auto;padding:0 1rem;max-width:84rem;
color:#1f2328;overflow-wrap:anywhere}
h1{font-size:1.5rem} h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #d0d7de}
h3.stage{font-size:1rem;margin:1rem 0 .2rem;text-transform:none;color:#57606a}
.verdict{display:inline-block;padding:.2rem .8rem;border-radius:1rem;color:#fff;font-weight:600}
div.scroll{max-width:100%;overflow-x:auto}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0;overflow-wrap:normal}
td,th{border:1px solid #d0d7de;padding:.2rem .5rem}
th{background:#f6f8fa} td.bad{color:#cf222e;font-weight:600} td.good{color:#1a7f37} td.warn{color:#9a6700;font-weight:600}
p.note{font-size:.85rem;color:#57606a;margin:.2rem 0}
figure.plot{display:inline-block;margin:.5rem;vertical-align:top;max-width:100%}
figure svg,img{max-width:100%;height:auto}
figcaption{font-weight:600;font-size:.9rem} p.empty{color:#57606a;font-style:italic}
dl{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:.1rem 1rem} dt{font-weight:600} dd{margin:0}
@media (max-width:40rem){body{padding:0 .5rem} figure.plot{margin:.5rem 0}
dl{grid-template-columns:minmax(0,1fr)} dd{margin-left:1rem}}
"""


def render_report(*, run_id: str, key: str, verdict: Mapping[str, Any], tables: Mapping[str, pd.DataFrame],
                  comparison: pd.DataFrame | None = None, baseline: Mapping[str, Any] | None = None,
                  baseline_tables: Sequence[Mapping[str, pd.DataFrame]] = (),
                  history: Sequence[tuple[RunRecord, dict[str, Any]]] = (),
                  provenance: Mapping[str, Any] | None = None, attempts: Sequence[RunRecord] = (),
                  metrics: Sequence[GatedMetric] = GATED_METRICS) -> str:
    """The report as one HTML string, from data already in memory (no store needed)."""
    status = str(verdict.get("status", "unknown"))
    colour = _STATUS_COLOURS.get(status, "#57606a")
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
             f"<title>servegate {html.escape(run_id)}</title><style>{_CSS}</style></head><body>",
             f"<h1>servegate report — {html.escape(key)}</h1>",
             f'<p>Run <code>{html.escape(run_id)}</code>: <span class="verdict" id="verdict" '
             f'style="background:{colour}">{html.escape(status)}</span></p>']
    info = dict(provenance or {})
    if baseline:
        info["baseline"] = f"{baseline.get('policy')}: {', '.join(baseline.get('run_ids') or []) or 'none'}"
        if baseline.get("reason"):
            info["baseline note"] = baseline["reason"]
    if attempts:
        info["attempts"] = ", ".join(f"#{a.attempt} {a.run_id} ({a.status})" for a in attempts)
    if info:
        parts.append("<dl>" + "".join(f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(_fmt(v))}</dd>"
                                      for k, v in info.items()) + "</dl>")

    parts.append("<h2>Breaches</h2>")
    breaches = verdict.get("breaches") or []
    if breaches:
        for stage, group in _by_stage(breaches, lambda b: b.get("table")):
            parts.append(_stage_heading("breaches", stage))
            parts.append(_wrap(_html_table(
                ["table", "expectation", "column", "observed", "allowed", "source"],
                [[b.get("table"), b.get("expectation"), b.get("column"), b.get("observed"), b.get("allowed"),
                  b.get("source")] for b in group], "breaches")))
    else:
        parts.append("<p>No expectation was breached.</p>")
    infra = verdict.get("infra_errors") or []
    if infra:
        parts.append("<h2>Infrastructure errors</h2><ul>" + "".join(f"<li>{html.escape(str(e))}</li>" for e in infra)
                     + "</ul>")
    undecided = verdict.get("undecided") or []
    if undecided:
        parts.append(f"<h2>{html.escape(UNDECIDED_HEADING)}</h2><ul>"
                     + "".join(f"<li>{html.escape(str(e))}</li>" for e in undecided) + "</ul>")

    paired = tables.get("paired")
    # A paired-only gate compares with its baseline worker, not with the history: no empty
    # history section (and no "never calibrated" note about checks it does not run).
    if (comparison is not None and not comparison.empty) or paired is None or paired.empty:
        parts.append("<h2>Comparison with the baseline</h2>")
        trust = calibration_text(verdict.get("calibration"))
        parts.append(f'<p id="calibration">{html.escape(trust)}</p>' if trust else
                     '<p id="calibration">This gate key was never calibrated: how often its relative checks '
                     'false-alarm is unknown (run <code>servegate calibrate</code>).</p>')
        parts.append(_comparison_table(comparison))
    parts += _paired_section(tables)

    by_metric = {m.metric: m for m in metrics}
    serving_median = {m.column: m for m in metrics if m.table == "serving_requests" and m.statistic == "median"}
    parts.append("<h2>This run</h2>")
    parts.append(_cost_section(tables))
    parts.append(one_batch_plot(tables.get("one_batch")))
    for column, name, title in (("ttft_ms", "serving_ttft_cdf", "Serving: TTFT distribution (CDF)"),
                                ("itls_ms", "serving_itl_cdf", "Serving: inter-token latency distribution (CDF)")):
        metric = serving_median.get(column) or GatedMetric(column, "serving_requests", column, "ms", "lower_is_better",
                                                           list_column=column == "itls_ms")
        parts.append(cdf_plot(name, title, metric, tables, baseline_tables))
    parts.append(occupancy_plot(tables.get("occupancy_samples")))
    if speculated(tables):  # speculation's effect next to latency, only for a run that speculated
        parts.append(speculation_plot(tables))

    parts.append("<h2>Nightly trends</h2>")
    trend_rows = [] if comparison is None else [
        r for r in comparison.to_dict("records") if r["statistic"] == "median" and r["metric"] in by_metric]
    if not trend_rows:
        parts.append("<p>No gated metric to trend.</p>")
    baseline_ids = set((baseline or {}).get("run_ids") or [])
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in trend_rows:
        grouped.setdefault(row["metric"], []).append(row)
    for metric_name, rows in grouped.items():
        parts.append(trend_plot(rows, by_metric[metric_name], history, run_id, baseline_ids))
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts.append(f"<p><small>Generated by servegate on {generated}.</small></p></body></html>")
    return "\n".join(parts)


def build_report(store: Store, run_id: str, *, policy: BaselinePolicy | None = None,
                 trend_runs: int = _TREND_RUNS) -> str:
    """The HTML report of a recorded run: its comparison is the recorded ``comparison`` table
    when the flow stored one, else computed now under the run's own ``compare`` settings (bounds,
    history rule, and its baseline policy unless ``policy`` is given)."""
    record = store.get_run(run_id)
    tables = store.tables(run_id)
    comparison = tables.pop("comparison", None)
    if comparison is None or comparison.empty:
        recorded = (record.config or {}).get("compare") or {}
        # The fields this version knows (a run recorded by an older one may hold others); the rest default.
        cfg = CompareConfig.model_validate({k: v for k, v in recorded.items() if k in CompareConfig.model_fields})
        comparison = compare_run(store, run_id, policy=policy or BaselinePolicy.of(cfg), bound=cfg.bound,
                                 tail_bound=cfg.tail_bound, consecutive=cfg.consecutive)
        baseline = dict(comparison.attrs.get("baseline", {}))
    else:
        # The comparison the verdict was built on, against the baseline of that moment.
        first = comparison.iloc[0]
        baseline = {"policy": first["baseline_policy"],
                    "run_ids": [x for x in str(first["baseline_runs"] or "").split(",") if x and x != "nan"]}
    needed = {m.table for m in GATED_METRICS}
    baseline_tables = [store.tables(rid, needed) for rid in baseline.get("run_ids") or []]
    history = []
    for rec in reversed(store.runs(record.key, include_attempts=False)[:trend_runs]):
        if rec.started_at <= record.started_at or rec.root_id == record.root_id:
            history.append((rec, store.tables(rec.run_id, needed)))
    if not any(rec.run_id == record.run_id for rec, _ in history):
        history.append((record, {k: v for k, v in tables.items() if k in needed}))
    manifest = record.manifest
    differs = environment_differences(manifest.get("environment"), [
        (rid, store.get_run(rid).manifest.get("environment")) for rid in baseline.get("run_ids") or []])
    provenance = {"gate key": str(record.key), "started": record.started_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
                  "branch": record.branch, "git revision": record.git_revision,
                  "servegate": manifest.get("servegate_version"), "seeds": manifest.get("seeds"),
                  "host": (manifest.get("host") or {}).get("hostname"), "run folder": record.run_dir,
                  "environment differs": "; ".join(differs)}
    provenance = {k: v for k, v in provenance.items() if v}
    return render_report(run_id=record.run_id, key=str(record.key), verdict=record.verdict, tables=tables,
                         comparison=comparison, baseline=baseline, baseline_tables=baseline_tables, history=history,
                         provenance=provenance, attempts=store.attempts(run_id))


def write_report(store: Store, run_id: str, out: str | Path | None = None, *,
                 policy: BaselinePolicy | None = None) -> Path:
    """Write the HTML report; default path ``<run folder>/report.html`` (or ``./report-<run>.html``)."""
    text = build_report(store, run_id, policy=policy)
    if out is None:
        run_dir = store.get_run(run_id).run_dir
        out = Path(run_dir) / "report.html" if run_dir and Path(run_dir).is_dir() else Path(f"report-{run_id}.html")
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {out}: {exc}; pass --out to a writable path") from exc
    return out


# ---- CI outputs ---------------------------------------------------------------------------
def _case_name(o: Mapping[str, Any]) -> str:
    kwargs = o.get("kwargs") or {}
    extra = ""
    if "value_set" in kwargs:
        extra = f" in {kwargs['value_set']}"
    elif "min_value" in kwargs or "max_value" in kwargs:
        extra = f" {o.get('allowed', '')}"
    column = f"({o['column']})" if o.get("column") else ""
    return f"{o.get('expectation_type')}{column}{extra}".strip()


def write_junit(verdict: Mapping[str, Any] | Any, outcomes: Iterable[Mapping[str, Any] | Any],
                path: str | Path) -> Path:
    """A JUnit XML file: one ``<testcase>`` per expectation (class = table), ``<failure>`` for a
    breach, ``<skipped>`` for one that could not be evaluated, plus one ``<error>`` test case per
    infrastructure error (the run could not decide)."""
    verdict_d = _as_dict(verdict)
    outs = [_as_dict(o) for o in outcomes]
    infra = [str(e) for e in verdict_d.get("infra_errors") or []]
    undecided = [str(e) for e in verdict_d.get("undecided") or []]
    suite = ET.Element("testsuite", name="servegate", tests=str(len(outs) + len(infra) + len(undecided)),
                       failures=str(sum(o.get("success") is False for o in outs)),
                       errors=str(len(infra) + len(undecided)),
                       skipped=str(sum(o.get("success") is None for o in outs)))
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="verdict", value=str(verdict_d.get("status")))
    for o in outs:
        case = ET.SubElement(suite, "testcase", classname=f"servegate.{o.get('table')}", name=_case_name(o))
        if o.get("success") is False:
            source = (o.get("meta") or {}).get("source")
            message = f"observed {o.get('observed')!r}, allowed {o.get('allowed')}"
            failure = ET.SubElement(case, "failure", message=message, type="regression")
            failure.text = f"{message}\nsource: {source}"
        elif o.get("success") is None:
            ET.SubElement(case, "skipped", message=str(o.get("reason") or "not evaluated"))
    for i, err in enumerate(infra):
        case = ET.SubElement(suite, "testcase", classname="servegate.infra", name=f"infra_error_{i + 1}")
        error = ET.SubElement(case, "error", message=err.splitlines()[0] if err else "infra error", type="infra")
        error.text = err
    counted: dict[str, int] = {}
    for err in undecided:
        # Could not decide, like an infra error: an <error> (the pipeline's "broken", not "regressed"),
        # of type "undecided" or, for the history rule's not-yet-called regression, "suspicious".
        kind = undecided_kind(err)
        counted[kind] = counted.get(kind, 0) + 1
        case = ET.SubElement(suite, "testcase", classname=f"servegate.{kind}", name=f"{kind}_{counted[kind]}")
        error = ET.SubElement(case, "error", message=err.splitlines()[0], type=kind)
        error.text = err
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
    return path


def _md_escape(value: Any) -> str:
    """A table cell of the summary: verdict and comparison text come from servers and the
    history database (a server's error body, a model name): HTML, pipes and backticks neutralised."""
    return markdown_cell(_fmt(value))


def _md_link_target(path: str | Path) -> str:
    """A link destination inside ``<...>``: spaces and parentheses allowed, ``<``, ``>`` and line
    breaks (which would end it) percent-encoded."""
    return str(path).replace("<", "%3C").replace(">", "%3E").replace("\n", "%0A").replace("\r", "%0D")


_EXIT_CODES = {"pass": 0, "fail": 1, "inconclusive": 2}


def write_markdown_summary(verdict: Mapping[str, Any] | Any, outcomes: Iterable[Mapping[str, Any] | Any] = (),
                           comparison: pd.DataFrame | None = None, *, paired: pd.DataFrame | None = None,
                           run_id: str | None = None, key: str | None = None,
                           report_path: str | Path | None = None, path: str | Path | None = None) -> str:
    """The run's summary as markdown, for a CI job summary or a Prefect markdown artifact: the
    verdict line (status, exit code, gate key), the key metrics (:func:`servegate.render.metric_rows`:
    each threshold check with its value, each gated comparison with value vs baseline, ratio,
    interval and bound, and its decision), the breaches, infrastructure problems, undecided
    metrics, the baseline's other (report-only) comparisons, one line per gated metric of the
    ``paired`` table, then the links. Written to ``path`` when given, always returned."""
    verdict_d = _as_dict(verdict)
    outs = [_as_dict(o) for o in outcomes]
    raw_status = str(verdict_d.get("status", "unknown"))
    exit_code = verdict_d.get("exit_code", _EXIT_CODES.get(raw_status))
    lines = [f"## servegate: **{markdown_text(raw_status)}**"
             + (f" (exit {markdown_text(exit_code)})" if exit_code is not None else "")
             + (f" — {markdown_code(key)}" if key else "")]
    if run_id:
        lines.append(f"Run {markdown_code(run_id)}")
    evaluated = [o for o in outs if o.get("success") is not None]
    lines.append(f"\n{sum(o.get('success') is True for o in outs)}/{len(evaluated)} expectations met, "
                 f"{sum(o.get('success') is None for o in outs)} not evaluated.")
    records = [] if comparison is None or comparison.empty else comparison.to_dict("records")
    metrics = metric_rows(outs, records)
    if metrics:
        lines += ["\n### Key metrics", "| | metric | value | allowed / ratio [interval] | check |",
                  "|---|---|---:|---|---|"]
        for mark, *cells in metrics:
            bold = "**" if mark in ("FAIL", "UNDECIDED") else ""
            lines.append(f"| {bold}{markdown_cell(mark)}{bold} | " + " | ".join(markdown_cell(c) for c in cells) + " |")
    breaches = verdict_d.get("breaches") or []
    if breaches:
        lines += ["\n### Breaches", "| table | expectation | column | observed | allowed | source |",
                  "|---|---|---|---|---|---|"]
        fields = ("table", "expectation", "column", "observed", "allowed", "source")
        lines += ["| " + " | ".join(_md_escape(b.get(f)) for f in fields) + " |" for b in breaches]
    infra = verdict_d.get("infra_errors") or []
    if infra:
        lines += ["\n### Infrastructure errors (could not decide)"] + [f"- {markdown_text(e)}" for e in infra]
    undecided = verdict_d.get("undecided") or []
    if undecided:
        lines += [f"\n### {UNDECIDED_HEADING}"] + [f"- {markdown_text(e)}" for e in undecided]
    trust = calibration_text(verdict_d.get("calibration"))
    if trust:
        lines.append(f"\n**Trust:** {markdown_text(trust)}")
    if records:
        policy = markdown_text(_fmt(records[0].get("baseline_policy")))
        # Gated rows are in the key metrics already; the rest (report only) once here, a note shared
        # by several rows said once above the table.
        others = [r for r in records if r.get("gated") != True]  # noqa: E712 - numpy's True_ is not True
        lines += ["\n### Comparison with the baseline", f"Baseline: {policy}"]
        lines += [f"\nEnvironment: {markdown_text(n)}" for n in comparison.attrs.get("environment") or []]
        if others:
            notes = [r.get("reason") if isinstance(r.get("reason"), str) else "" for r in others]
            counts = {n: notes.count(n) for n in notes if n}
            numbers = {n: i + 1 for i, n in enumerate(n for n, c in counts.items() if c > 1)}
            lines += [f"\nNote {i} ({counts[n]} rows): {markdown_text(n)}" for n, i in numbers.items()]
            lines += ["\nReported, not gated:\n",
                      "| metric | case | baseline | current | ratio | CI | decision | note |",
                      "|---|---|---:|---:|---:|---|---|---|"]
            for r, note in zip(others, notes):
                ci = f"[{_md_escape(r.get('ci_low'))}, {_md_escape(r.get('ci_high'))}]"
                shown = f"note {numbers[note]}" if note in numbers else note
                lines.append(f"| {_md_escape(r.get('metric'))} | {_md_escape(r.get('case'))} | "
                             f"{_md_escape(r.get('baseline_value'))} | {_md_escape(r.get('current_value'))} | "
                             f"{_md_escape(r.get('ratio'))} | {ci} | {_md_escape(r.get('decision'))} | "
                             f"{_md_escape(shown)} |")
    gated = [] if paired is None else gated_paired_rows(paired.to_dict("records"))
    if gated:
        lines.append("\n### Paired comparison (candidate / baseline)")
        for row in gated:
            mark = "**" if row.get("decision") == "regression" else ""
            lines.append(f"- {mark}{markdown_text(paired_text(row))}{mark}")
    if report_path:
        lines += ["\n### Links", f"- [HTML report](<{_md_link_target(report_path)}>)"]
    text = "\n".join(lines) + "\n"
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    return text
