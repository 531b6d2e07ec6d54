"""warmup: a few short requests; any failure fails the stage; nothing it produces is measured."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import perform


@task(name="warmup", cache_policy=NO_CACHE)
def warmup(run: GateRun, launched: StageResult) -> StageResult | State:
    return perform(run, "warmup", launched)
