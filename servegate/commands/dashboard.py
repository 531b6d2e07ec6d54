"""``servegate dashboard``: a static site of every gate key's trends, from the history database.

    servegate dashboard --out DIR [--key PATTERN] [--since 30d|2026-11-01] [--copy-reports] [--db URL]

Writes ``DIR/index.html`` (each key's latest verdict, a sparkline per gated metric, its latest
change point) and ``DIR/keys/<key>.html`` (a trend per gated metric: baseline band, pinned
baselines, distribution changes, change points, each run a point linking to its report).
See docs/dashboard.md.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "cmd_dashboard"]


def add_arguments(subparsers: Any) -> None:
    """Add ``dashboard`` to the main parser's subparsers."""
    from servegate.commands.history import _db_arg

    p = subparsers.add_parser(
        "dashboard", help="write a static site of every gate key's trends, with change points marked",
        description="Write DIR/index.html (every gate key with its latest verdict and a sparkline per gated "
                    "metric) and one page per key (trends over time: baseline band, pinned baselines, "
                    "distribution changes, change points; each run links to its report). Self-contained "
                    "HTML with inline SVG.")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the site into (created)")
    p.add_argument("--key", action="append", default=[], metavar="PATTERN",
                   help="only keys matching: a full key, a leading part (smoke) or a wildcard (*/sglang/*); "
                        "repeatable")
    p.add_argument("--since", metavar="WHEN", help="only runs started since: 30d, 12h or an ISO date")
    p.add_argument("--max-runs", type=int, default=None, metavar="N",
                   help="the newest N runs per key (default 200)")
    p.add_argument("--copy-reports", action="store_true",
                   help="copy each run's report.html into DIR/reports/ (a site that travels without the run folders)")
    _db_arg(p)
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from servegate.commands.history import _store, parse_since
    from servegate.dashboard.series import MAX_RUNS, key_history
    from servegate.dashboard.site import write_site
    from servegate.errors import ConfigError
    from servegate.verdict import ExitCode

    max_runs = MAX_RUNS if args.max_runs is None else args.max_runs
    if max_runs < 1:
        raise ConfigError(f"--max-runs must be at least 1, got {max_runs}")
    since = parse_since(args.since) if args.since else None
    with _store(args) as store:
        keys = [k for k in store.keys() if not args.key or any(k.matches(p) for p in args.key)]
        histories = [h for h in (key_history(store, k, since=since, max_runs=max_runs) for k in keys) if h.runs]
        if args.key and not histories:
            raise ConfigError(f"no recorded run matches --key {args.key}; known keys: "
                              f"{[str(k) for k in store.keys()]}")
        site = write_site(histories, args.out, source=repr(store).removeprefix("Store(").removesuffix(")"),
                          copy_reports=args.copy_reports)
    print(f"dashboard: {site.index} ({len(site.pages)} gate key(s), {site.change_points} change point(s))")
    return ExitCode.PASS
