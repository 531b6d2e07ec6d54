"""launch: start the worker with its memory budget (or attach to an external one) and wait until ready."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._artifacts import publish
from servegate.tasks._stage import perform


@task(name="launch", cache_policy=NO_CACHE)
def launch(run: GateRun) -> StageResult | State:
    result = perform(run, "launch")
    if run.worker is not None:
        took = "" if run.worker.startup_s is None else f" after {run.worker.startup_s:.1f} s"
        publish(run.config.name, "launch",
                f"# launch\nworker `{run.config.worker.engine}` / `{run.config.worker.model}` ready at "
                f"{run.worker.base_url}{took}\n\nmemory budget: `{run.config.worker.budget().settings()}`")
    return result
