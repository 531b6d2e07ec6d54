"""occupancy: a long request in the background while /metrics is scraped; forward occupancy, accept length, usage."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import perform


@task(name="occupancy", cache_policy=NO_CACHE)
def occupancy(run: GateRun, flushed: StageResult) -> StageResult | State:
    return perform(run, "occupancy", flushed)
