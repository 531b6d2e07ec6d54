"""flush: wait until the worker is idle, then drop its prefix cache (before every measurement)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.bench.flush import flush_until_idle
from servegate.gate import GateRun


@task(name="flush", cache_policy=NO_CACHE)
def flush(run: GateRun, before: str) -> float | None:
    """Flush before stage ``before``; returns seconds waited (None when skipped)."""
    if not run.stage_enabled(before) or run.not_applicable_reason(before) or run.blocked_reason() is not None:
        return None
    with run.stage(f"flush:{before}"):
        return flush_until_idle(run.base_url, run.engine, run.config.flush, api_key=run.api_key)
