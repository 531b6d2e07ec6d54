"""warmup: a few short requests; any failure fails the stage; nothing is measured."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.bench.warmup import run_warmup
from servegate.gate import GateRun


@task(name="warmup", cache_policy=NO_CACHE)
def warmup(run: GateRun) -> int:
    if not run.config.warmup.enabled:
        run.skip("warmup", "disabled in config")
        return 0
    if (reason := run.blocked_reason()) is not None:
        run.skip("warmup", reason)
        return 0
    with run.stage("warmup"):
        return run_warmup(run.base_url, run.engine, run.config.warmup, api_key=run.api_key)
