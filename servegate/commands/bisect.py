"""``servegate bisect``: find the first bad build of an ordered list with paired gate runs."""

from __future__ import annotations

import argparse
from typing import Any

from servegate.commands.run import add_config_source

__all__ = ["add_arguments", "cmd_bisect"]


def add_arguments(subparsers: Any) -> None:
    """Add ``bisect`` to the main parser's subparsers."""
    bisect = subparsers.add_parser(
        "bisect", help="find the first bad build of a list (a paired gate run per step)",
        description="Binary-search an ordered list of builds (oldest first) for the first one that regresses "
                    "against the good build, measuring each step with the paired stage of a profile with "
                    "[baseline] (smoke-ab, vllm-cpu-ab). Builds that do not install or start are skipped and "
                    "reported. Exit 0 when the first bad build (or the range it is in) is known, 2 when the "
                    "bisection could not tell. The builds file: see servegate/bisect.py or the README.")
    add_config_source(bisect)
    bisect.add_argument("--builds", required=True, metavar="FILE", help="the builds file (TOML), oldest first")
    bisect.add_argument("--good", metavar="REF", help="the good build's ref (default: the first)")
    bisect.add_argument("--bad", metavar="REF", help="the bad build's ref (default: the last)")
    bisect.add_argument("--output-dir", help="parent folder of the bisection's and its steps' run folders "
                                             "(config output_dir)")
    bisect.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    bisect.set_defaults(func=cmd_bisect)


def cmd_bisect(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from servegate import jsonio
    from servegate.bisect import load_builds, run_bisection, summary_markdown
    from servegate.commands.run import load_gate_config

    builds = load_builds(Path(args.builds))
    quiet = [] if getattr(args, "verbose", False) else ["serving.progress=false"]
    config = load_gate_config(args, [*quiet, *([f"output_dir={args.output_dir}"] if args.output_dir else [])])
    out_dir = Path(config.output_dir) / f"bisect-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{config.name}"

    from servegate.flows.gate import regression_gate
    from servegate.runstate import call_flow

    def run_gate(step_config: Any) -> dict[str, Any]:
        return call_flow(regression_gate, step_config)

    def on_step(step: Any) -> None:
        if not args.json:
            print(f"bisect: {step.ref}: {step.outcome} ({step.why.splitlines()[0] if step.why else ''}; "
                  f"{step.seconds:g} s)", flush=True)

    state = run_bisection(config, builds, good=args.good, bad=args.bad, out_dir=out_dir, run_gate=run_gate,
                          on_step=on_step)
    if args.json:
        print(jsonio.dumps({**state.document(), "bisect_dir": str(out_dir)}, indent=True, ascii_only=True))
    else:
        print(summary_markdown(state))
        print(f"bisection folder: {out_dir}")
    return state.exit_code
