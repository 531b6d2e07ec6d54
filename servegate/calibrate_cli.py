"""``servegate calibrate``: the command line and the calibration plan.

Kept apart from :mod:`servegate.calibrate` (numpy, pandas, scipy, the store) so that building
the CLI parser, which every ``servegate`` command does (the worker included), stays cheap; the
analysis is imported when the command runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from servegate.errors import ConfigError

__all__ = ["CalibrationPlan", "add_arguments", "cmd_calibrate"]


@dataclass(frozen=True)
class CalibrationPlan:
    """How many gate runs calibration makes, and which figures it derives."""

    aa_runs: int = 6
    slowdowns_pct: tuple[float, ...] = (5.0, 10.0, 30.0)
    runs_per_slowdown: int = 2
    bounds: tuple[float, ...] = (0.02, 0.05)
    baseline_n: int = 5
    confidence: float = 0.95
    n_boot: int = 2000

    def __post_init__(self) -> None:
        if self.aa_runs < 2:
            raise ConfigError(f"calibration needs at least 2 A/A runs (--aa-runs), got {self.aa_runs}")
        if any(not (math.isfinite(p) and p > 0) for p in self.slowdowns_pct):
            raise ConfigError(f"slowdowns are percentages > 0 (e.g. --slowdowns 5,10,30), got {self.slowdowns_pct}")
        if self.slowdowns_pct and self.runs_per_slowdown < 1:
            raise ConfigError("--runs-per-slowdown must be >= 1 when slowdowns are given")
        if not self.bounds or any(not 0 < b < 1 for b in self.bounds):
            raise ConfigError(f"bounds are fractions in (0, 1) (e.g. --bounds 0.02,0.05), got {self.bounds}")
        if self.baseline_n < 1:
            raise ConfigError(f"--baseline-n must be >= 1, got {self.baseline_n}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)



def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise ConfigError(f"{what} must be comma-separated numbers (e.g. 5,10,30), got {text!r}") from exc


def add_arguments(subparsers: Any) -> None:
    """Add ``calibrate`` to the main parser's subparsers; it sets ``func`` (args -> exit code)."""
    p = subparsers.add_parser(
        "calibrate", help="measure the gate's A/A false-alarm rate and smallest detectable regression",
        description="Run the gate repeatedly on an unchanged worker (A/A) and with injected decode slowdowns "
                    "(A/B), report per gated metric the false-alarm rate and the smallest regression detected "
                    ">= 95% of the time, and record them so that later verdicts of the gate key carry them. "
                    "Exit 0 when the figures were measured, 2 when they could not be.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", help="a shipped profile (see `servegate profiles`); default smoke")
    src.add_argument("--config", help="a gate config file (.toml, .yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable), as for `servegate run`")
    p.add_argument("--aa-runs", type=int, default=CalibrationPlan.aa_runs, help="unchanged-worker runs (default 6)")
    p.add_argument("--slowdowns", default=",".join(f"{x:g}" for x in CalibrationPlan.slowdowns_pct),
                   help="injected decode slowdowns in %% (default 5,10,30; '' for A/A only)")
    p.add_argument("--runs-per-slowdown", type=int, default=CalibrationPlan.runs_per_slowdown,
                   help="runs per injected slowdown (default 2)")
    p.add_argument("--bounds", default=",".join(f"{x:g}" for x in CalibrationPlan.bounds),
                   help="minimum effects to evaluate, as fractions (default 0.02,0.05)")
    p.add_argument("--baseline-n", type=int, default=None,
                   help="A runs each comparison pools (default: the config's compare.n)")
    p.add_argument("--output-dir", help="calibration folder (default <output_dir>/calibration-<gate>-<time>)")
    p.add_argument("--db", metavar="URL", help="history database to record the calibration in (default $SERVEGATE_DB)")
    p.add_argument("--no-record", action="store_true", help="print the figures without recording them")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: Any) -> int:
    import pandas as pd

    from servegate.calibrate import format_calibration, run_config
    from servegate.config import load_config

    overrides = list(args.overrides)
    if args.db:
        overrides.append(f"store.url={args.db}")
    config = load_config(path=args.config, profile=None if args.config else (args.profile or "smoke"),
                         overrides=overrides)
    plan = CalibrationPlan(aa_runs=args.aa_runs, slowdowns_pct=_floats(args.slowdowns, "--slowdowns"),
                           runs_per_slowdown=args.runs_per_slowdown, bounds=_floats(args.bounds, "--bounds"),
                           baseline_n=args.baseline_n or config.compare.n)
    for pct in plan.slowdowns_pct:  # refuse a plan that cannot run before the first run, not after it
        run_config(config, pct, Path(config.output_dir))

    from servegate.flows.calibrate import calibrate_gate
    from servegate.gate import call_flow

    doc = call_flow(calibrate_gate, config, plan=plan.as_dict(), output_dir=args.output_dir,
                    record=not args.no_record)
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(f"calibration of {doc['key']}")
        print(format_calibration(pd.DataFrame(doc["figures"]), doc["summary"]))
        where = f"recorded as calibration {doc['calibration_id']}" if doc["calibration_id"] else "not recorded"
        print(f"folder: {doc['calibration_dir']} ({where})")
    return 0
