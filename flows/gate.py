"""The regression gate: host -> launch -> warmup -> (flush -> measure)* -> paired -> compare -> validate -> verdict
-> record.

Deployment entrypoint: ``flows/gate.py:regression_gate``. ``measure_and_decide`` is the body the
gate and the re-run flow share: each task returns its stage's result and the flow passes the
results on, so Prefect's graph shows the real data flow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import flow

from servegate.config import GateConfig
from servegate.runstate import GateRun, resolve_config
from servegate.stages import MEASUREMENT_STAGES, STAGES, StageResult, check_config, spec
from servegate.tasks._stage import outcome
from servegate.tasks.capacity import capacity
from servegate.tasks.compare import compare
from servegate.tasks.flush import flush
from servegate.tasks.host import host
from servegate.tasks.launch import launch
from servegate.tasks.occupancy import occupancy
from servegate.tasks.one_batch import one_batch
from servegate.tasks.paired import paired
from servegate.tasks.quality import quality
from servegate.tasks.record import Recorded, record
from servegate.tasks.serving import serving
from servegate.tasks.validate import validate
from servegate.tasks.verdict import verdict
from servegate.tasks.warmup import warmup

MEASURE_TASKS = {t.name: t for t in (one_batch, serving, occupancy, quality, capacity, paired)}
if set(MEASURE_TASKS) != set(MEASUREMENT_STAGES) or {"launch", "warmup"} | set(MEASURE_TASKS) != set(STAGES):
    raise ImportError(f"servegate.stages declares {list(STAGES)} but the flow has tasks for "
                      f"{['launch', 'warmup', *MEASURE_TASKS]}")


def measure_and_decide(run: GateRun, stages: Sequence[str] = MEASUREMENT_STAGES,
                       carried: Sequence[StageResult] = ()) -> Recorded:
    """Measure ``stages`` (gate order) on a fresh worker, take ``carried`` results as they are, then
    compare, validate, decide and record. Stage failures are in their results (inconclusive, never
    pass); an interrupt propagates after the worker's tree is ended."""
    results = list(carried)
    on_gate_worker = [s for s in MEASUREMENT_STAGES if s in stages and spec(s).flushed]
    own_workers = [s for s in MEASUREMENT_STAGES if s in stages and spec(s).own_workers]
    teardown_errors: list[str] = []
    try:
        # Before anything is measured, on the gate's worker or the paired stage's own: a busy host
        # is inconclusive, never a measurement.
        checked = outcome(host(run, return_state=True))
        results.append(checked)
        if checked.status == "failed":
            why = "the host failed its checks (see host in stages.json)"
            on_gate_worker, own_workers = [], []
            results += [run.skipped(name, "skipped", why) for name in ("launch", "warmup", *stages)]
        elif run.uses_worker(on_gate_worker):
            launched = outcome(launch(run, return_state=True))
            warmed = outcome(warmup(run, launched, return_state=True))
            results += [launched, warmed]
            for name in on_gate_worker:
                flushed = outcome(flush(run, name, warmed, return_state=True))
                if flushed.status != "skipped":
                    results.append(flushed)
                results.append(outcome(MEASURE_TASKS[name](run, flushed, return_state=True)))
        else:
            why = "no enabled stage of this run measures the gate's worker (the paired stage launches its own)"
            results += [run.skipped("launch", "skipped", why), run.skipped("warmup", "skipped", why)]
        # A stage with its own workers runs alone: the gate's worker is stopped first.
        teardown_errors += run.stop_worker()
        for name in own_workers:
            results.append(outcome(MEASURE_TASKS[name](run, return_state=True)))
    finally:
        teardown_errors += run.close()
    results.append(outcome(compare(run, results, return_state=True)))
    validation = outcome(validate(run, results, return_state=True))
    decided = verdict(run, results, validation, teardown_errors)
    return record(run, results, validation, decided)


@flow(name="regression-gate", log_prints=False, validate_parameters=True)
def regression_gate(config: GateConfig | None = None, profile: str | None = None,
                    overrides: list[str] | None = None) -> dict[str, Any]:
    """Run one gate; returns the verdict (as JSON) and the run folder.

    Give a full ``config``, or a shipped ``profile`` name plus ``section.field=value``
    ``overrides`` (what deployments use: ``profile: smoke``).
    """
    config = resolve_config(config, profile, overrides)
    check_config(config)  # a stage that could not measure with this config fails before a worker starts
    run = GateRun.open(config)
    recorded = measure_and_decide(run)
    return {"verdict": recorded.verdict.model_dump(mode="json"), "run_dir": str(run.path), "paired": recorded.paired}
