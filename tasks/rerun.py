"""carry: a stage an earlier attempt measured, taken into a re-run attempt without re-measuring."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from servegate.gate import GateRun, StageOutcome
from servegate.results import RunFolder


# NO_CACHE: the run folder is this task's persisted result (written by the run that measured
# it, read back here by path); a Prefect cache would keep a second copy keyed on a GateRun,
# on whichever machine ran the attempt, where neither `servegate status` nor a later attempt looks.
@task(name="carry", cache_policy=NO_CACHE)
def carry(run: GateRun, source_dir: str, outcome: StageOutcome) -> list[str]:
    """Read ``outcome``'s tables back from ``source_dir`` into the attempt; returns the table names."""
    source = RunFolder.open(Path(source_dir))
    run.carry_stage(outcome, {name: source.read_table(name) for name in outcome.tables})
    return list(outcome.tables)
