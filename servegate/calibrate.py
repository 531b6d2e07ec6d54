"""``servegate calibrate``: how far this gate's relative verdicts can be trusted, measured.

A relative check is only as good as its false-alarm rate and its power. Calibration measures
both on the machine and workload of one gate key, by running the gate itself:

- **A/A**: ``aa_runs`` gate runs of an unchanged worker. Each A run after the first is
  compared with the A runs before it (the last ``baseline_n``, as a nightly is with its last
  passing runs); every gated ``regression`` decision is a false alarm.
- **A/B**: ``runs_per_slowdown`` gate runs per injected slowdown (the embedded worker's
  ``--fault-decode-compute-pct P``: every decode forward computes P % longer, on the CPU as a
  slower kernel would; a sleep would show up to twice its size where the paired stage's two
  workers share a core),
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

**Resuming.** A calibration takes hours. Its folder holds ``calibration-setup.json`` (the gate
config, secrets redacted, and the plan; written before the first run) and ``runs.json`` (every run
made so far, rewritten after each). ``servegate calibrate ... --output-dir DIR --resume`` continues
it: the runs made count (their tables are read again from their folders), only the runs the plan
still lacks are made, in the plan's order (:func:`remaining_schedule`), and the figures are those of
all of them. It refuses another gate config or plan (only the numbers of runs may grow) and a new
calibration over an existing one, before anything runs (:func:`previous_runs`).

**Paired mode** (``CalibrationPlan.mode == "paired"``, ``servegate calibrate --paired``): each run
is one decision of the config's ``paired`` stage (its own baseline and candidate workers, rounds
until decided or out of budget; the other measurement stages are off), made by the same gate
flow as any paired gate. A/A decisions measure the config as is (baseline and candidate must be
the same build); a slowdown decision gives the decode fault to the candidate only. A confirmation
(``paired.confirm``) is part of a decision and runs; the profile of a confirmed regression
(``paired.profile``) is a diagnosis and does not. The bound is
``paired.bound``, the one the stopping rule decided against: a sequential decision cannot be
re-decided at another bound after it stopped. Per gated metric and arm (A/A, each slowdown):

=========================== ===============================================================
``decisions``               decisions that produced a ``paired`` table (broken runs left out)
``regressions``             of them decided ``regression`` (A/A: false alarms; else detections)
``regression_rate``         with its exact two-sided 95 % interval ``rate_low95``/``rate_high95``
``false_alarm_upper95``     A/A only: exact one-sided 95 % upper bound of the false-alarm rate
``median_rounds``           rounds and measurement seconds (first round to decision) to a
``median_measure_s``        decision, or to the budget when undecided
``median_ratio``            the metric's candidate/baseline ratio the arm measured, and the ITL
``median_itl_ratio``        ratio (what the injected slowdown did to the metric the gate reads)
=========================== ===============================================================

The summary (``"mode": "paired"``) keeps the history summary's keys where they mean the same
(``aa_runs``, ``ab_runs``, ``gate_false_alarms`` at the paired bound, ``measurement_s_per_decision``)
and every decision (verdict, per-metric decision, ratio, interval, rounds, seconds) under ``runs``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from servegate import jsonio
from servegate.calibration_plan import CalibrationMode, CalibrationPlan
from servegate.compare import DEFAULT_TAIL_BOUND, compare_tables, decide_change, estimate_run_noise
from servegate.config import GateConfig
from servegate.errors import ConfigError, InfraError, InsufficientDataError
from servegate.gated_metrics import GATED_METRICS, GatedMetric
from servegate.render import percent_text
from servegate.stages import MEASUREMENT_STAGES
from servegate.tables import TABLE_STAGE

__all__ = [
    "CalibrationPlan",
    "CalibrationRun",
    "schedule",
    "remaining_schedule",
    "previous_runs",
    "write_setup",
    "run_config",
    "analyse",
    "summarise",
    "paired_decisions",
    "analyse_paired",
    "summarise_paired",
    "format_calibration",
    "measured_tables",
    "COMPARED_STAGES",
    "COMPARED_TABLES",
    "PAIRED_TABLES",
]

CALIBRATED_METRICS: tuple[GatedMetric, ...] = tuple(m for m in GATED_METRICS if not m.report_only)
"""The metrics a calibration measures: report-only ones (start-up, memory, cost) never gate, so
their false-alarm and detection rates would describe nothing the verdict does."""
COMPARED_TABLES: tuple[str, ...] = tuple(dict.fromkeys(m.table for m in CALIBRATED_METRICS))
"""The tables the baseline comparison reads: all a calibration run needs to keep."""
COMPARED_STAGES: tuple[str, ...] = tuple(s for s in MEASUREMENT_STAGES if s in {TABLE_STAGE[t] for t in COMPARED_TABLES})
"""Stages whose wall time counts as measurement: those producing compared tables (launch,
warm-up, flushes and quality do not)."""
PAIRED_TABLES: tuple[str, ...] = ("paired",)
"""What a paired calibration run keeps: the decision per metric (its rounds are in the run folder)."""
SLOWDOWN_FLAG = "--fault-decode-compute-pct"
DETECTION_TARGET = 0.95


@dataclass(frozen=True)
class Arm:
    """What a calibration run's candidate is: unchanged (A), slowed by the synthetic decode fault
    (``slowdown_pct``), or a real code regression of the zoo (``regression``, :mod:`servegate.paired.zoo`)."""

    slowdown_pct: float = 0.0
    regression: str = ""

    @property
    def unchanged(self) -> bool:
        return not self.slowdown_pct and not self.regression

    @property
    def label(self) -> str:
        if self.regression:
            return self.regression
        return "A" if self.unchanged else f"+{self.slowdown_pct:g}%"


@dataclass
class CalibrationRun:
    """One gate run made by calibration."""

    index: int
    slowdown_pct: float  # 0 for an A run and for a zoo regression
    regression: str = ""  # the zoo member the candidate runs, if any
    run_dir: str = ""
    status: str = ""  # the run's own verdict (absolute checks)
    measurement_s: float = math.nan
    tables: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    @property
    def arm(self) -> Arm:
        return Arm(self.slowdown_pct, self.regression)

    @property
    def label(self) -> str:
        return self.arm.label

    def record(self) -> dict[str, Any]:
        """The run as calibration records it (``runs.json``, the summary's ``runs``). ``kept``: its
        tables count (a run that broke is left out of the figures)."""
        return {"index": self.index, "slowdown_pct": self.slowdown_pct, "regression": self.regression,
                "status": self.status, "run_dir": self.run_dir, "measurement_s": self.measurement_s,
                "kept": bool(self.tables)}

    def read_tables(self, mode: CalibrationMode) -> None:
        """Read the tables the analysis of ``mode`` needs from the run's folder."""
        from servegate.results import RunFolder

        folder = RunFolder.open(self.run_dir)
        self.tables = {name: folder.read_table(name) for name in measured_tables(mode) if folder.has_table(name)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], mode: CalibrationMode) -> "CalibrationRun":
        """A run of an earlier invocation (``runs.json``), its tables read again when they counted."""
        run = cls(int(record["index"]), float(record["slowdown_pct"]), str(record.get("regression") or ""),
                  run_dir=str(record["run_dir"]),
                  status=str(record["status"]), measurement_s=float(record["measurement_s"]))
        if record.get("kept"):
            try:
                run.read_tables(mode)
            except (ConfigError, OSError) as exc:
                raise ConfigError(f"calibration run {run.index} ({run.label}) cannot be read again from "
                                  f"{run.run_dir}: {exc}. Its folder must stay where the calibration put it "
                                  f"to resume; or start a new calibration in another --output-dir") from exc
        return run


