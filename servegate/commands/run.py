"""``servegate run``: run the gate end to end and print the verdict."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "cmd_run", "add_config_source", "load_gate_config"]


def add_config_source(parser: argparse.ArgumentParser,
                      set_help: str = "override a config field, e.g. --set flush.timeout_s=30 (repeatable)") -> None:
    """``--profile | --config`` and ``--set``: which gate config a command runs (run, calibrate)."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--profile", help="a shipped profile (see `servegate profiles`); default smoke")
    src.add_argument("--config", help="a gate config file (.toml, .yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def load_gate_config(args: argparse.Namespace, extra_overrides: list[str] | None = None) -> Any:
    """The GateConfig that ``--profile | --config`` and ``--set`` name (smoke by default)."""
    from servegate.config import load_config

    overrides = [*args.overrides, *(extra_overrides or [])]
    return load_config(path=args.config, profile=None if args.config else (args.profile or "smoke"),
                       overrides=overrides)


def add_arguments(subparsers: Any) -> None:
    """Add ``run`` to the main parser's subparsers."""
    run = subparsers.add_parser("run", help="run the gate end to end and print the verdict",
                                description="Run the regression gate. Exit 0 pass, 1 regression, 2 could not decide.")
    add_config_source(run)
    run.add_argument("--output-dir", help="parent folder of the run folder (config output_dir)")
    run.add_argument("--json", action="store_true", help="print the verdict as JSON instead of a table")
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    config = load_gate_config(args, [f"output_dir={args.output_dir}"] if args.output_dir else [])

    # Prefect and the flow only once the config is known to be good: a bad --set fails at once.
    from servegate import jsonio
    from servegate.flows.gate import regression_gate
    from servegate.render import format_verdict_table
    from servegate.runstate import call_flow
    from servegate.verdict import Verdict

    result = call_flow(regression_gate, config)
    verdict = Verdict.model_validate(result["verdict"])
    if args.json:
        print(jsonio.dumps({**result["verdict"], "run_dir": result["run_dir"]}, indent=True, ascii_only=True))
    else:
        print(format_verdict_table(verdict, result.get("paired") or ()))
        print(f"run folder: {result['run_dir']}")
    return verdict.exit_code
