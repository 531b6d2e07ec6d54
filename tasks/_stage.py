"""What every stage task does, written once: skip or run the stage, publish it, return its result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect.states import Failed, State

from servegate.runstate import GateRun
from servegate.stages import StageResult, refresh_worker_table, spec
from servegate.tasks._artifacts import publish, table_markdown


def as_state(result: StageResult) -> StageResult | State:
    """The task's return value: the result, or a ``Failed`` state that carries it."""
    if result.status == "failed":
        return Failed(message=f"{result.stage}: {result.error}", data=result)
    return result


def perform(run: GateRun, stage: str, *upstream: StageResult,
            intro: Callable[[], str] | None = None) -> StageResult | State:
    """Run ``stage`` unless it is disabled, not applicable or blocked by ``upstream`` (the results it
    depends on); publish its tables, after ``intro()``'s markdown when given (one artifact per stage);
    return its result (see :func:`as_state`)."""
    declared = spec(stage)
    skip = run.skip_reason(declared, *upstream)
    if skip is not None:
        return run.skipped(stage, *skip)
    with run.stage(stage) as result:
        declared.run(run, result)
    if declared.flushed:
        refresh_worker_table(run, stage)  # the worker's memory high-water mark through this stage
    if result.ok and (result.tables or intro is not None):
        parts = [intro()] if intro is not None else []
        publish(run.config.name, stage,
                f"# {stage}\n\n" + "\n\n".join([*parts, *(_shown(df) for df in result.tables.values())]))
    return as_state(result)


def outcome(state_or_result: Any) -> StageResult:
    """A task's StageResult from what calling it returned (``return_state=True``) or the result itself."""
    if isinstance(state_or_result, StageResult):
        return state_or_result
    return state_or_result.result(raise_on_failure=False)


def _shown(df: Any) -> str:
    # A one-row table (a summary) reads better as name/value pairs.
    return table_markdown(df.T.reset_index() if len(df) == 1 else df)
