"""Re-run measurement stage(s) of a recorded gate run as a new attempt (``servegate rerun``).

Deployment entrypoint: ``flows/rerun.py:rerun_stages``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from servegate.rerun import open_attempt, plan_rerun
from servegate.tasks.compare import compare
from servegate.tasks.flush import flush
from servegate.tasks.launch import launch
from servegate.tasks.occupancy import occupancy
from servegate.tasks.one_batch import one_batch
from servegate.tasks.record import record
from servegate.tasks.rerun import carry
from servegate.tasks.serving import serving
from servegate.tasks.validate import validate
from servegate.tasks.verdict import verdict
from servegate.tasks.warmup import warmup

MEASURE_TASKS = {"one_batch": one_batch, "serving": serving, "occupancy": occupancy}
try:  # the quality stage ships separately; re-runnable once its task exists
    from servegate.tasks.quality import quality

    MEASURE_TASKS["quality"] = quality
except ModuleNotFoundError:
    pass
RERUNNABLE: tuple[str, ...] = tuple(MEASURE_TASKS)


@flow(name="rerun-stage", log_prints=False, validate_parameters=True)
def rerun_stages(run_dir: str, stages: list[str], overrides: list[str] | None = None) -> dict[str, Any]:
    """Re-measure ``stages`` of the run in ``run_dir``, carry the rest, decide, record a new attempt.

    Returns the verdict (JSON), the attempt's folder, its run id in the store and the run it
    is an attempt of. Like the gate flow, stage failures are recorded and the flow goes on to
    tear down, validate and decide (inconclusive, never pass).
    """
    plan = plan_rerun(run_dir, stages, overrides, rerunnable=RERUNNABLE)
    run = open_attempt(plan)
    try:
        for outcome in plan.carried.values():
            carry(run, str(plan.source.path), outcome)
        launch(run, return_state=True)
        warmup(run, return_state=True)
        for stage in plan.stages:
            flush(run, stage, return_state=True)
            MEASURE_TASKS[stage](run, return_state=True)
    finally:
        run.close()
    compare(run, return_state=True)
    validate(run, return_state=True)
    recorded = record(run, verdict(run))
    return {"verdict": recorded.verdict.model_dump(mode="json"), "run_dir": str(run.path),
            "attempt_of": plan.attempt_of, "run_id": recorded.run_id, "stages": plan.stages,
            "carried": sorted(plan.carried)}
