"""record: store the run in the history database and write the report, JUnit and summary."""

from __future__ import annotations

import logging

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.gate import GateRun
from servegate.report import write_junit, write_markdown_summary, write_report
from servegate.store import GateKey, Store
from servegate.tasks._artifacts import publish
from servegate.verdict import Verdict

logger = logging.getLogger("servegate.tasks.record")


@task(name="record", cache_policy=NO_CACHE)
def record(run: GateRun, verdict: Verdict) -> str | None:
    """Returns the run id in the store (None when the store is disabled)."""
    outcomes = [o.model_dump(mode="json") for o in (run.outcomes or [])]
    write_junit(verdict, outcomes, run.path / "junit.xml")
    manifest = run.folder.manifest.model_dump(mode="json")
    key = GateKey.from_run(manifest, run.config_snapshot())
    run_id = None
    report_path = None
    if run.config.store.enabled:
        with Store(run.config.store.url) as store:
            run_id = store.record_run(manifest, run.config_snapshot(), run.tables, outcomes,
                                      verdict.model_dump(mode="json"), attempt_of=run.attempt_of,
                                      run_dir=run.path)
            if run.config.report.html:
                report_path = write_report(store, run_id)
    markdown = write_markdown_summary(verdict, outcomes, run.tables.get("comparison"), run_id=run_id,
                                      key=str(key), report_path=report_path, path=run.path / "summary.md")
    publish(run.config.name, "summary", markdown, description=f"servegate {key}: {verdict.status}")
    return run_id