def plan_arms(plan: CalibrationPlan) -> list[Arm]:
    """The plan's arms: A, each slowdown, each zoo regression."""
    return [Arm(), *(Arm(float(p)) for p in plan.slowdowns_pct), *(Arm(regression=n) for n in plan.regressions)]


def schedule(plan: CalibrationPlan) -> list[Arm]:
    """The arm of each run in order: two A runs (history mode: the first comparison needs an earlier A
    run; paired decisions stand alone), then interleaved rounds of A and every other arm."""
    order = [Arm()] * min(2 if plan.mode == "history" else 0, plan.aa_runs)
    remaining_a = plan.aa_runs - len(order)
    changed = plan_arms(plan)[1:]
    rounds = max(remaining_a, plan.runs_per_slowdown if changed else 0)
    for r in range(rounds):
        if r < remaining_a:
            order.append(Arm())
        if r < plan.runs_per_slowdown:
            order.extend(changed)
    return order


def remaining_schedule(plan: CalibrationPlan, done: Sequence[CalibrationRun]) -> list[Arm]:
    """The plan's schedule less the runs already made (a resumed calibration): per arm, as many of
    its entries as runs of it are done are dropped, first ones first, so the rest keeps its order."""
    left = Counter(run.arm for run in done)
    todo = []
    for arm in schedule(plan):
        if left[arm] > 0:
            left[arm] -= 1
        else:
            todo.append(arm)
    return todo


