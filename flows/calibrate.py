"""Calibrate a gate key: A/A and injected-slowdown gate runs, then false-alarm and power figures.

Deployment entrypoint: ``flows/calibrate.py:calibrate_gate``. Each calibration run is a real
``regression_gate`` subflow (launch, warm-up, flushes, measurement, teardown), so the figures
include everything a nightly run varies by: a fresh worker, its warm-up, the machine's state.
In paired mode (``plan["mode"] == "paired"``) each run is one paired decision of the same flow
(its own baseline and candidate workers, rounds until decided).
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import flow

from servegate.calibrate import (RUNS_FILE, Arm, CalibrationPlan, CalibrationRun, analyse, analyse_paired,
                                 figures_records, format_calibration, measurement_seconds, previous_runs,
                                 remaining_schedule, run_config, summarise, summarise_paired, worker_solo_config,
                                 worker_solo_effect, write_setup)
from servegate import jsonio
from servegate.config import GateConfig
from servegate.errors import ConfigError
from servegate.flows.gate import regression_gate
from servegate.paired.solo import DEFAULT_ARRIVALS, run_solo
from servegate.paired.zoo import build_tree
from servegate.runstate import resolve_config
from servegate.results import RunFolder
from servegate.history import GateKey, Store
from servegate.tasks._artifacts import publish

logger = logging.getLogger("servegate.flows.calibrate")


def _load_run(index: int, arm: Arm, result: dict[str, Any], plan: CalibrationPlan) -> CalibrationRun:
    run = CalibrationRun(index, arm.slowdown_pct, arm.regression, run_dir=result["run_dir"],
                         status=result["verdict"]["status"])
    folder = RunFolder.open(result["run_dir"])
    stages = folder.read_json("stages") if (Path(result["run_dir"]) / "stages.json").is_file() else {}
    run.measurement_s = measurement_seconds(stages, plan.mode)
    if result["verdict"].get("infra_errors"):
        # A run that broke (worker died, flush timed out) measures the failure, not the engine. (A paired
        # decision left undecided by its budget is an outcome: the verdict lists it under `undecided`.)
        logger.warning("calibration run %d (%s) was inconclusive, left out: %s", index, run.label,
                       "; ".join(result["verdict"]["infra_errors"])[:500])
        return run
    run.read_tables(plan.mode)
    return run


ZOO_DIR = "zoo"
"""The calibration folder's subfolder of the zoo regressions' built trees, one per member."""
SOLO_FILE = "solo.json"
"""Each zoo regression's solo effect, measured once per calibration (kept when it resumes)."""


def _solo_effects(out: Path, config: GateConfig, plan: CalibrationPlan, trees: dict[str, Path]) -> dict[str, Any]:
    """Each zoo regression's solo effect (:mod:`servegate.paired.solo`: its decode steps alternated with the
    baseline's in one process, on the paired workload, pinned where the candidate worker runs): what the
    gate's reading of it is held against. Measured before its first decision, kept in ``solo.json``; one
    measured on another batch shape than the harness's default (``arrivals``: the worker's own admission of
    a block since 2026-12-07; ragged or aligned before) is measured again, its old figure kept under
    ``earlier``."""
    path = out / SOLO_FILE
    solo: dict[str, Any] = jsonio.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    p = config.paired
    for name, tree in trees.items():
        earlier = solo.get(name, {})
        if earlier.get("arrivals") == DEFAULT_ARRIVALS:
            continue
        logger.info("solo effect of %s: its decode steps alternated with the baseline's in one process", name)
        worker = earlier.get("worker")
        solo[name] = run_solo(tree, model=config.worker.model, requests_per_block=p.requests_per_block,
                              input_len=p.input_len, output_len=p.output_len,
                              cpu=config.worker.cpus[0] if config.worker.cpus else None,
                              log_path=out / ZOO_DIR / f"{name}-solo.log")
        if earlier:
            solo[name]["earlier"] = {k: v for k, v in earlier.items() if k not in ("earlier", "per_process", "worker")}
        if worker is not None:
            solo[name]["worker"] = worker
        logger.info("solo effect of %s: x%.4f [%.4f, %.4f]", name, solo[name]["ratio"], solo[name]["ci_low"],
                    solo[name]["ci_high"])
        path.write_text(jsonio.dumps(solo, indent=True), encoding="utf-8")
    return solo


WORKER_SOLO_DIR = "worker-solo"
"""The calibration folder's subfolder of the zoo members' worker-solo runs."""


