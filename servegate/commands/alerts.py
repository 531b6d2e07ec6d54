"""``servegate alerts install`` and ``servegate alerts list``: the missing-data alarms, as Prefect
automations on the server at ``PREFECT_API_URL`` (the automations are :mod:`servegate.automations`).

    servegate alerts install --block TYPE/NAME [--prefect-file deployments/prefect.yaml]
                             [--deployment NAME ...] [--deadline-s [NAME=]SECONDS ...] [--silence-s [NAME=]SECONDS ...]
    servegate alerts list [--json]

See docs/missing-data.md.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_arguments", "cmd_install", "cmd_list"]


def add_arguments(subparsers: Any) -> None:
    """Add ``alerts install`` and ``alerts list`` to the main parser's subparsers."""
    alerts = subparsers.add_parser("alerts", help="missing-data alarms: Prefect automations on the server")
    actions = alerts.add_subparsers(dest="alerts_action", required=True, metavar="ACTION")

    install = actions.add_parser(
        "install", help="create or update the automations (idempotent)",
        description="On the Prefect server at PREFECT_API_URL, create or update one automation per watched "
                    "deployment of the Prefect project file (the gates and the scheduled deployments) that "
                    "alerts through a notification block when a run produced no verdict by its deadline "
                    "(went Late and no worker took it, hung), ended Failed/Crashed/Cancelled, or when a "
                    "scheduled deployment went silent (paused). Automations of an earlier install are "
                    "updated in place; ones for deployments no longer in the file are deleted.")
    install.add_argument("--block", required=True, metavar="TYPE/NAME",
                         help="the notification block to send through, e.g. custom-webhook/servegate or "
                              "slack-webhook/team (NAME alone when unambiguous)")
    install.add_argument("--prefect-file", default="deployments/prefect.yaml", metavar="FILE",
                         help="the Prefect project file whose deployments are watched (default %(default)s)")
    install.add_argument("--deployment", action="append", default=[], metavar="NAME",
                         help="watch only this deployment (as named in the file, e.g. nightly-cpu); repeatable")
    install.add_argument("--deadline-s", action="append", default=[], metavar="[NAME=]SECONDS",
                         help="seconds from Late/Running to a final state, for all or one deployment (default: "
                              "the matrix's timeout_s + 900 s); repeatable")
    install.add_argument("--silence-s", action="append", default=[], metavar="[NAME=]SECONDS",
                         help="seconds after a completed run of a scheduled deployment by which the next must "
                              "complete (default: the schedule's longest gap + the deadline); repeatable")
    install.set_defaults(func=cmd_install)

    listing = actions.add_parser("list", help="the installed missing-data automations")
    listing.add_argument("--json", action="store_true", help="machine-readable")
    listing.set_defaults(func=cmd_list)


def cmd_install(args: argparse.Namespace) -> int:
    from servegate.automations import install_missing_data_alarms
    from servegate.verdict import ExitCode

    watched, steps = install_missing_data_alarms(args.block, args.prefect_file, only=args.deployment,
                                                 deadlines=args.deadline_s, silences=args.silence_s)
    for w in watched:
        silence = f", silent after {w.silence_s:g} s (schedule {w.schedule})" if w.silence_s is not None else ""
        print(f"watching {w.name}: deadline {w.deadline_s:g} s ({w.deadline_source}){silence}")
    for step in steps:
        print(f"{step.action:8s} {step.name}")
    counts = {a: sum(s.action == a for s in steps) for a in ("created", "updated", "deleted")}
    print(f"alerts: {counts['created']} created, {counts['updated']} updated, {counts['deleted']} deleted; "
          f"they send through {args.block}")
    return ExitCode.PASS


def cmd_list(args: argparse.Namespace) -> int:
    from servegate.automations import list_alarms
    from servegate.verdict import ExitCode

    alarms = list_alarms()
    if args.json:
        print(json.dumps([a.model_dump(mode="json") for a in alarms], indent=2))
        return ExitCode.PASS
    for a in alarms:
        state = "enabled " if a.enabled else "disabled"
        print(f"{state} {a.name}\n         {a.trigger.describe_for_cli().strip()}")
    print(f"{len(alarms)} missing-data automation(s); install or update them with `servegate alerts install`")
    return ExitCode.PASS
