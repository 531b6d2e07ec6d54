"""host: record the machine's environment and check it before the first measurement (``servegate.hostcheck``)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from servegate.hostcheck import record_host
from servegate.runstate import GateRun
from servegate.stages import StageResult
from servegate.tasks._stage import as_state

STAGE = "host"


@task(name="host", cache_policy=NO_CACHE)
def host(run: GateRun) -> StageResult | State:
    """``host.json`` and the manifest's ``environment``; the stage fails (the run is inconclusive,
    nothing is measured) when the host fails its checks."""
    with run.stage(STAGE) as result:
        record = record_host(run.config, machine=run.folder.manifest.host)
        run.folder.write_json("host", record.model_dump(mode="json"))
        run.folder.manifest.environment = record
        run.folder.write_manifest()
        record.raise_for_problems()
    return as_state(result)