def _worker_solo_effects(out: Path, config: GateConfig, trees: dict[str, Path], solo: dict[str, Any]) -> None:
    """Each zoo regression's solo effect in the real workers (:func:`servegate.calibrate.worker_solo_config`:
    the baseline's and the member's worker, blocks alternated, never at the same time), under
    ``solo[name]["worker"]``; measured once per calibration and kept in ``solo.json``. A run that broke
    leaves it out (logged), as a broken decision is left out."""
    path = out / SOLO_FILE
    for name, tree in trees.items():
        if "worker" in solo.get(name, {}):
            continue
        logger.info("solo effect of %s in the workers: its blocks alternated with the baseline's, one at a time", name)
        result = regression_gate(config=worker_solo_config(config, name, tree, out / WORKER_SOLO_DIR))
        run_dir = Path(result["run_dir"])
        folder = RunFolder.open(run_dir)
        if result["verdict"].get("infra_errors") or not folder.has_table("paired_rounds"):
            logger.warning("the worker-solo run of %s broke, left out: %s", name,
                           "; ".join(result["verdict"].get("infra_errors") or ["no paired_rounds table"])[:500])
            continue
        effect = worker_solo_effect(folder.read_table("paired_rounds"))
        solo.setdefault(name, {})["worker"] = {**effect, "run_dir": str(run_dir)}
        logger.info("solo effect of %s in the workers: x%.4f [%.4f, %.4f] over %d rounds", name, effect["ratio"],
                    effect["ci_low"], effect["ci_high"], effect["rounds"])
        path.write_text(jsonio.dumps(solo, indent=True), encoding="utf-8")


@flow(name="calibrate-gate", log_prints=False, validate_parameters=True)
def calibrate_gate(config: GateConfig | None = None, profile: str | None = None, overrides: list[str] | None = None,
                   plan: dict[str, Any] | None = None, output_dir: str | None = None,
                   record: bool = True, resume: bool = False) -> dict[str, Any]:
    """Run the calibration plan (:class:`CalibrationPlan` fields) for a gate key; record and
    return its figures. The gate is a full ``config`` or a ``profile`` plus ``overrides``.

    ``resume``: continue the calibration in ``output_dir`` (one that was stopped, or one whose plan
    grows): its runs count, only the runs the plan still lacks are made, and the figures are those
    of all of them. The same gate config and plan are required (only the numbers of runs may grow).

    Returns ``{"key", "calibration_dir", "calibration_id", "plan", "summary", "figures"}``
    (figures as JSON records: one per metric, case and bound; in paired mode one per gated metric
    and arm, and ``summary["mode"] == "paired"``).
    """
    config = resolve_config(config, profile, overrides)
    the_plan = CalibrationPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in (plan or {}).items()})
    if resume and not output_dir:
        raise ConfigError("resuming a calibration needs the folder it is in (--output-dir)")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(output_dir) if output_dir else Path(config.output_dir) / f"calibration-{config.name}-{stamp}"
    runs: list[CalibrationRun] = previous_runs(out, config, the_plan, resume=resume)
    if not resume:
        out.mkdir(parents=True, exist_ok=True)
        write_setup(out, config, the_plan)
    key = GateKey.from_run({}, config.model_dump(mode="json", by_alias=True))  # what each run's manifest records
    order = remaining_schedule(the_plan, runs)
    if runs:
        logger.info("resuming the calibration in %s: %d run(s) made, %d to go", out, len(runs), len(order))
    total = len(runs) + len(order)
    trees = {name: build_tree(name, out / ZOO_DIR / name) for name in the_plan.regressions}
    solo = _solo_effects(out, config, the_plan, trees)
    _worker_solo_effects(out, config, trees, solo)
    for arm in order:
        index = len(runs)
        logger.info("calibration run %d/%d: %s", index + 1, total, "A (unchanged)" if arm.unchanged else arm.label)
        result = regression_gate(config=run_config(config, arm, out / "runs", the_plan.mode,
                                                   trees.get(arm.regression)))
        run = _load_run(index, arm, result, the_plan)
        runs.append(run)
        (out / RUNS_FILE).write_text(jsonio.dumps([r.record() for r in runs], indent=True))
    if the_plan.mode == "paired":
        figures, decisions = analyse_paired(runs, the_plan, solo)
        summary = summarise_paired(runs, figures, decisions, the_plan)
        decisions.to_csv(out / "decisions.csv", index=False)
    else:
        figures, comparisons, _ = analyse(runs, the_plan, tail_bound=config.compare.tail_bound)
        summary = summarise(runs, figures, comparisons, the_plan, tail_bound=config.compare.tail_bound)
        comparisons.drop(columns=["baseline_runs"]).to_csv(out / "comparisons.csv", index=False)
    figures.to_csv(out / "calibration.csv", index=False)
    records = figures_records(figures)
    calibration_id = None
    if record and config.store.enabled:
        with Store(config.store.url) as store:
            calibration_id = store.record_calibration(key, plan=the_plan.as_dict(), summary=summary, metrics=records)
    doc = {"key": str(key), "calibration_dir": str(out), "calibration_id": calibration_id, "plan": the_plan.as_dict(),
           "summary": summary, "figures": records}
    (out / "calibration.json").write_text(jsonio.dumps(doc, indent=True))
    publish(config.name, "calibration", f"# calibration of {key}\n\n```\n{format_calibration(figures, summary)}\n```",
            description=f"servegate calibration of {key}")
    return doc
