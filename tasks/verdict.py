"""verdict: pass / fail / inconclusive from every expectation outcome and infra error."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.gate import GateRun
from servegate.tasks._artifacts import publish
from servegate.verdict import Verdict, decide, verdict_markdown


@task(name="verdict", cache_policy=NO_CACHE)
def verdict(run: GateRun) -> Verdict:
    result = decide(run.outcomes or [], list(run.infra_errors),
                    {name: o.status for name, o in run.stages.items()})
    if run.calibration is not None:
        result = result.model_copy(update={"calibration": run.calibration})
    run.folder.write_json("verdict", result.model_dump(mode="json"))
    run.folder.finish()
    publish(run.config.name, "verdict", verdict_markdown(result), description=f"gate verdict: {result.status}")
    return result
