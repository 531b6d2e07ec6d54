"""validate: every produced table against the profile's Great Expectations suites."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.runstate import GateRun
from servegate.stages import StageResult, tables_of
from servegate.tasks._stage import as_state


@task(name="validate", cache_policy=NO_CACHE)
def validate(run: GateRun, results: list[StageResult]) -> StageResult | State:
    """Every expectation's outcome, in ``notes["outcomes"]`` (also ``expectations.json``)."""
    from servegate.validate import validate_tables

    cfg = run.config.validate_
    tables = tables_of(results)
    with run.stage("validate") as result:
        outcomes = validate_tables(tables, cfg.expectation_profile,
                                   Path(cfg.expectations_dir) if cfg.expectations_dir else None)
        result.notes["outcomes"] = outcomes
        run.folder.write_json("expectations", [o.model_dump(mode="json") for o in outcomes])
    return as_state(result)
