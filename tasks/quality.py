"""quality: multiple-choice accuracy floor and agreement with a reference run of the model."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.bench.quality import run_quality
from servegate.gate import GateRun
from servegate.tasks._artifacts import publish, table_markdown

STAGE = "quality"


@task(name="quality", cache_policy=NO_CACHE)
def quality(run: GateRun) -> int:
    """Score the multiple-choice set and the reference prompts; returns the items scored."""
    if run.skipped(STAGE):
        return 0
    with run.stage(STAGE) as outcome:
        result = run_quality(run.base_url, run.engine, run.config.quality, api_key=run.api_key,
                             model_for_reference=run.config.worker.model)
        run.save_table("quality_accuracy", result.accuracy, outcome)
        run.save_table("quality_items", result.items, outcome)
        run.save_table("quality_agreement", result.agreement, outcome)
        run.save_table("quality_agreement_rows", result.agreement_rows, outcome)
    publish(run.config.name, STAGE, "# quality\n\n" + table_markdown(result.accuracy.T.reset_index()) + "\n\n"
            + table_markdown(result.agreement.T.reset_index()))
    return len(result.items)
