"""launch: start the worker with its memory budget and wait until it is ready."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.gate import GateRun
from servegate.launch import launch_worker
from servegate.tasks._artifacts import publish


@task(name="launch", cache_policy=NO_CACHE)
def launch(run: GateRun) -> str:
    """Start the worker (or attach to an external one); returns its base URL."""
    with run.stage("launch"):
        run.worker = launch_worker(run.config.worker, run.path / "worker.log")
    publish(run.config.name, "launch",
            f"# launch\nworker `{run.config.worker.engine}` / `{run.config.worker.model}` ready at "
            f"{run.worker.base_url}\n\nmemory budget: `{run.config.worker.budget().model_dump(exclude_none=True)}`")
    return run.worker.base_url
