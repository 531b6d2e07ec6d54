"""carry: a stage an earlier attempt measured, taken into a re-run attempt without re-measuring."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.results import RunFolder, StageRecord
from servegate.runstate import GateRun
from servegate.stages import StageResult


# NO_CACHE: the run folder is this task's persisted result (written by the run that measured
# it, read back here by path); a Prefect cache would keep a second copy keyed on a GateRun,
# on whichever machine ran the attempt, where neither `servegate status` nor a later attempt looks.
@task(name="carry", cache_policy=NO_CACHE)
def carry(run: GateRun, source_dir: str, record: StageRecord) -> StageResult:
    """Read ``record``'s tables back from ``source_dir`` into the attempt, as that stage's result."""
    source = RunFolder.open(Path(source_dir))
    result = StageResult.from_record(record, {name: source.read_table(name) for name in record.tables})
    run.carry(result)
    return result