SETUP_FILE = "calibration-setup.json"
"""A calibration folder's record of what it calibrates (the gate config, secrets redacted, and the
plan), written before its first run: what ``--resume`` checks a continuation against."""
RUNS_FILE = "runs.json"
_UNMEASURED_FIELDS = ("output_dir", "store")
"""Config fields that do not change what a calibration run measures (where it is written and
recorded): a resumed calibration may differ in them."""
_GROWABLE_PLAN_FIELDS = ("aa_runs", "slowdowns_pct", "runs_per_slowdown", "regressions")


def _machine() -> dict[str, Any]:
    """What a calibration's figures belong to besides the config: the CPU (its model and count). The same
    change costs another share of a decode step on another CPU (linears-unpacked: +10.6 % solo on an AMD
    EPYC, +3-5 % on an Intel Xeon with AMX), and its noise differs."""
    from servegate.provenance import collect_host_info

    host = collect_host_info()
    return {"cpu_model": host.cpu_model, "cpu_count_logical": host.cpu_count_logical}


def _setup(config: GateConfig, plan: CalibrationPlan) -> dict[str, Any]:
    dump = config.model_dump(mode="json", by_alias=True)  # secrets redacted (servegate.config)
    setup = {"config": {k: v for k, v in dump.items() if k not in _UNMEASURED_FIELDS}, "plan": asdict(plan),
             "machine": _machine()}
    return jsonio.loads(jsonio.dumps(setup))  # as the file reads back (inf -> null): compared with it


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in _differences(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))]
    return [] if old == new else [f"{path or 'value'} ({old!r} then, {new!r} now)"]


def write_setup(out: Path, config: GateConfig, plan: CalibrationPlan) -> None:
    """Record what the calibration in ``out`` calibrates, for a later ``--resume``."""
    (out / SETUP_FILE).write_text(jsonio.dumps(_setup(config, plan), indent=True), encoding="utf-8")


def previous_runs(out: Path, config: GateConfig, plan: CalibrationPlan, *, resume: bool) -> list[CalibrationRun]:
    """The runs an earlier invocation made in ``out`` that this one continues from (``resume``).

    Refuses (:class:`ConfigError`, before any run) to write a new calibration over an existing
    one, to resume a folder that holds none, and to resume with another gate config or plan than
    the calibration was started with, or on another machine (CPU model or count): only the number of
    decisions may grow (more A/A runs, more runs per slowdown, another slowdown), so that the figures stay
    those of one calibration on one machine."""
    setup_file, runs_file = out / SETUP_FILE, out / RUNS_FILE
    if not resume:
        if setup_file.exists() or runs_file.exists():
            raise ConfigError(f"{out} already holds a calibration ({RUNS_FILE if runs_file.exists() else SETUP_FILE}); "
                              f"continue it with --resume, or give another --output-dir")
        return []
    if not setup_file.is_file():
        raise ConfigError(f"nothing to resume in {out}: it has no {SETUP_FILE} (every calibration writes it before "
                          f"its first run); start one there without --resume")
    try:
        saved = jsonio.loads(setup_file.read_text(encoding="utf-8"))
        records = jsonio.loads(runs_file.read_text(encoding="utf-8")) if runs_file.is_file() else []
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the calibration to resume in {out}: {exc}") from exc
    now = _setup(config, plan)

    def fixed(plan_fields: Any) -> Any:  # the plan less the numbers of runs, which may grow
        return {k: v for k, v in plan_fields.items() if k not in _GROWABLE_PLAN_FIELDS} \
            if isinstance(plan_fields, dict) else plan_fields

    changed = (_differences(saved.get("config"), now["config"])
               + _differences(fixed(saved.get("plan")), fixed(now["plan"])))
    if changed:
        raise ConfigError(f"the calibration in {out} was started with another gate config or plan; it differs in "
                          f"{'; '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}. Resume it with the same "
                          f"profile, --set options and --paired as it was started with (only --aa-runs, --slowdowns "
                          f"and --runs-per-slowdown may grow), or start a new one in another --output-dir")
    if saved.get("machine") not in (None, now["machine"]):  # folders from before 2026-12-07 did not record it
        raise ConfigError(f"the calibration in {out} was made on another machine "
                          f"({'; '.join(_differences(saved['machine'], now['machine']))}); its figures (noise, what "
                          f"a regression costs) are that machine's. Resume it there, or start a new one on this "
                          f"machine in another --output-dir")
    runs = [CalibrationRun.from_record(r, plan.mode) for r in records]
    stray = sorted({r.arm.label for r in runs if r.arm not in set(plan_arms(plan))})
    if stray:
        raise ConfigError(f"the calibration in {out} has runs of arms {stray} that this plan "
                          f"({[a.label for a in plan_arms(plan)]}) leaves out; name them in --slowdowns or "
                          f"--regressions to resume it")
    return runs


