"""``servegate calibrate``: measure how far the gate's relative verdicts can be trusted.

The plan's defaults come from :mod:`servegate.calibration_plan` (no numpy); the runs are the
calibration flow, the analysis :mod:`servegate.calibrate`, both imported when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from servegate.calibration_plan import PAIRED_DEFAULTS, CalibrationPlan
from servegate.commands.run import add_config_source, load_gate_config
from servegate.errors import ConfigError

__all__ = ["add_arguments", "cmd_calibrate"]


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise ConfigError(f"{what} must be comma-separated numbers (e.g. 5,10,30), got {text!r}") from exc


def add_arguments(subparsers: Any) -> None:
    """Add ``calibrate`` to the main parser's subparsers."""
    p = subparsers.add_parser(
        "calibrate", help="measure the gate's A/A false-alarm rate and smallest detectable regression",
        description="Run the gate repeatedly on an unchanged worker (A/A) and with injected decode slowdowns "
                    "(A/B), report per gated metric the false-alarm rate and the smallest regression detected "
                    ">= 95% of the time, and record them so that later verdicts of the gate key carry them. "
                    "With --paired, each run is one decision of the config's paired stage (baseline against "
                    "candidate in rounds; the slowdown goes to the candidate only), and the report is per arm: "
                    "false alarms, detections, rounds and seconds to a decision. "
                    "Exit 0 when the figures were measured, 2 when they could not be.")
    add_config_source(p, set_help="override a config field (repeatable), as for `servegate run`")
    p.add_argument("--paired", action="store_true",
                   help="calibrate the paired stage's decisions (needs a config with [baseline], e.g. "
                        "--profile smoke-ab) instead of history comparisons")
    p.add_argument("--aa-runs", type=int, default=None,
                   help=f"unchanged-worker runs (default {CalibrationPlan.aa_runs}; with --paired: A/A decisions, "
                        f"default {PAIRED_DEFAULTS['aa_runs']})")
    p.add_argument("--slowdowns", default=None,
                   help=f"injected decode slowdowns in %% (default "
                        f"{','.join(f'{x:g}' for x in CalibrationPlan.slowdowns_pct)}, with --paired "
                        f"{','.join(f'{x:g}' for x in PAIRED_DEFAULTS['slowdowns_pct'])}; '' for A/A only)")
    p.add_argument("--runs-per-slowdown", type=int, default=None,
                   help=f"runs per injected slowdown (default {CalibrationPlan.runs_per_slowdown}; with --paired: "
                        f"decisions, default {PAIRED_DEFAULTS['runs_per_slowdown']})")
    p.add_argument("--regressions", default=None,
                   help="with --paired: real code regressions of the embedded worker to decide besides the "
                        "slowdowns, comma-separated zoo members (servegate/paired/zoo.py: linears-unpacked, "
                        "attention-bf16, detokenize-full, sampler-one-path), each --runs-per-slowdown decisions "
                        "and its solo effect measured beside them; 'all' for every member")
    p.add_argument("--bounds", default=None,
                   help=f"minimum effects to evaluate, as fractions (default "
                        f"{','.join(f'{x:g}' for x in CalibrationPlan.bounds)}; not with --paired, whose decisions "
                        f"are made against paired.bound: --set paired.bound=0.02)")
    p.add_argument("--baseline-n", type=int, default=None,
                   help="A runs each comparison pools (default: the config's compare.n)")
    p.add_argument("--output-dir", help="calibration folder (default <output_dir>/calibration-<gate>-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the calibration in --output-dir (stopped, or with more runs asked for): its runs "
                        "count and only the ones the plan still lacks are made; the same profile and --set options "
                        "are required, --aa-runs, --slowdowns and --runs-per-slowdown may grow")
    p.add_argument("--db", metavar="URL", help="history database to record the calibration in (default $SERVEGATE_DB)")
    p.add_argument("--no-record", action="store_true", help="print the figures without recording them")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    p.set_defaults(func=cmd_calibrate)


def _plan(args: argparse.Namespace, compare_n: int) -> CalibrationPlan:
    defaults = PAIRED_DEFAULTS if args.paired else {}
    if args.paired and (args.bounds is not None or args.baseline_n is not None):
        raise ConfigError("--bounds and --baseline-n are history comparison settings; a paired decision is made "
                          "against paired.bound as it runs (--set paired.bound=0.02)")
    slowdowns = (_floats(args.slowdowns, "--slowdowns") if args.slowdowns is not None
                 else defaults.get("slowdowns_pct", CalibrationPlan.slowdowns_pct))
    return CalibrationPlan(
        aa_runs=args.aa_runs if args.aa_runs is not None else defaults.get("aa_runs", CalibrationPlan.aa_runs),
        slowdowns_pct=slowdowns,
        runs_per_slowdown=(args.runs_per_slowdown if args.runs_per_slowdown is not None
                           else defaults.get("runs_per_slowdown", CalibrationPlan.runs_per_slowdown)),
        bounds=_floats(args.bounds, "--bounds") if args.bounds is not None else CalibrationPlan.bounds,
        baseline_n=args.baseline_n or compare_n, mode="paired" if args.paired else "history",
        regressions=_regressions(args.regressions))


def _regressions(text: str | None) -> tuple[str, ...]:
    """``--regressions``: zoo member names (``all``: every member); unknown names list the valid ones."""
    from servegate.paired.zoo import ZOO, zoo_regression

    if not text:
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("all",):
        return tuple(ZOO)
    for name in names:
        zoo_regression(name)
    return names


def cmd_calibrate(args: argparse.Namespace) -> int:
    import pandas as pd

    from servegate import jsonio
    from servegate.calibrate import Arm, check_arm, format_calibration, plan_arms, run_config
    from servegate.verdict import ExitCode

    config = load_gate_config(args, [f"store.url={args.db}"] if args.db else [])
    plan = _plan(args, config.compare.n)
    for arm in plan_arms(plan):  # refuse a plan that cannot run before the first run, not after it
        check_arm(config, arm, plan.mode)
    run_config(config, Arm(), Path(config.output_dir), plan.mode)
    if args.resume and not args.output_dir:
        raise ConfigError("--resume continues the calibration in --output-dir: name that folder")
    if args.output_dir:  # nor overwrite a calibration, or resume one with another config, after a Prefect start
        from servegate.calibrate import previous_runs

        previous_runs(Path(args.output_dir), config, plan, resume=args.resume)

    from servegate.flows.calibrate import calibrate_gate
    from servegate.runstate import call_flow

    doc = call_flow(calibrate_gate, config, plan=plan.as_dict(), output_dir=args.output_dir,
                    record=not args.no_record, resume=args.resume)
    if args.json:
        print(jsonio.dumps(doc, indent=True, ascii_only=True))
    else:
        print(f"calibration of {doc['key']}")
        print(format_calibration(pd.DataFrame(doc["figures"]), doc["summary"]))
        where = f"recorded as calibration {doc['calibration_id']}" if doc["calibration_id"] else "not recorded"
        print(f"folder: {doc['calibration_dir']} ({where})")
    return ExitCode.PASS
