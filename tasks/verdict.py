"""verdict: pass / fail / inconclusive from every expectation outcome and every stage's result."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._artifacts import publish
from servegate.render import verdict_markdown
from servegate.verdict import Verdict, decide_verdict


def infra_errors(results: list[StageResult]) -> list[str]:
    """What kept the gate from deciding: every failed stage, with its error."""
    return [f"{r.stage}: {r.error}" for r in results if r.status == "failed"]


@task(name="verdict", cache_policy=NO_CACHE)
def verdict(run: GateRun, results: list[StageResult], validation: StageResult,
            teardown_errors: list[str]) -> Verdict:
    everything = [*results, validation]
    result = decide_verdict(validation.notes.get("outcomes") or [], [*infra_errors(everything), *teardown_errors],
                    {r.stage: r.status for r in everything})
    calibration = next((r.notes["calibration"] for r in results if r.notes.get("calibration")), None)
    if calibration is not None:
        result = result.model_copy(update={"calibration": calibration})
    paired = next((r.tables["paired"] for r in results if "paired" in r.tables), None)
    rows = [] if paired is None else paired.to_dict(orient="records")
    unconfirmed = [r["metric"] for r in rows if r.get("decision") == "unconfirmed"]
    if unconfirmed:  # shown with the verdict, never a failure (paired.confirm)
        result = result.model_copy(update={"reason": f"{result.reason}; unconfirmed regression of "
                                                     f"{', '.join(unconfirmed)}: the re-measurement with fresh "
                                                     f"workers excluded it (paired table)"})
    comparison = next((r.tables["comparison"] for r in results if "comparison" in r.tables), None)
    suspicious = ([] if comparison is None else
                  [f"{m}{f' [{c}]' if isinstance(c, str) and c else ''}"
                   for m, c in comparison.loc[comparison["decision"] == "suspicious", ["metric", "case"]].itertuples(
                       index=False)])
    if suspicious:  # which metrics the history rule holds back (compare.consecutive); the status says undecided
        result = result.model_copy(update={"reason": f"{result.reason}; suspicious: {', '.join(suspicious)} "
                                                     f"(comparison table: the reason of each row)"})
    run.folder.write_json("verdict", result.model_dump(mode="json"))
    run.folder.finish()
    publish(run.config.name, "verdict", verdict_markdown(result, rows), description=f"gate verdict: {result.status}")
    return result