def check_arm(config: GateConfig, arm: Arm, mode: CalibrationMode) -> None:
    """``ConfigError`` when ``arm`` cannot run with ``config``: a synthetic slowdown or a zoo regression
    needs the embedded worker (its decode fault, its source), a zoo regression a paired calibration."""
    if arm.slowdown_pct and config.worker.engine != "embedded":
        raise ConfigError(f"injected slowdowns need the embedded worker's decode fault; engine "
                          f"{config.worker.engine!r} has none. Calibrate A/A only with --slowdowns ''")
    if arm.regression:
        from servegate.paired.zoo import zoo_regression

        zoo_regression(arm.regression)
        if config.worker.engine != "embedded" or mode != "paired":
            raise ConfigError(f"the zoo regression {arm.regression!r} is a change of the embedded worker's code, "
                              f"decided by the paired stage: calibrate it with --paired and the embedded worker "
                              f"(e.g. --profile smoke-ab), not engine {config.worker.engine!r} in {mode} mode")
        if "PYTHONPATH" in config.worker.env:
            raise ConfigError("a zoo regression puts its own tree on the candidate's PYTHONPATH; the config already "
                              "sets worker.env.PYTHONPATH: calibrate an unchanged worker (remove it)")


def run_config(config: GateConfig, arm: Arm, output_dir: Path, mode: CalibrationMode = "history",
               tree: Path | None = None) -> GateConfig:
    """The gate config of one calibration run: nothing recorded, and for an A/B run the decode
    slowdown appended to the (candidate) worker's launch arguments, or for a zoo regression its
    ``tree`` (:func:`servegate.paired.zoo.build_tree`) first on the candidate's ``PYTHONPATH``. History
    mode measures the compared stages only; paired mode the paired stage only."""
    check_arm(config, arm, mode)
    if arm.regression and tree is None:
        raise ConfigError(f"the zoo regression {arm.regression!r} needs its built tree "
                          "(servegate.paired.zoo.build_tree)")
    slowdown_pct = arm.slowdown_pct
    data = config.model_dump(by_alias=True)
    data["output_dir"] = str(output_dir)
    data["compare"]["enabled"] = False
    data["store"]["enabled"] = False
    data["report"]["html"] = False
    data["quality"]["enabled"] = False  # quality is an absolute check, never compared with a baseline
    if mode == "paired":
        _check_paired_aa(config)
        data["paired"]["enabled"] = True
        # A profile of a confirmed regression is a diagnosis for a person; a calibration decision is a
        # count. Its confirmation stays (it is part of the decision), its profiled block does not.
        data["paired"]["profile"] = False
        for stage in ("one_batch", "serving", "occupancy", "capacity"):  # the gate's own worker is not launched
            data[stage]["enabled"] = False
    else:
        data["paired"]["enabled"] = False  # its table is not what a history comparison reads
    args = [a for a in data["worker"]["extra_args"]]
    if SLOWDOWN_FLAG in args:
        raise ConfigError(f"the config already sets {SLOWDOWN_FLAG} in worker.extra_args; calibrate an "
                          f"unchanged worker (remove it)")
    if slowdown_pct:
        args += [SLOWDOWN_FLAG, f"{slowdown_pct:g}"]
    data["worker"]["extra_args"] = args
    if tree is not None:
        data["worker"]["env"] = {**data["worker"]["env"], "PYTHONPATH": str(tree)}
    return GateConfig.model_validate(data)


