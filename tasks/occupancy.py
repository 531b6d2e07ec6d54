"""occupancy: scrape /metrics during a long request; forward occupancy and friends."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.bench.occupancy import run_occupancy
from servegate.gate import GateRun
from servegate.tasks._artifacts import publish, table_markdown

STAGE = "occupancy"


@task(name="occupancy", cache_policy=NO_CACHE)
def occupancy(run: GateRun) -> int:
    """Scrape during a long request; returns the number of scrapes."""
    if run.skipped(STAGE):
        return 0
    with run.stage(STAGE) as outcome:
        result = run_occupancy(run.base_url, run.engine, run.config.occupancy, api_key=run.api_key)
        # The accept-length floor applies only to gates that turn speculative decoding on.
        result.summary["speculative_decoding"] = run.config.worker.speculative_num_draft_tokens is not None
        run.save_table("occupancy_samples", result.samples, outcome)
        run.save_table("occupancy_summary", result.summary, outcome)
    publish(run.config.name, STAGE, "# occupancy\n\n" + table_markdown(result.summary.T.reset_index()))
    return len(result.samples)
