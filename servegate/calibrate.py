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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from servegate import jsonio
from servegate.calibration_plan import CalibrationPlan
from servegate.compare import DEFAULT_TAIL_BOUND, compare_tables, decide_change, estimate_run_noise
from servegate.config import GateConfig
from servegate.errors import ConfigError, InfraError
from servegate.gated_metrics import GATED_METRICS, GatedMetric
from servegate.render import percent_text
from servegate.stages import MEASUREMENT_STAGES
from servegate.tables import TABLE_STAGE

__all__ = [
    "CalibrationPlan",
    "CalibrationRun",
    "schedule",
    "run_config",
    "analyse",
    "summarise",
    "format_calibration",
    "COMPARED_STAGES",
    "COMPARED_TABLES",
]

COMPARED_TABLES: tuple[str, ...] = tuple(dict.fromkeys(m.table for m in GATED_METRICS))
"""The tables the baseline comparison reads: all a calibration run needs to keep."""
COMPARED_STAGES: tuple[str, ...] = tuple(s for s in MEASUREMENT_STAGES if s in {TABLE_STAGE[t] for t in COMPARED_TABLES})
"""Stages whose wall time counts as measurement: those producing compared tables (launch,
warm-up, flushes and quality do not)."""
SLOWDOWN_FLAG = "--fault-decode-slowdown-pct"
DETECTION_TARGET = 0.95


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

    def record(self) -> dict[str, Any]:
        """The run as calibration records it (``runs.json``, the summary's ``runs``)."""
        return {"index": self.index, "slowdown_pct": self.slowdown_pct, "status": self.status,
                "run_dir": self.run_dir, "measurement_s": self.measurement_s}


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
                     if name in COMPARED_STAGES and s.get("status") == "ok"))


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
            decisions = [decide_change(lo, hi, d, eff)
                         for lo, hi, d in zip(aa["ci_low"], aa["ci_high"], aa["direction"])]
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
                hits = sum(decide_change(lo, hi, d, eff) == "regression"
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
            flagged += any(decide_change(lo, hi, d, b) == "regression"
                           for lo, hi, d, b in zip(rows["ci_low"], rows["ci_high"], rows["direction"], eff))
        n = int(aa["run"].nunique())
        gate_level[f"{bound:g}"] = {"comparisons": n, "false_alarms": flagged,
                                    "false_alarm_upper95": _upper95(flagged, n)}
    return {
        "runs": [r.record() for r in runs],
        "aa_runs": sum(1 for r in runs if r.slowdown_pct == 0 and r.tables),
        "ab_runs": sum(1 for r in runs if r.slowdown_pct and r.tables),
        "measurement_s_per_run": per_run,
        "measurement_s_per_decision": per_run * (min(plan.baseline_n, max(1, len(a_measure) - 1)) + 1),
        "gate_false_alarms": gate_level,
    }



def format_calibration(figures: pd.DataFrame, summary: Mapping[str, Any]) -> str:
    """The calibration as a plain-text table for a terminal."""
    from tabulate import tabulate

    det_cols = [c for c in figures.columns if c.startswith("detected_")]
    ratio_cols = [c for c in figures.columns if c.startswith("ratio_")]
    rows = []
    for r in figures.itertuples(index=False):
        d = r._asdict()
        name = d["metric"] + (f" [{d['case']}]" if d["case"] else "")
        rows.append([name, percent_text(d["bound"]), percent_text(d["run_sd"]),
                     f"{d['false_alarms']}/{d['aa_comparisons']} (<= {percent_text(d['false_alarm_upper95'])})",
                     percent_text(d["min_detectable"]),
                     *[f"{percent_text(d[c])} (x{d[r]:.2f})" if isinstance(d[r], float) and math.isfinite(d[r]) else percent_text(d[c])
                       for c, r in zip(det_cols, ratio_cols)],
                     percent_text(d["min_detected_injected"])])
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
                     f"A/A comparisons (95% upper bound {percent_text(g['false_alarm_upper95'])})")
    return "\n".join(lines)


def figures_records(figures: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-clean records (NaN -> None) for the store and ``--json``."""
    return jsonio.to_jsonable(figures.to_dict(orient="records"))