WORKER_SOLO_ROUNDS = 20
"""Rounds of a zoo member's worker-solo effect (:func:`worker_solo_config`): ~70 s of blocks here."""


def worker_solo_config(config: GateConfig, name: str, tree: Path, output_dir: Path,
                       rounds: int = WORKER_SOLO_ROUNDS) -> GateConfig:
    """The gate config that measures zoo member ``name``'s solo effect in the real workers: the paired stage
    in interleaved mode (each block alone on the workers' CPUs, never the two at once), one pair of
    instances for all ``rounds`` (warmed by ``paired.warmup_blocks``), every round measured, nothing
    confirmed. What a build costs served alone, by the worker that serves it: the in-process harness
    (:mod:`servegate.paired.solo`) steps the scheduler without the worker's process around it, and read
    attention-eager x1.02-1.03 where this reads x1.07 (docs/paired.md)."""
    cfg = run_config(config, Arm(regression=name), output_dir, "paired", tree)
    data = cfg.model_dump(by_alias=True)
    data["paired"].update({"mode": "interleaved", "rounds_per_worker": rounds, "min_rounds": rounds,
                           "max_rounds": rounds, "min_units": 3, "confirm": False, "profile": False,
                           "max_measure_s": max(float(data["paired"]["max_measure_s"]), 900.0)})
    data["stage_max_s"] = max(float(data["stage_max_s"]), 1200.0)
    return GateConfig.model_validate(data)


def worker_solo_effect(rounds: pd.DataFrame, metric: str = "itl_median_ms",
                       confidence: float = 0.95) -> dict[str, Any]:
    """The candidate/baseline ratio of ``metric`` over the rounds of a :func:`worker_solo_config` run
    (its ``paired_rounds`` table): the geometric mean of the rounds' ratios with a t interval, and each
    side's median."""
    rows = rounds[rounds["metric"] == metric]
    logs = np.log(rows["b_value"].to_numpy(dtype=float) / rows["a_value"].to_numpy(dtype=float))
    logs = logs[np.isfinite(logs)]
    if logs.size < 3:
        raise InsufficientDataError(f"{logs.size} rounds of {metric} in the worker-solo run (need 3)")
    mean, sd = float(logs.mean()), float(logs.std(ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, logs.size - 1)) * sd / math.sqrt(logs.size)
    return {"ratio": math.exp(mean), "ci_low": math.exp(mean - half), "ci_high": math.exp(mean + half),
            "rounds": int(logs.size), "sd_log": sd, "metric": metric,
            "baseline_median": float(rows["a_value"].median()), "candidate_median": float(rows["b_value"].median())}


_BUILD_FIELDS = ("engine", "model", "python", "extra_args", "env", "memory_profile", "memory",
                 "speculative_num_draft_tokens", "enable_metrics")
"""What makes a worker the build it is (where it listens, its CPUs and its key do not)."""


def _check_paired_aa(config: GateConfig) -> None:
    # A/A means the same build on both sides: a release config (old baseline, new candidate)
    # would measure the change itself, and every "false alarm" could be a real regression.
    if config.baseline is None:
        raise ConfigError("paired calibration needs a baseline worker next to the candidate: use a config with "
                          "[baseline] (e.g. --profile smoke-ab)")
    a = config.baseline.model_dump(include=set(_BUILD_FIELDS))
    b = config.worker.model_dump(include=set(_BUILD_FIELDS))
    differ = [f for f in _BUILD_FIELDS if a.get(f) != b.get(f)]
    if differ:
        raise ConfigError(f"paired calibration measures A/A decisions, so baseline and worker must be the same "
                          f"build; they differ in {differ} (baseline {[a[f] for f in differ]}, worker "
                          f"{[b[f] for f in differ]}). Calibrate with both set alike (--set worker.<field>=... or "
                          f"baseline.<field>=...)")


