"""compare: the run's raw samples against its gate key's baseline (bootstrap CI on ratios)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.baseline import BaselinePolicy
from servegate.compare import compare_run
from servegate.gate import GateRun
from servegate.store import GateKey, Store
from servegate.tasks._artifacts import publish, table_markdown

STAGE = "compare"


@task(name="compare", cache_policy=NO_CACHE)
def compare(run: GateRun) -> int:
    """Build the comparison table (validated by GX like every table); returns its row count."""
    cfg = run.config.compare
    if not cfg.enabled:
        run.skip(STAGE, "disabled in config (compare.enabled = false)")
        return 0
    with run.stage(STAGE) as outcome:
        policy = BaselinePolicy(kind=cfg.policy, n=cfg.n, branch=cfg.branch, days=cfg.days)
        key = GateKey.from_run(run.folder.manifest.model_dump(mode="json"), run.config_snapshot())
        with Store(run.config.store.url) as store:
            table = compare_run(store, run.tables, key, policy=policy, bound=cfg.bound, tail_bound=cfg.tail_bound,
                                exclude_run=run.attempt_of)
        run.calibration = table.attrs.get("calibration")
        run.save_table("comparison", table, outcome)
    shown = table[["metric", "case", "ratio", "ci_low", "ci_high", "decision", "min_detectable"]]
    publish(run.config.name, STAGE, "# comparison with baseline\n\n" + table_markdown(shown))
    return len(table)
