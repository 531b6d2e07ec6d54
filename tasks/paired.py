"""paired: the baseline and the candidate worker measured side by side, in rounds, until decided."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import perform


@task(name="paired", cache_policy=NO_CACHE)
def paired(run: GateRun) -> StageResult | State:
    return perform(run, "paired")
