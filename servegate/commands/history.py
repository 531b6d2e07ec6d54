"""The release manager's commands: ``status``, ``report``, ``baseline``.

    servegate status [--key PATTERN] [--since 7d|2026-11-30] [--json] [--db URL]
    servegate report RUN [--out FILE] [--db URL]
    servegate baseline show KEY [--db URL]
    servegate baseline pin RUN --reason TEXT [--actor NAME] [--db URL]
    servegate baseline unpin KEY --reason TEXT [--actor NAME] [--db URL]
    servegate baseline distribution-change KEY --reason TEXT [--actor NAME] [--db URL]

KEY is ``workload/engine/hardware/model`` (as ``status`` prints it). ``--db`` defaults to
``$SERVEGATE_DB`` or the SQLite file under ``$SERVEGATE_HOME`` / ``~/.local/share/servegate``.

:func:`add_arguments` adds these commands to the main parser's subparsers; each sets ``func``
(``args -> ExitCode``), and handlers raise ``ServegateError`` for ``servegate.cli.main`` to print.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from servegate.errors import ConfigError

__all__ = ["add_arguments", "status_rows", "format_status", "parse_since"]


def _db_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", metavar="URL", help="history database: SQLAlchemy URL or SQLite path "
                                                    "(default $SERVEGATE_DB or ~/.local/share/servegate/history.db)")


def add_arguments(subparsers: Any) -> None:
    """Add ``status``, ``report`` and ``baseline`` to ``subparsers`` (from ``add_subparsers``)."""
    status = subparsers.add_parser("status", help="latest verdict per gate key, with what failed and by how much",
                                   description="One line per gate key: the latest verdict, when, against which "
                                               "baseline, the failing metrics with their ratios, the gated paired "
                                               "metrics (candidate / baseline), attempts, and the latest "
                                               "change point of a gated metric after the key's baseline "
                                               "(docs/dashboard.md).")
    status.add_argument("--key", action="append", default=[], metavar="PATTERN",
                        help="only keys matching: a full key, a leading part (smoke, smoke/embedded) or a "
                             "wildcard (*/sglang/*); repeatable")
    status.add_argument("--since", metavar="WHEN", help="only runs started since: 7d, 12h, 30m or an ISO date")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _db_arg(status)
    status.set_defaults(func=cmd_status)

    report = subparsers.add_parser("report", help="write a run's self-contained HTML report")
    report.add_argument("run", metavar="RUN", help="a recorded run id (see `servegate status --json`)")
    report.add_argument("--out", metavar="FILE", help="output file (default <run folder>/report.html)")
    _db_arg(report)
    report.set_defaults(func=cmd_report)

    baseline = subparsers.add_parser("baseline", help="show, pin, unpin a gate's baseline; mark a distribution change")
    actions = baseline.add_subparsers(dest="baseline_action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="the baseline runs a new run of KEY would be compared with, and the log")
    show.add_argument("key", metavar="KEY", help="workload/engine/hardware/model")
    _db_arg(show)
    show.set_defaults(func=cmd_baseline_show)
    pin = actions.add_parser("pin", help="make RUN the baseline of its gate key until unpinned")
    pin.add_argument("run", metavar="RUN")
    unpin = actions.add_parser("unpin", help="return KEY to its baseline policy (last N passing runs)")
    unpin.add_argument("key", metavar="KEY")
    change = actions.add_parser("distribution-change",
                                help="mark an intentional shift for KEY: the baseline restarts after now")
    change.add_argument("key", metavar="KEY")
    for parser, func in ((pin, cmd_baseline_pin), (unpin, cmd_baseline_unpin), (change, cmd_baseline_change)):
        parser.add_argument("--reason", required=True, help="why (recorded with who and when)")
        parser.add_argument("--actor", help="who (default $SERVEGATE_ACTOR or $USER)")
        _db_arg(parser)
        parser.set_defaults(func=func)


def _store(args: argparse.Namespace) -> Any:
    from servegate.history import Store

    return Store(args.db)


# ---- status -------------------------------------------------------------------------------
def status_rows(store: Any, patterns: Sequence[str] = (), since: Any = None) -> list[dict[str, Any]]:
    """One dict per gate key: latest verdict, when, baseline, failing metrics, suspicious metrics (the
    history rule of ``compare.consecutive``: ratio, interval and its reason), gated paired
    metrics (ratio candidate / baseline, interval, decision, rounds), breaches, attempts, and the
    latest change point of a gated metric after the key's baseline (``change_point``, or None;
    :func:`servegate.dashboard.series.latest_change_point`)."""
    from servegate.dashboard.series import key_history, latest_change_point
    from servegate.render import gated_paired_rows

    latest = store.latest(since=since)
    rows = []
    for key, rec in latest.items():
        if patterns and not any(key.matches(p) for p in patterns):
            continue
        tables = store.tables(rec.run_id, ["comparison", "paired"])
        comparison = tables.get("comparison")
        failing, suspicious, baseline = [], [], None
        if comparison is not None and not comparison.empty:
            first = comparison.iloc[0]
            runs = [x for x in str(first["baseline_runs"] or "").split(",") if x and x != "nan"]
            baseline = {"policy": first["baseline_policy"], "run_ids": runs}
            for decision, shown in (("regression", failing), ("suspicious", suspicious)):
                for r in comparison[comparison["decision"] == decision].itertuples(index=False):
                    shown.append({"metric": r.metric, "case": r.case or None, "ratio": r.ratio,
                                  "ci_low": r.ci_low, "ci_high": r.ci_high, "bound": r.bound,
                                  "min_detectable": _finite_or_none(getattr(r, "min_detectable", None)),
                                  "reason": r.reason if isinstance(r.reason, str) else None})
        paired = [{"metric": p["metric"], "ratio": _finite_or_none(p["ratio"]),
                   "ci_low": _finite_or_none(p["ci_low"]), "ci_high": _finite_or_none(p["ci_high"]),
                   "bound": _finite_or_none(p["bound"]), "decision": p["decision"], "rounds": int(p["rounds"]),
                   "stopped_because": p["stopped_because"] if isinstance(p["stopped_because"], str) else None}
                  for p in gated_paired_rows(tables["paired"].to_dict("records") if "paired" in tables else [])]
        # A breach that a line above already shows (a regressing comparison, a paired decision) is not repeated.
        breaches = [b for b in rec.verdict.get("breaches") or []
                    if not (failing and b.get("table") == "comparison")
                    and not (paired and b.get("table") == "paired" and b.get("column") == "decision")]
        report = None
        if rec.run_dir and (Path(rec.run_dir) / "report.html").is_file():
            report = str(Path(rec.run_dir) / "report.html")
        attempts = store.attempts(rec.run_id)
        rows.append({"key": str(key), "status": rec.status, "run_id": rec.run_id,
                     "started_at": rec.started_at.isoformat(), "recorded_at": rec.recorded_at.isoformat(),
                     "attempts": len(attempts), "attempt_statuses": [a.status for a in attempts],
                     "baseline": baseline, "failing": failing, "suspicious": suspicious, "paired": paired,
                     "breaches": breaches,
                     "infra_errors": rec.verdict.get("infra_errors") or [],
                     "undecided": rec.verdict.get("undecided") or [], "report": report,
                     "calibration": rec.verdict.get("calibration"),
                     "change_point": latest_change_point(key_history(store, key))})
    return rows


def _finite_or_none(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


def _trust_text(calibration: dict[str, Any]) -> str:
    gate = calibration.get("gate_false_alarms_at_bound") or {}
    text = f"calibrated {str(calibration.get('at') or '')[:10]} ({calibration.get('aa_runs')} A/A runs)"
    if gate:
        text += f": gate-level false alarms {gate.get('false_alarms')}/{gate.get('comparisons')}"
    return text


def _ratio_text(f: dict[str, Any]) -> str:
    from servegate.render import ratio_text

    case = f"[{f['case']}]" if f.get("case") else ""
    det = f", smallest detectable {f['min_detectable']:.1%}" if f.get("min_detectable") is not None else ""
    return f"{f['metric']}{case} {ratio_text(f['ratio'], f['ci_low'], f['ci_high'])}{det}"


def _change_point_text(cp: dict[str, Any]) -> str:
    from servegate.render import terminal_text

    case = f"[{cp['case']}]" if cp.get("case") else ""
    what = "step" if cp["kind"] == "step" else "trend began"
    where = "the baseline already includes it" if cp.get("in_baseline") else "after the baseline runs"
    return terminal_text(f"change point: {cp['metric']}{case} {what} at {cp['run_id']} ({cp['started_at'][:10]}), "
                         f"{cp['before']:.4g} -> {cp['after']:.4g} {cp['unit']} ({cp['change']:+.1%}, "
                         f"{'worse' if cp['worse'] else 'better'}; {cp['runs_since']} run(s) since; {where})")


def format_status(rows: Sequence[dict[str, Any]]) -> str:
    """The human form of :func:`status_rows`: one line per key, details indented under it."""
    from servegate.render import paired_text

    if not rows:
        return "no gate runs recorded (run `servegate run`, which records to the history database)"
    width = max(len(r["key"]) for r in rows)
    lines = []
    for r in rows:
        when = r["started_at"][:16].replace("T", " ") + " UTC"
        attempts = f"attempt {r['attempts']} ({'/'.join(r['attempt_statuses'])})" if r["attempts"] > 1 else "1 attempt"
        if r["baseline"]:
            base = f"vs {r['baseline']['policy']} ({len(r['baseline']['run_ids'])} run(s))"
        elif r.get("paired"):
            base = "vs a baseline worker (paired)"
        else:
            base = "no baseline comparison"
        lines.append(f"{r['key']:<{width}}  {r['status'].upper():<12} {when}  {r['run_id']}  {attempts}  {base}")
        problems = [_ratio_text(f) for f in r["failing"]]
        problems += [f"suspicious: {_ratio_text(f)} ({f['reason']})" for f in r.get("suspicious") or []]
        problems += [f"paired {paired_text(p, why=False)}" for p in r.get("paired") or []]
        problems += [f"{b.get('table')}.{b.get('column') or b.get('expectation')}: observed {b.get('observed')}, "
                     f"allowed {b.get('allowed')}" for b in r["breaches"]]
        problems += [f"infra: {str(e).splitlines()[0]}" for e in r["infra_errors"]]
        # The suspicious metrics are named above: their check's entry would only count them again.
        undecided = [str(e).splitlines()[0] for e in r["undecided"]
                     if not (r.get("suspicious") and str(e).startswith("suspicious: comparison."))]
        problems += [e if e.startswith(("undecided: ", "suspicious: ")) else f"undecided: {e}" for e in undecided]
        for p in problems:
            lines.append(f"{'':<{width}}    - {p}")
        if r.get("calibration"):
            lines.append(f"{'':<{width}}    trust: {_trust_text(r['calibration'])}")
        if r.get("change_point"):
            lines.append(f"{'':<{width}}    {_change_point_text(r['change_point'])}")
        if r["report"]:
            lines.append(f"{'':<{width}}    report: {r['report']}")
    return "\n".join(lines)


def parse_since(text: str) -> datetime:
    """``7d``, ``12h``, ``30m`` (ago) or an ISO 8601 date/time (UTC when no zone is given)."""
    from servegate.history.rows import aware_utc

    text = text.strip()
    units = {"d": "days", "h": "hours", "m": "minutes"}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        value = float(text[:-1])
        if not math.isfinite(value):
            raise ConfigError(f"--since {text!r}: give a finite duration like 7d, 12h, 30m")
        return datetime.now(timezone.utc) - timedelta(**{units[text[-1]]: value})
    try:
        return aware_utc(datetime.fromisoformat(text.replace("Z", "+00:00")))
    except ValueError as exc:
        raise ConfigError(f"--since {text!r} is neither a duration (7d, 12h, 30m) nor an ISO date "
                          f"(2026-11-30 or 2026-11-30T08:00)") from exc


def cmd_status(args: argparse.Namespace) -> int:
    from servegate import jsonio
    from servegate.verdict import ExitCode

    since = parse_since(args.since) if args.since else None
    with _store(args) as store:
        rows = status_rows(store, args.key, since)
    if args.json:
        print(jsonio.dumps(rows, indent=True, ascii_only=True))
    else:
        print(format_status(rows))
    return ExitCode.PASS


# ---- report -------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from servegate.report import write_report
    from servegate.verdict import ExitCode

    with _store(args) as store:
        path = write_report(store, args.run, args.out)
    print(f"report: {path}")
    return ExitCode.PASS


# ---- baseline -----------------------------------------------------------------------------
def _key(text: str) -> Any:
    from servegate.history import GateKey

    return GateKey.parse(text)


def cmd_baseline_show(args: argparse.Namespace) -> int:
    from servegate.baseline import active_pin, resolve_baseline
    from servegate.verdict import ExitCode

    key = _key(args.key)
    with _store(args) as store:
        if key not in store.keys():
            raise ConfigError(f"no run of gate {key} is recorded; known keys: {[str(k) for k in store.keys()]}")
        baseline = resolve_baseline(store, key)
        pinned = active_pin(store, key)
        print(f"{key}: baseline {baseline.policy}: {', '.join(baseline.run_ids) or 'none'}")
        if baseline.reason:
            print(f"  note: {baseline.reason}")
        if pinned:
            print(f"  pinned by {pinned['actor']} at {pinned['at']:%Y-%m-%d %H:%M} UTC: {pinned['reason']}")
        for a in store.baseline_actions(key):
            target = f" {a['run_id']}" if a["run_id"] else ""
            print(f"  {a['at']:%Y-%m-%d %H:%M} UTC  {a['action']}{target}  by {a['actor']}: {a['reason']}")
    return ExitCode.PASS


def cmd_baseline_pin(args: argparse.Namespace) -> int:
    from servegate.baseline import pin
    from servegate.verdict import ExitCode

    with _store(args) as store:
        pin(store, args.run, reason=args.reason, actor=args.actor)
        print(f"pinned {args.run} as the baseline of {store.get_run(args.run).key}")
    return ExitCode.PASS


def cmd_baseline_unpin(args: argparse.Namespace) -> int:
    from servegate.baseline import unpin
    from servegate.verdict import ExitCode

    key = _key(args.key)
    with _store(args) as store:
        unpin(store, key, reason=args.reason, actor=args.actor)
    print(f"unpinned {key}: its baseline policy applies again")
    return ExitCode.PASS


def cmd_baseline_change(args: argparse.Namespace) -> int:
    from servegate.baseline import mark_distribution_change
    from servegate.verdict import ExitCode

    key = _key(args.key)
    with _store(args) as store:
        mark_distribution_change(store, key, reason=args.reason, actor=args.actor)
    print(f"marked a distribution change for {key}: later runs start a new baseline")
    return ExitCode.PASS

