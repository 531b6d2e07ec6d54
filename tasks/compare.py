"""compare: the run's raw samples against the gate key's baseline (history), a table GX validates."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult, tables_of
from servegate.tasks._artifacts import publish, table_markdown
from servegate.tasks._stage import as_state

STAGE = "compare"


@task(name="compare", cache_policy=NO_CACHE)
def compare(run: GateRun, measured: list[StageResult]) -> StageResult | State:
    """The ``comparison`` table, the history rule (``compare.consecutive``) applied; the key's calibration
    summary rides in ``notes["calibration"]``."""
    cfg = run.config.compare
    if not cfg.enabled:
        return run.skipped(STAGE, "skipped", "disabled in config (compare.enabled = false)")
    from servegate.baseline import BaselinePolicy
    from servegate.compare import compare_run
    from servegate.history import GateKey, Store

    tables = tables_of(measured)
    with run.stage(STAGE) as result:
        policy = BaselinePolicy.of(cfg)
        key = GateKey.from_run(run.folder.manifest.model_dump(mode="json"), run.config_snapshot())
        with Store(run.config.store.url) as store:
            table = compare_run(store, tables, key, policy=policy, bound=cfg.bound, tail_bound=cfg.tail_bound,
                                exclude_run=run.attempt_of, environment=run.folder.manifest.environment,
                                consecutive=cfg.consecutive)
        result.notes["calibration"] = table.attrs.pop("calibration", None)
        result.remarks.extend(table.attrs.get("environment") or [])
        result.tables["comparison"] = table
    if result.ok:
        shown = result.tables["comparison"][["metric", "case", "ratio", "ci_low", "ci_high", "decision",
                                             "min_detectable"]]
        publish(run.config.name, STAGE, "# comparison with baseline\n\n" + table_markdown(shown))
    return as_state(result)
