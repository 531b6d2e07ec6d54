"""launch: start the worker with its memory budget (or attach to an external one) and wait until ready."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import perform


@task(name="launch", cache_policy=NO_CACHE)
def launch(run: GateRun) -> StageResult | State:
    def intro() -> str:
        worker = run.worker
        assert worker is not None  # the stage succeeded
        took = "" if worker.startup_s is None else f" after {worker.startup_s:.1f} s"
        return (f"worker `{run.config.worker.engine}` / `{run.config.worker.model}` ready at {worker.base_url}{took}"
                f"\n\nmemory budget: `{run.config.worker.budget().settings()}`")

    return perform(run, "launch", intro=intro)
