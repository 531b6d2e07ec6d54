"""one_batch: the batch_size x input_len x output_len latency grid (server or offline mode)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.bench.one_batch import run_one_batch
from servegate.gate import GateRun
from servegate.tasks._artifacts import publish, table_markdown

STAGE = "one_batch"


@task(name="one_batch", cache_policy=NO_CACHE)
def one_batch(run: GateRun) -> int:
    """Measure the grid; returns the number of rows (measured + skipped + failed)."""
    cfg = run.config.one_batch
    if not cfg.enabled:
        run.skip(STAGE, "disabled in config")
        return 0
    offline = cfg.mode == "offline"
    if not offline and (reason := run.blocked_reason(STAGE)) is not None:
        run.skip(STAGE, reason)
        return 0
    with run.stage(STAGE) as outcome:
        try:
            if offline:
                from servegate.bench.offline import run_offline_one_batch

                budget = run.config.worker.budget()
                table = run_offline_one_batch(run.config.worker.model, cfg, max_total_tokens=budget.max_total_tokens)
            else:
                table = run_one_batch(run.base_url, run.engine, cfg, api_key=run.api_key)
        except BaseException as exc:
            run.save_partial(exc, STAGE)
            raise
        run.save_table(STAGE, table, outcome)
        run.folder.write_jsonl(STAGE, table.to_dict(orient="records"))
    publish(run.config.name, STAGE, "# one-batch\n\n" + table_markdown(table))
    return len(table)