def measured_tables(mode: CalibrationMode) -> tuple[str, ...]:
    """The tables a calibration run of ``mode`` keeps for the analysis."""
    return PAIRED_TABLES if mode == "paired" else COMPARED_TABLES


def measurement_seconds(stages: Mapping[str, Mapping[str, Any]], mode: CalibrationMode = "history") -> float:
    """Wall time of the measurement stages of one run (from its ``stages.json``): the compared
    stages, or in paired mode the paired stage (which includes its workers' launches)."""
    counted = ("paired",) if mode == "paired" else COMPARED_STAGES
    return float(sum(float(s.get("duration_s") or 0.0) for name, s in stages.items()
                     if name in counted and s.get("status") == "ok"))


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


def _exact95(k: int, n: int) -> tuple[float, float]:
    """The two-sided 95 % Clopper-Pearson interval of a rate k/n."""
    if not n:
        return math.nan, math.nan
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return float(ci.low), float(ci.high)


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
            metrics: Sequence[GatedMetric] = CALIBRATED_METRICS, tail_bound: float = DEFAULT_TAIL_BOUND,
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
        "mode": "history",
        "runs": [r.record() for r in runs],
        "aa_runs": sum(1 for r in runs if r.slowdown_pct == 0 and r.tables),
        "ab_runs": sum(1 for r in runs if r.slowdown_pct and r.tables),
        "measurement_s_per_run": per_run,
        "measurement_s_per_decision": per_run * (min(plan.baseline_n, max(1, len(a_measure) - 1)) + 1),
        "gate_false_alarms": gate_level,
    }



# ---- paired mode ----------------------------------------------------------------------------
PAIRED_DECISION_COLUMNS = ["run", "slowdown_pct", "regression", "arm", "status", "gate_decision", "metric", "gated",
                           "direction", "decision", "ratio", "ci_low", "ci_high", "bound", "rounds", "measure_s",
                           "stopped_because", "itl_ratio"]
"""``paired_decisions``: one row per calibration decision and paired metric (``decision`` is what
the interval says, gated or not; ``gate_decision`` the run's over its gated metrics)."""


def _gate_decision(decisions: Sequence[str]) -> str:
    """A paired run's decision over its gated metrics, as its verdict reads them: any regression
    fails it, any undecided metric leaves it inconclusive, else it passes."""
    if any(d == "regression" for d in decisions):
        return "regression"
    if not decisions or any(d == "inconclusive" for d in decisions):
        return "inconclusive"
    return "pass"


def paired_decisions(runs: Sequence[CalibrationRun]) -> pd.DataFrame:
    """Every paired decision's rows, from each run's ``paired`` table (runs without one, left out
    because they broke, give none)."""
    rows = []
    for run in runs:
        table = run.tables.get("paired")
        if table is None or table.empty:
            continue
        itl = table.loc[table["metric"] == "itl_median_ms", "ratio"]
        itl_ratio = float(itl.iloc[0]) if len(itl) else math.nan
        gate_decision = _gate_decision(list(table.loc[table["gated"].astype(bool), "paired_decision"]))
        for r in table.itertuples(index=False):
            rows.append({"run": run.index, "slowdown_pct": run.slowdown_pct, "regression": run.regression,
                         "arm": run.label, "status": run.status,
                         "gate_decision": gate_decision, "metric": r.metric, "gated": bool(r.gated),
                         "direction": r.direction, "decision": r.paired_decision, "ratio": float(r.ratio),
                         "ci_low": float(r.ci_low), "ci_high": float(r.ci_high), "bound": float(r.bound),
                         "rounds": int(r.rounds), "measure_s": float(r.measure_s),
                         "stopped_because": r.stopped_because, "itl_ratio": itl_ratio})
    return pd.DataFrame(rows, columns=PAIRED_DECISION_COLUMNS)


def _median(values: pd.Series) -> float:
    vals = values.to_numpy(dtype=float)
    vals = vals[np.isfinite(vals)]
    return float(np.median(vals)) if vals.size else math.nan


def _of_arm(frame: pd.DataFrame, arm: Arm) -> pd.DataFrame:
    """The rows of ``frame`` (with ``slowdown_pct`` and ``regression`` columns) that belong to ``arm``."""
    return frame[(frame["slowdown_pct"] == arm.slowdown_pct) & (frame["regression"] == arm.regression)]


