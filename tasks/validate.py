"""validate: every produced table against the profile's Great Expectations suites."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.gate import GateRun
from servegate.validate import ExpectationOutcome, validate_tables


@task(name="validate", cache_policy=NO_CACHE)
def validate(run: GateRun) -> list[ExpectationOutcome]:
    cfg = run.config.validate_
    with run.stage("validate"):
        outcomes = validate_tables(run.tables, cfg.expectation_profile,
                                   Path(cfg.expectations_dir) if cfg.expectations_dir else None)
        run.outcomes = outcomes
        run.folder.write_json("expectations", [o.model_dump(mode="json") for o in outcomes])
    return outcomes
