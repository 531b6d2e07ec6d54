"""capacity: a sweep of serving loads at rising request rates; the highest rate whose goodput meets the target."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import perform


@task(name="capacity", cache_policy=NO_CACHE)
def capacity(run: GateRun, flushed: StageResult) -> StageResult | State:
    return perform(run, "capacity", flushed)
