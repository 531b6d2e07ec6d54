"""``servegate calibrate``: how far this gate's relative verdicts can be trusted, measured.

A relative check is only as good as its false-alarm rate and its power. Calibration measures
both on the machine and workload of one gate key, by running the gate itself:

- **A/A**: ``aa_runs`` gate runs of an unchanged worker. Each A run after the first is
  compared with the A runs before it (the last ``baseline_n``, as a nightly is with its last
  passing runs); every gated ``regression`` decision is a false alarm.
- **A/B**: ``runs_per_slowdown`` gate runs per injected slowdown (the embedded worker's
  ``--fault-decode-slowdown-pct P``: every decode forward sleeps P % of its compute time),
  each compared with the last ``baseline_n`` A runs; a ``regression`` is a detection.

Runs are interleaved (A, A, then rounds of A and each slowdown) so that a drift of the machine
during calibration falls on both sides instead of looking like a regression.

For each gated metric (and one-batch case) and each candidate minimum effect (``bounds``):

=========================== ===============================================================
``run_sd``                  between-run noise (sd of log medians over all A runs, less their
                            own sampling noise): stored, and used by every later comparison
                            of the key as the floor of its run-to-run term
``false_alarms``            A/A comparisons decided ``regression`` / comparisons, with the
``false_alarm_upper95``     exact (Clopper-Pearson) one-sided 95 % upper bound on the rate
``min_detectable``          the smallest change in the bad direction that the A/A comparisons
                            would have flagged in 95 % of cases: a slowdown ``s`` scales a
                            comparison's interval by ``1 + s``, so comparison *i* flags it when
                            ``(1 + s) * ci_low_i > 1 + bound`` (lower is better; for higher is
                            better a drop ``d`` flags when ``(1 - d) * ci_high_i < 1 - bound``);
                            the 95th percentile over comparisons (their maximum when few)
``detected_<P>pct``         share of the P % slowdown runs decided ``regression``
``ratio_<P>pct``            median ratio the metric showed in the P % runs (the fault slows
                            the forward pass only, so a metric moves by less than P %)
``min_detected_injected``   smallest injected slowdown detected in >= 95 % of its runs
=========================== ===============================================================

Then the figures are recorded in the history database (``calibrations``); the compare stage
of later gate runs of the key uses ``run_sd`` and attaches ``false_alarm_upper95`` and
``min_detectable`` to each comparison row, and the verdict carries the calibration summary.
Calibration runs themselves go to their own run folders and are not recorded as gate history.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from servegate.compare import (DEFAULT_TAIL_BOUND, GATED_METRICS, GatedMetric, compare_tables, decide,
                               estimate_run_noise)
from servegate.config import GateConfig
from servegate.errors import ConfigError, InfraError

__all__ = [
    "CalibrationPlan",
    "CalibrationRun",
    "schedule",
    "run_config",
    "analyse",
    "summarise",
    "format_calibration",
    "MEASUREMENT_STAGES",
]

MEASUREMENT_STAGES = ("one_batch", "serving", "occupancy")
"""Stages whose wall time counts as measurement (launch, warm-up, flushes and quality do not)."""
SLOWDOWN_FLAG = "--fault-decode-slowdown-pct"
DETECTION_TARGET = 0.95


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


@dataclass
class CalibrationRun:
    """One gate run made by calibration."""

    index: int
    slowdown_pct: float  # 0 for an A run
    run_dir: str = ""
    status: str = ""  # the run's own verdict (absolute checks)
    measurement_s: float = math.nan
    tables: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    @property
    def label(self) -> str:
        return "A" if self.slowdown_pct == 0 else f"+{self.slowdown_pct:g}%"


def schedule(plan: CalibrationPlan) -> list[float]:
    """The slowdown of each run in order (0 = A): two A runs, then interleaved rounds."""
    order = [0.0] * min(2, plan.aa_runs)
    remaining_a = plan.aa_runs - len(order)
    rounds = max(remaining_a, plan.runs_per_slowdown if plan.slowdowns_pct else 0)
    for r in range(rounds):
        if r < remaining_a:
            order.append(0.0)
        if r < plan.runs_per_slowdown:
            order.extend(float(p) for p in plan.slowdowns_pct)
    return order


def run_config(config: GateConfig, slowdown_pct: float, output_dir: Path) -> GateConfig:
    """The gate config of one calibration run: the measurement stages only, nothing recorded,
    and for an A/B run the decode slowdown appended to the worker's launch arguments."""
    if slowdown_pct and config.worker.engine != "embedded":
        raise ConfigError(f"injected slowdowns need the embedded worker's decode fault; engine "
                          f"{config.worker.engine!r} has none. Calibrate A/A only with --slowdowns ''")
    data = config.model_dump(by_alias=True)
    data["output_dir"] = str(output_dir)
    data["compare"]["enabled"] = False
    data["store"]["enabled"] = False
    data["report"]["html"] = False
    data["quality"]["enabled"] = False  # quality is an absolute check, never compared with a baseline
    args = [a for a in data["worker"]["extra_args"]]
    if SLOWDOWN_FLAG in args:
        raise ConfigError(f"the config already sets {SLOWDOWN_FLAG} in worker.extra_args; calibrate an "
                          f"unchanged worker (remove it)")
    if slowdown_pct:
        args += [SLOWDOWN_FLAG, f"{slowdown_pct:g}"]
    data["worker"]["extra_args"] = args
    return GateConfig.model_validate(data)


