"""one_batch: the batch_size x input_len x output_len grid, one batched request per case (server) or the engine's own static-batch runner (offline)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import perform


@task(name="one_batch", cache_policy=NO_CACHE)
def one_batch(run: GateRun, flushed: StageResult) -> StageResult | State:
    return perform(run, "one_batch", flushed)
