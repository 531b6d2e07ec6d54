"""quality: multiple-choice accuracy with its standard error, and agreement with a reference (greedy tokens, log-probabilities)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import perform


@task(name="quality", cache_policy=NO_CACHE)
def quality(run: GateRun, flushed: StageResult) -> StageResult | State:
    return perform(run, "quality", flushed)
