"""Re-run one (or a few) measurement stages of a recorded gate run as a new attempt.

    servegate rerun RUN --task serving [--task occupancy] [--set section.field=value ...] [--db URL] [--json]

(the command itself is :mod:`servegate.commands.rerun`; this module plans and opens the attempt)

RUN is a run folder or a run id recorded in the history database. The attempt:

* relaunches the worker from the run's recorded config (``config.json``) with the ``--set``
  overrides laid over it, warms it up, and for each re-run stage flushes and measures;
* takes every other measurement stage as the original measured it: its outcome and its
  tables are read back from the original run folder (the durable record of what was
  measured) and copied into the attempt's folder, so an attempt folder is whole on its own;
* compares, validates and decides over the whole table set, and records the result in the
  store as a new attempt of the same run (``Store.record_run(..., attempt_of=<root run>)``).

The original is never touched: the attempt gets its own folder under
``<root run folder>/attempts/``, with ``rerun.json`` saying what it re-ran and where the
rest came from.

Overrides apply to the attempt's config snapshot, with two limits that keep the attempt
comparable with what it carries: fields of the gate key (``name``, ``hardware``,
``worker.engine``, ``worker.model``) cannot change, and neither can the section of a stage
that is carried rather than re-measured (its tables would no longer match the config).
A stage that did not succeed in RUN (failed, or skipped because the worker had died) must be
re-run too; the plan says which before anything is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from servegate import jsonio
from servegate.config import GateConfig, apply_overrides
from servegate.errors import ConfigError
from servegate.results import REDACTED, RunFolder, StageRecord
from servegate.runstate import GateRun
from servegate.stages import MEASUREMENT_STAGES, STAGES, check_config

__all__ = ["RERUN_FILE", "ATTEMPTS_DIR", "RerunPlan", "resolve_run_dir", "plan_rerun", "open_attempt"]

RERUN_FILE = "rerun"
"""``rerun.json`` in an attempt folder: what was re-run, from which folder, with which overrides."""
ATTEMPTS_DIR = "attempts"

_GATE_KEY_FIELDS = ("name", "hardware", "worker.engine", "worker.model")
_CARRIED_STATUSES = ("ok", "not_applicable")


@dataclass
class RerunPlan:
    """What an attempt re-measures, what it carries, and against which recorded run it is recorded."""

    source: RunFolder  # the folder whose measurements the attempt starts from
    root_dir: Path  # the original run's folder; attempts live under <root_dir>/attempts/
    attempt_of: str  # run id the attempt is recorded against (the store resolves it to the root run)
    config: GateConfig  # the attempt's config: the recorded one with the overrides laid over it
    stages: list[str]  # stages to re-measure, in gate order
    carried: dict[str, StageRecord] = field(default_factory=dict)  # stage -> its record in source
    overrides: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"attempt_of": self.attempt_of, "source_dir": str(self.source.path), "root_dir": str(self.root_dir),
                "rerun_stages": self.stages, "overrides": self.overrides,
                "carried": {name: {"status": o.status, "tables": o.tables, "error": o.error}
                            for name, o in self.carried.items()}}


def resolve_run_dir(run: str, db: str | None = None) -> Path:
    """RUN as given on the command line: a run folder, or a run id recorded in the store."""
    path = Path(run).expanduser()
    if path.is_dir():
        return path
    if "/" in run:  # run ids never contain a slash (attempt ids do contain dots: <root>.attempt-2)
        raise ConfigError(f"{run} is not a folder; pass a run folder (printed by `servegate run`) or a run id "
                          f"from `servegate status --json`")
    from servegate.history import Store

    with Store(db) as store:
        record = store.get_run(run)
    if not record.run_dir or not Path(record.run_dir).is_dir():
        raise ConfigError(f"run {run} is recorded but its folder {record.run_dir!r} is not on this machine; "
                          f"re-run it where its folder is, or pass the folder's path")
    return Path(record.run_dir)


def _recorded_stages(folder: RunFolder) -> dict[str, StageRecord]:
    try:
        raw = folder.read_json("stages")
    except FileNotFoundError:  # older folders: the manifest's stage records say the same
        raw = {s.stage: s.model_dump(mode="json") for s in folder.manifest.stages}
    return {name: StageRecord.model_validate({**d, "stage": name}) for name, d in raw.items()}


def _is_measurement(stage: str) -> bool:
    return stage in MEASUREMENT_STAGES


def _check_overrides(overrides: list[str], carried: list[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in _GATE_KEY_FIELDS:
            raise ConfigError(f"--set {item}: {key} is part of the gate key; an attempt re-runs the same gate. "
                              f"Start a new gate with `servegate run` instead")
        section = key.split(".", 1)[0]
        # A carried stage's tables answer its own section and the sections it reads (capacity: serving).
        for stage in carried:
            if section == stage or section in STAGES[stage].reads:
                raise ConfigError(f"--set {item}: stage {stage} is carried from the original run, not re-measured, "
                                  f"and its tables depend on {section}.*; they would no longer match the config. "
                                  f"Re-run it too (--task {stage}) or drop the override")


def _attempt_config(folder: RunFolder, overrides: list[str]) -> GateConfig:
    try:
        data = jsonio.loads((folder.path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"{folder.path} has no config.json; it was not written by a gate run") from exc
    data = apply_overrides(data, list(overrides))
    worker = data.get("worker") or {}
    # Run folders keep no secrets; the attempt needs them back from the caller.
    if worker.get("api_key") == REDACTED and not worker.get("api_key_env"):
        raise ConfigError("the run's worker.api_key is not kept in its folder; name the environment variable that "
                          "holds it: --set worker.api_key_env=NAME (or --set worker.api_key=KEY, which `ps` shows)")
    hidden = [k for k, v in (worker.get("env") or {}).items() if v == REDACTED]
    if hidden:
        raise ConfigError(f"the run's worker.env values {hidden} are not kept in its folder; pass them: "
                          + " ".join(f"--set worker.env.{k}=VALUE" for k in hidden))
    try:
        return GateConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"the run's config with overrides {overrides} is not valid: {exc}") from exc


def plan_rerun(run_dir: str | Path, stages: list[str], overrides: list[str] | None = None, *,
               rerunnable: tuple[str, ...]) -> RerunPlan:
    """Check a re-run before anything is launched and say exactly what it will do.

    ``rerunnable``: the stages the re-run flow can measure (gate order). Raises ConfigError for
    an unknown or disabled stage, a forbidden override, a stage that did not succeed and is not
    re-run, or a carried table missing from the folder.
    """
    overrides = list(overrides or [])
    if not stages:
        raise ConfigError(f"name the stage(s) to re-run: --task one of {list(rerunnable)}")
    unknown = [s for s in stages if s not in rerunnable]
    if unknown:
        raise ConfigError(f"cannot re-run {unknown}: --task must be one of {list(rerunnable)}")
    ordered = [s for s in rerunnable if s in stages]
    source = RunFolder.open(run_dir)
    recorded = _recorded_stages(source)
    carried_names = [s for s in recorded if _is_measurement(s) and s not in ordered]
    _check_overrides(overrides, carried_names)
    config = _attempt_config(source, overrides)

    def enabled(stage: str) -> bool:
        # The paired stage runs only beside a baseline worker (skipped without one, like a disabled stage).
        if STAGES[stage].own_workers and config.baseline is None:
            return False
        return bool(getattr(getattr(config, stage, None), "enabled", True))

    unpaired = [s for s in ordered if STAGES[s].own_workers and config.baseline is None]
    if unpaired:
        raise ConfigError(f"{unpaired} needs a baseline worker, and the run's config has none ([baseline]); "
                          f"re-run another stage, or run a paired gate (e.g. --profile smoke-ab)")
    disabled = [s for s in ordered if not enabled(s)]
    if disabled:
        raise ConfigError(f"{disabled} disabled in the run's config; enable with "
                          + " ".join(f"--set {s}.enabled=true" for s in disabled))
    check_config(config, ordered)  # before anything is launched, like the gate
    carried: dict[str, StageRecord] = {}
    must_rerun: dict[str, str] = {}
    for name in carried_names:
        outcome = recorded[name]
        if outcome.status in _CARRIED_STATUSES or (outcome.status == "skipped" and not enabled(name)):
            missing = [t for t in outcome.tables if not source.has_table(t)]
            if missing:
                raise ConfigError(f"stage {name} of {source.path} lists tables {missing} that are not in the "
                                  f"folder; re-run it too (--task {name})")
            carried[name] = outcome
        else:
            must_rerun[name] = f"{outcome.status}: {(outcome.error or 'no reason recorded').splitlines()[0]}"
    if must_rerun:
        tasks = " ".join(f"--task {s}" for s in [*ordered, *must_rerun])
        raise ConfigError(f"{'; '.join(f'{k} ({v})' for k, v in must_rerun.items())} did not succeed in "
                          f"{source.path} and would be missing from the attempt; re-run them too: {tasks}")
    try:
        rerun_doc = source.read_json(RERUN_FILE)
    except FileNotFoundError:
        rerun_doc = None
    root_dir = Path(rerun_doc["root_dir"]) if rerun_doc else source.path
    attempt_of = source.manifest.run_id
    if config.store.enabled:
        from servegate.history import Store

        with Store(config.store.url) as store:
            try:
                attempt_of = store.get_run(attempt_of).root_id
            except ConfigError as exc:
                raise ConfigError(f"run {attempt_of} is not in the history database, so an attempt cannot be "
                                  f"recorded against it; point --db (or store.url) at the database it was "
                                  f"recorded in, or --set store.enabled=false") from exc
    return RerunPlan(source=source, root_dir=root_dir, attempt_of=attempt_of, config=config, stages=ordered,
                     carried=carried, overrides=overrides)


def open_attempt(plan: RerunPlan) -> GateRun:
    """The attempt's GateRun: a new folder under ``<root>/attempts/``, its config and ``rerun.json``.

    The carried stages are added by the flow (``servegate.tasks.rerun.carry``) so that they show as tasks.
    """
    return GateRun.open(plan.config, parent=plan.root_dir / ATTEMPTS_DIR, attempt_of=plan.attempt_of,
                        documents={RERUN_FILE: plan.describe()})
