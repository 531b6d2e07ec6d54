"""``servegate rerun RUN --task STAGE``: re-measure stage(s) of a gate run and record a new
attempt; planning and the attempt's folder are :mod:`servegate.rerun`."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "cmd_rerun"]


def add_arguments(subparsers: Any) -> None:
    """Add ``rerun`` to the main parser's subparsers."""
    rerun = subparsers.add_parser(
        "rerun", help="re-run measurement stage(s) of a gate run and record a new verdict as a new attempt",
        description="Relaunch the worker from RUN's recorded config, re-measure only the named stage(s), "
                    "re-validate the whole run and record the verdict as a new attempt (the original is kept). "
                    "Exit 0 pass, 1 regression, 2 could not decide.")
    rerun.add_argument("run", metavar="RUN", help="a run folder, or a run id recorded in the history database")
    rerun.add_argument("--task", dest="stages", action="append", default=[], metavar="STAGE", required=True,
                       help="stage to re-measure: one_batch, serving, occupancy (quality when the gate has it); "
                            "repeatable")
    rerun.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override the recorded config for this attempt, e.g. --set worker.extra_args=[] "
                            "(not gate-key fields, not carried stages' sections)")
    rerun.add_argument("--db", metavar="URL", help="history database to look RUN up in (default $SERVEGATE_DB)")
    rerun.add_argument("--json", action="store_true", help="print the verdict as JSON instead of a table")
    rerun.add_argument("--github", action="store_true", help="GitHub Actions outputs, as for `servegate run --github`")
    rerun.set_defaults(func=cmd_rerun)


def cmd_rerun(args: argparse.Namespace) -> int:
    from servegate import console
    from servegate.commands.run import show_verdict
    from servegate.flows.rerun import rerun_stages
    from servegate.rerun import resolve_run_dir
    from servegate.runstate import call_flow

    run_dir = resolve_run_dir(args.run, args.db)
    overrides = list(args.overrides)
    if args.db:
        overrides.append(f"store.url={args.db}")
    console.install()
    try:
        result = call_flow(rerun_stages, str(run_dir), list(args.stages), overrides)
    finally:
        console.uninstall()
    return show_verdict(result, as_json=args.json,
                        footer=f"attempt {result['run_id'] or '(not recorded)'} of {result['attempt_of']}; "
                               f"folder: {result['run_dir']}",
                        extra={k: v for k, v in result.items() if k not in ("verdict", "paired", "run_dir")},
                        github=args.github)
