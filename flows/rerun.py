"""Re-run measurement stage(s) of a recorded gate run as a new attempt (``servegate rerun``).

Deployment entrypoint: ``flows/rerun.py:rerun_stages``. The attempt shares the gate's body
(``measure_and_decide``); the stages it does not re-measure are carried from the run's folder.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from servegate.flows.gate import measure_and_decide
from servegate.rerun import open_attempt, plan_rerun
from servegate.stages import RERUNNABLE
from servegate.tasks.rerun import carry


@flow(name="rerun-stage", log_prints=False, validate_parameters=True)
def rerun_stages(run_dir: str, stages: list[str], overrides: list[str] | None = None) -> dict[str, Any]:
    """Re-measure ``stages`` of the run in ``run_dir``, carry the rest, decide, record a new attempt.

    Returns the verdict (JSON), the attempt's folder, its run id in the store and the run it
    is an attempt of.
    """
    plan = plan_rerun(run_dir, stages, overrides, rerunnable=RERUNNABLE)
    run = open_attempt(plan)
    try:
        carried = [carry(run, str(plan.source.path), record) for record in plan.carried.values()]
    except BaseException:
        run.close()
        raise
    recorded = measure_and_decide(run, plan.stages, carried)
    return {"verdict": recorded.verdict.model_dump(mode="json"), "run_dir": str(run.path),
            "attempt_of": plan.attempt_of, "run_id": recorded.run_id, "stages": plan.stages,
            "carried": sorted(plan.carried), "paired": recorded.paired}