def measurement_seconds(stages: Mapping[str, Mapping[str, Any]]) -> float:
    """Wall time of the measurement stages of one run (from its ``stages.json``)."""
    return float(sum(float(s.get("duration_s") or 0.0) for name, s in stages.items()
                     if name in MEASUREMENT_STAGES and s.get("status") == "ok"))


# ---- analysis -------------------------------------------------------------------------------
def _comparisons(runs: Sequence[CalibrationRun], plan: CalibrationPlan, run_noise: Mapping[str, float],
                 metrics: Sequence[GatedMetric], seed: int) -> pd.DataFrame:
    """Every calibration comparison's rows: each run after the first A run against the last
    ``baseline_n`` A runs before it, with the calibrated run noise (as later gates will)."""
    frames = []
    a_before: list[CalibrationRun] = []
    for run in runs:
        if a_before:
            baseline = [(f"A{r.index}", r.tables) for r in a_before[-plan.baseline_n:]]
            df = compare_tables(run.tables, baseline, metrics=metrics, confidence=plan.confidence,
                                n_boot=plan.n_boot, seed=seed + run.index, run_noise=run_noise)
            df.insert(0, "run", run.index)
            df.insert(1, "slowdown_pct", run.slowdown_pct)
            frames.append(df)
        if run.slowdown_pct == 0:
            a_before.append(run)
    if not frames:
        raise ConfigError("calibration made no comparison: it needs at least two A runs that produced tables")
    return pd.concat(frames, ignore_index=True)


def _upper95(k: int, n: int) -> float:
    # The one-sided 95 % upper bound is the upper end of the two-sided 90 % Clopper-Pearson interval.
    return float(stats.binomtest(k, n).proportion_ci(confidence_level=0.90, method="exact").high) if n else math.nan


def _min_detectable(rows: pd.DataFrame, bound: float) -> float:
    """95th percentile over A/A comparisons of the smallest bad-direction change each would flag."""
    if rows.empty:
        return math.nan
    if rows["direction"].iloc[0] == "lower_is_better":
        need = (1 + bound) / rows["ci_low"] - 1
    else:
        need = 1 - (1 - bound) / rows["ci_high"]
    need = need.to_numpy(dtype=float)
    need = need[np.isfinite(need)]
    if need.size == 0:
        return math.nan
    return max(0.0, float(np.quantile(need, 0.95, method="higher")))


