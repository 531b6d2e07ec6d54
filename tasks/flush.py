"""flush: wait until the worker is idle, then drop its prefix cache, before one measurement."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult, spec
from servegate.tasks._stage import perform


@task(name="flush", cache_policy=NO_CACHE)
def flush(run: GateRun, before: str, warmed: StageResult) -> StageResult | State:
    """Flush before measurement ``before``; nothing (an unrecorded skip) when that stage will not run."""
    if (skip := run.skip_reason(spec(before), warmed)) is not None:
        return StageResult(f"flush:{before}", status="skipped", error=skip[1])
    return perform(run, f"flush:{before}", warmed)
