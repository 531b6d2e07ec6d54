"""serving: the load test (dataset, arrivals, concurrency), per-request rows and a summary."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.bench.serving import run_serving
from servegate.gate import GateRun
from servegate.tasks._artifacts import publish, table_markdown

STAGE = "serving"


@task(name="serving", cache_policy=NO_CACHE)
def serving(run: GateRun) -> int:
    """Run the load; returns the number of requests sent."""
    if run.skipped(STAGE):
        return 0
    with run.stage(STAGE) as outcome:
        try:
            result = run_serving(run.base_url, run.engine, run.config.serving, api_key=run.api_key)
        except BaseException as exc:
            run.save_partial(exc, STAGE)
            raise
        run.save_table("serving_requests", result.requests, outcome)
        run.save_table("serving_summary", result.summary, outcome)
        run.folder.write_jsonl("serving", result.summary.to_dict(orient="records"))
    publish(run.config.name, STAGE, "# serving\n\n" + table_markdown(result.summary.T.reset_index()))
    return len(result.requests)
