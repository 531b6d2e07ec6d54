"""record: store the run in the history database and write the report, JUnit and summary."""

from __future__ import annotations

import logging
from typing import NamedTuple

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.errors import ServegateError
from servegate.runstate import GateRun
from servegate.stages import StageResult, tables_of
from servegate.report import write_junit, write_markdown_summary, write_report
from servegate.history import GateKey, Store
from servegate.tasks._artifacts import publish
from servegate.verdict import Verdict

logger = logging.getLogger("servegate.tasks.record")


class Recorded(NamedTuple):
    verdict: Verdict
    """The verdict as recorded: inconclusive when the run could not be kept in the history."""
    run_id: str | None
    """The run id in the store (None when the store is disabled or the write failed)."""
    paired: list[dict] = []
    """The ``paired`` table's rows (records), for the terminal; empty without a paired stage."""


def _not_recorded(verdict: Verdict, error: str) -> Verdict:
    # A run missing from the history is no baseline for tomorrow and invisible to `status`: the
    # pipeline must hear of it (exit 2), whatever the measurements said.
    return verdict.model_copy(update={
        "status": "inconclusive",
        "reason": f"the run could not be recorded in the history database ({verdict.status} before that)",
        "infra_errors": [*verdict.infra_errors, f"record: {error}"],
        "baseline_eligible": False,
    })


@task(name="record", cache_policy=NO_CACHE)
def record(run: GateRun, results: list[StageResult], validation: StageResult, verdict: Verdict) -> Recorded:
    """Store the run, then write report, JUnit and summary for the verdict as recorded.

    A failed history write does not lose the run folder's files: JUnit, summary and verdict are
    still written (the verdict turned inconclusive, with the error), and the error is returned,
    not raised, so the caller's exit code says it.
    """
    outcomes = [o.model_dump(mode="json") for o in (validation.notes.get("outcomes") or [])]
    tables = tables_of(results)
    manifest = run.folder.manifest.model_dump(mode="json")
    key = GateKey.from_run(manifest, run.config_snapshot())
    run_id = None
    report_path = None
    if run.config.store.enabled:
        try:
            with Store(run.config.store.url) as store:
                run_id = store.record_run(manifest, run.config_snapshot(), tables, outcomes,
                                          verdict.model_dump(mode="json"), attempt_of=run.attempt_of,
                                          run_dir=run.path)
                if run.config.report.html:
                    report_path = write_report(store, run_id)
        except (ServegateError, OSError) as exc:
            logger.error("record failed: %s", exc)
            where = "the history database" if run_id is None else "the HTML report"
            verdict = _not_recorded(verdict, f"writing {where} failed: {exc}")
            run.folder.write_json("verdict", verdict.model_dump(mode="json"))
    write_junit(verdict, outcomes, run.path / "junit.xml")
    markdown = write_markdown_summary(verdict, outcomes, tables.get("comparison"), paired=tables.get("paired"),
                                      run_id=run_id, key=str(key), report_path=report_path,
                                      path=run.path / "summary.md")
    publish(run.config.name, "summary", markdown, description=f"servegate {key}: {verdict.status}")
    paired = tables.get("paired")
    return Recorded(verdict, run_id, [] if paired is None else paired.to_dict(orient="records"))