def analyse(runs: Sequence[CalibrationRun], plan: CalibrationPlan, *,
            metrics: Sequence[GatedMetric] = GATED_METRICS, tail_bound: float = DEFAULT_TAIL_BOUND,
            seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """``(figures, comparisons, run_noise)`` from the runs' tables (see the module docstring).

    ``figures`` has one row per gated metric, case and bound; ``comparisons`` every
    comparison row (for the record); ``run_noise`` metric -> between-run sd.
    """
    a_runs = [r for r in runs if r.slowdown_pct == 0 and r.tables]
    if len(a_runs) < 2:
        raise InfraError(f"{len(a_runs)} A/A run(s) produced tables; calibration needs at least 2 "
                         f"(see the runs' verdicts and worker.log files, then calibrate again)")
    run_noise = estimate_run_noise([r.tables for r in a_runs], metrics, seed=seed)
    comps = _comparisons([r for r in runs if r.tables], plan, run_noise, metrics, seed)
    figures = []
    for (metric, case), rows in comps.groupby(["metric", "case"], sort=False):
        aa = rows[(rows["slowdown_pct"] == 0) & rows["gated"]]
        statistic = rows["statistic"].iloc[0]
        # Tails are gated with their own minimum effect (compare.tail_bound) whatever the median bound.
        for eff in (plan.bounds if statistic == "median" else (tail_bound,)):
            decisions = [decide(lo, hi, d, eff) for lo, hi, d in zip(aa["ci_low"], aa["ci_high"], aa["direction"])]
            alarms = sum(d == "regression" for d in decisions)
            fig: dict[str, Any] = {
                "metric": metric, "case": case, "statistic": statistic, "direction": rows["direction"].iloc[0],
                "bound": eff, "gated_in_calibration": bool(len(aa)),
                "run_sd": float(run_noise.get(str(metric), math.nan)),
                "aa_comparisons": len(aa), "false_alarms": alarms,
                "false_alarm_rate": alarms / len(aa) if len(aa) else math.nan,
                "false_alarm_upper95": _upper95(alarms, len(aa)),
                "min_detectable": _min_detectable(aa, eff),
                "min_detected_injected": math.nan,
            }
            for pct in plan.slowdowns_pct:
                b = rows[(rows["slowdown_pct"] == pct) & rows["gated"]]
                hits = sum(decide(lo, hi, d, eff) == "regression"
                           for lo, hi, d in zip(b["ci_low"], b["ci_high"], b["direction"]))
                rate = hits / len(b) if len(b) else math.nan
                fig[f"detected_{pct:g}pct"] = rate
                # The fault slows the forward pass only: how much the metric itself moved.
                fig[f"ratio_{pct:g}pct"] = float(np.median(b["ratio"])) if len(b) else math.nan
                if math.isnan(fig["min_detected_injected"]) and len(b) and rate >= DETECTION_TARGET:
                    fig["min_detected_injected"] = pct / 100.0
            figures.append(fig)
    return pd.DataFrame(figures), comps, run_noise


def summarise(runs: Sequence[CalibrationRun], figures: pd.DataFrame, comparisons: pd.DataFrame,
              plan: CalibrationPlan, *, tail_bound: float = DEFAULT_TAIL_BOUND) -> dict[str, Any]:
    """Gate-level figures: how often any gated metric false-alarmed, measurement time per decision."""
    a_measure = [r.measurement_s for r in runs if r.slowdown_pct == 0 and math.isfinite(r.measurement_s)]
    per_run = float(np.median(a_measure)) if a_measure else math.nan
    aa = comparisons[(comparisons["slowdown_pct"] == 0) & comparisons["gated"]]
    gate_level = {}
    for bound in plan.bounds:
        flagged = 0
        for _, rows in aa.groupby("run"):
            eff = np.where(rows["statistic"] == "median", bound, tail_bound)  # tails: their own bound, as analyse
            flagged += any(decide(lo, hi, d, b) == "regression"
                           for lo, hi, d, b in zip(rows["ci_low"], rows["ci_high"], rows["direction"], eff))
        n = int(aa["run"].nunique())
        gate_level[f"{bound:g}"] = {"comparisons": n, "false_alarms": flagged,
                                    "false_alarm_upper95": _upper95(flagged, n)}
    return {
        "runs": [{"index": r.index, "slowdown_pct": r.slowdown_pct, "status": r.status, "run_dir": r.run_dir,
                  "measurement_s": r.measurement_s} for r in runs],
        "aa_runs": sum(1 for r in runs if r.slowdown_pct == 0 and r.tables),
        "ab_runs": sum(1 for r in runs if r.slowdown_pct and r.tables),
        "measurement_s_per_run": per_run,
        "measurement_s_per_decision": per_run * (min(plan.baseline_n, max(1, len(a_measure) - 1)) + 1),
        "gate_false_alarms": gate_level,
    }


def _pct(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{100 * value:.1f}%"


def format_calibration(figures: pd.DataFrame, summary: Mapping[str, Any]) -> str:
    """The calibration as a plain-text table for a terminal."""
    from tabulate import tabulate

    det_cols = [c for c in figures.columns if c.startswith("detected_")]
    ratio_cols = [c for c in figures.columns if c.startswith("ratio_")]
    rows = []
    for r in figures.itertuples(index=False):
        d = r._asdict()
        name = d["metric"] + (f" [{d['case']}]" if d["case"] else "")
        rows.append([name, _pct(d["bound"]), _pct(d["run_sd"]),
                     f"{d['false_alarms']}/{d['aa_comparisons']} (<= {_pct(d['false_alarm_upper95'])})",
                     _pct(d["min_detectable"]),
                     *[f"{_pct(d[c])} (x{d[r]:.2f})" if isinstance(d[r], float) and math.isfinite(d[r]) else _pct(d[c])
                       for c, r in zip(det_cols, ratio_cols)],
                     _pct(d["min_detected_injected"])])
    headers = ["metric", "bound", "run sd", "false alarms (95% upper)", "min detectable",
               *[c.replace("detected_", "detected +").replace("pct", "% (ratio)") for c in det_cols],
               "min detected (inj.)"]
    lines = [tabulate(rows, headers=headers, tablefmt="simple")]
    lines.append("")
    lines.append(f"A/A runs: {summary['aa_runs']}, slowdown runs: {summary['ab_runs']}; measurement per run "
                 f"{summary['measurement_s_per_run']:.0f} s, per decision (baseline + current) "
                 f"{summary['measurement_s_per_decision']:.0f} s")
    for bound, g in summary["gate_false_alarms"].items():
        lines.append(f"gate-level false alarms at bound {float(bound):.0%}: {g['false_alarms']}/{g['comparisons']} "
                     f"A/A comparisons (95% upper bound {_pct(g['false_alarm_upper95'])})")
    return "\n".join(lines)


def figures_records(figures: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-clean records (NaN -> None) for the store and ``--json``."""
    return json.loads(figures.to_json(orient="records"))


ProgressFn = Callable[[str], None]


# ---- command line ---------------------------------------------------------------------------
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

    try:
        doc = calibrate_gate(config, plan=plan.as_dict(), output_dir=args.output_dir, record=not args.no_record)
    except RuntimeError as exc:
        if "Prefect" not in str(exc):
            raise
        raise InfraError(f"{exc} Set PREFECT_API_URL to a running `prefect server start`.") from exc
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(f"calibration of {doc['key']}")
        print(format_calibration(pd.DataFrame(doc["figures"]), doc["summary"]))
        where = f"recorded as calibration {doc['calibration_id']}" if doc["calibration_id"] else "not recorded"
        print(f"folder: {doc['calibration_dir']} ({where})")
    return 0