def analyse_paired(runs: Sequence[CalibrationRun], plan: CalibrationPlan,
                   solo: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(figures, decisions)`` of a paired calibration (module docstring): figures one row per
    gated metric and arm, decisions one row per decision and metric. ``solo``: per zoo regression its
    solo effect (:class:`servegate.paired.solo.SoloEffect` as a dict), shown beside what the gate read:
    ``read_of_solo`` is the metric's median log ratio over the solo log ratio (1: read at its solo size)."""
    decisions = paired_decisions(runs)
    solo = solo or {}
    aa_rows = _of_arm(decisions, Arm()) if len(decisions) else decisions
    a_runs = aa_rows["run"].nunique() if len(aa_rows) else 0
    if a_runs < 1:
        raise InfraError("no A/A paired decision produced a paired table; calibration needs at least 1 (see the "
                         "runs' verdicts and their worker.log / baseline-worker.log files, then calibrate again)")
    gated = decisions[decisions["gated"]]
    figures = []
    for metric, of_metric in gated.groupby("metric", sort=False):
        for arm in plan_arms(plan):
            rows = _of_arm(of_metric, arm)
            n, k = len(rows), int((rows["decision"] == "regression").sum())
            low, high = _exact95(k, n)
            effect = solo.get(arm.regression, {}) if arm.regression else {}
            solo_ratio = float(effect.get("ratio", math.nan))
            worker = effect.get("worker", {})
            worker_ratio = float(worker.get("ratio", math.nan))
            median_ratio = _median(rows["ratio"])
            figures.append({
                "metric": metric, "case": "", "statistic": "paired", "direction": of_metric["direction"].iloc[0],
                "bound": float(of_metric["bound"].iloc[0]), "arm": "A/A" if arm.unchanged else arm.label,
                "slowdown_pct": arm.slowdown_pct, "regression": arm.regression, "decisions": n, "regressions": k,
                "no_change": int((rows["decision"] == "no_change").sum()),
                "improvements": int((rows["decision"] == "improvement").sum()),
                "inconclusive": int((rows["decision"] == "inconclusive").sum()),
                "regression_rate": k / n if n else math.nan, "rate_low95": low, "rate_high95": high,
                "false_alarm_upper95": _upper95(k, n) if arm.unchanged else math.nan,
                "median_rounds": _median(rows["rounds"]), "median_measure_s": _median(rows["measure_s"]),
                "median_ratio": median_ratio, "median_itl_ratio": _median(rows["itl_ratio"]),
                "solo_ratio": solo_ratio, "solo_ci_low": float(effect.get("ci_low", math.nan)),
                "solo_ci_high": float(effect.get("ci_high", math.nan)),
                "read_of_solo": _read_of(median_ratio, solo_ratio),
                "worker_solo_ratio": worker_ratio, "worker_solo_ci_low": float(worker.get("ci_low", math.nan)),
                "worker_solo_ci_high": float(worker.get("ci_high", math.nan)),
                "read_of_worker_solo": _read_of(median_ratio, worker_ratio),
            })
    return pd.DataFrame(figures), decisions


def _read_of(read: float, solo: float) -> float:
    """The gate's read ratio as a share of a solo effect, in log terms (1: read at its solo size)."""
    return math.log(read) / math.log(solo) if solo > 0 and solo != 1 and read > 0 else math.nan


def summarise_paired(runs: Sequence[CalibrationRun], figures: pd.DataFrame, decisions: pd.DataFrame,
                     plan: CalibrationPlan) -> dict[str, Any]:
    """Gate-level figures of a paired calibration, with the history summary's keys where they mean
    the same, and every decision under ``runs``."""
    per_run = decisions.drop_duplicates("run").set_index("run") if len(decisions) else pd.DataFrame()
    records = []
    for run in runs:
        rec = run.record()
        if run.index in per_run.index:
            first = per_run.loc[run.index]
            rows = decisions[(decisions["run"] == run.index) & decisions["gated"]]
            rec.update({"gate_decision": first["gate_decision"], "rounds": int(first["rounds"]),
                        "measure_s": float(first["measure_s"]), "stopped_because": first["stopped_because"],
                        "itl_ratio": float(first["itl_ratio"]),
                        "metrics": {r.metric: {"decision": r.decision, "ratio": r.ratio, "ci_low": r.ci_low,
                                               "ci_high": r.ci_high} for r in rows.itertuples(index=False)}})
        else:
            rec["gate_decision"] = None  # broke: left out
        records.append(rec)
    bound = float(decisions["bound"].iloc[0]) if len(decisions) else math.nan
    aa = _of_arm(per_run, Arm()) if len(per_run) else per_run
    n_aa, k_aa = len(aa), int((aa["gate_decision"] == "regression").sum()) if len(aa) else 0
    detections = {}
    for arm in plan_arms(plan)[1:]:
        of_arm = _of_arm(per_run, arm) if len(per_run) else per_run
        k = int((of_arm["gate_decision"] == "regression").sum()) if len(of_arm) else 0
        low, high = _exact95(k, len(of_arm))
        key = arm.regression or f"{arm.slowdown_pct:g}"
        detections[key] = {"decisions": len(of_arm), "detections": k, "rate_low95": low, "rate_high95": high}
    return {
        "mode": "paired",
        "bound": bound,
        "runs": records,
        "aa_runs": n_aa,
        "ab_runs": int(((per_run["slowdown_pct"] > 0) | (per_run["regression"] != "")).sum()) if len(per_run) else 0,
        "left_out": sum(1 for r in records if r["gate_decision"] is None),
        "measurement_s_per_run": float(np.median([r.measurement_s for r in runs if math.isfinite(r.measurement_s)]
                                                 or [math.nan])),
        "measurement_s_per_decision": _median(aa["measure_s"]) if len(aa) else math.nan,
        "gate_false_alarms": {f"{bound:g}": {"comparisons": n_aa, "false_alarms": k_aa,
                                             "false_alarm_upper95": _upper95(k_aa, n_aa)}},
        "gate_detections": detections,
    }


def _format_paired(figures: pd.DataFrame, summary: Mapping[str, Any]) -> str:
    from tabulate import tabulate

    rows = []
    for r in figures.itertuples(index=False):
        rate = (f"{r.regressions}/{r.decisions} = {percent_text(r.regression_rate)} "
                f"[{percent_text(r.rate_low95)}, {percent_text(r.rate_high95)}]")
        def effect(ratio: Any, read: Any) -> str:
            return (f"x{ratio:.4f}, read {read:.2f} of it" if isinstance(ratio, float) and math.isfinite(ratio)
                    else "-")

        rows.append([r.metric, r.arm, rate, percent_text(r.false_alarm_upper95), f"{r.inconclusive}",
                     f"{r.median_rounds:g}", f"{r.median_measure_s:.0f}", f"x{r.median_ratio:.4f}",
                     f"x{r.median_itl_ratio:.4f}",
                     effect(getattr(r, "worker_solo_ratio", math.nan), getattr(r, "read_of_worker_solo", math.nan)),
                     effect(getattr(r, "solo_ratio", math.nan), getattr(r, "read_of_solo", math.nan))])
    headers = ["metric", "arm", "regressions (95% CI)", "false-alarm upper95", "undecided", "median rounds",
               "median s", "ratio", "ITL ratio", "solo in the worker", "solo decode step"]
    lines = [tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True), ""]
    lines.append(f"paired decisions at bound {percent_text(summary['bound'])}: {summary['aa_runs']} A/A, "
                 f"{summary['ab_runs']} with a slowdown or regression, {summary['left_out']} left out (broke); "
                 f"measurement per "
                 f"A/A decision {summary['measurement_s_per_decision']:.0f} s (median, first round to decision)")
    for bound, g in summary["gate_false_alarms"].items():
        lines.append(f"gate-level false alarms at bound {percent_text(float(bound))}: {g['false_alarms']}/"
                     f"{g['comparisons']} A/A decisions (95% upper bound {percent_text(g['false_alarm_upper95'])})")
    return "\n".join(lines)


def format_calibration(figures: pd.DataFrame, summary: Mapping[str, Any]) -> str:
    """The calibration as a plain-text table for a terminal (either mode)."""
    from tabulate import tabulate

    if summary.get("mode") == "paired":
        return _format_paired(figures, summary)

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

