"""serving: the load generator (random or ShareGPT prompts, Poisson/constant/all-at-once arrivals), per-request rows and a summary."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import perform


@task(name="serving", cache_policy=NO_CACHE)
def serving(run: GateRun, flushed: StageResult) -> StageResult | State:
    return perform(run, "serving", flushed)
