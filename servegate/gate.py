"""One gate run's state: its folder, its worker, its tables, what each stage did.

The Prefect tasks in ``tasks/`` are thin wrappers that call the stage functions in
``servegate.bench`` and hand their tables to a :class:`GateRun`; the flow in
``flows/gate.py`` only composes those tasks. Everything that decides (is the worker
still usable, should this stage run, what failed and why) lives here, so it is
tested without Prefect.

Every table is written to the run folder the moment it is measured: a stage that
fails later loses nothing measured before it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from servegate.config import GateConfig
from servegate.engines import get_engine
from servegate.engines.base import Engine
from servegate.errors import ConfigError, DeadlineError, InfraError, ServegateError, WorkerDiedError
from servegate.proctree import exit_on_sigterm, guard_process_tree

__all__ = ["DEVICE_SLOT_ENV", "GateRun", "MEASUREMENT_STAGES", "STAGE_NEEDS", "StageOutcome", "call_flow", "device_slot_limit",
           "hold_device_slot", "resolve_config"]

logger = logging.getLogger("servegate.gate")

MEASUREMENT_STAGES: tuple[str, ...] = ("one_batch", "serving", "occupancy", "quality")
"""Measurement stages in gate order; each starts from a flushed, idle worker."""

STAGE_NEEDS: dict[str, tuple[str, str]] = {
    "occupancy": ("has_metrics", "exposes no Prometheus metrics the gate can rely on"),
    "quality": ("has_logprobs", "does not promise the prompt log-probabilities the quality stage scores"),
}
"""Engine capability (``servegate.engines.base.Engine``) each stage needs, and what its absence means.
A stage whose engine lacks it is *not applicable*: neither measured nor counted against the gate."""

DEVICE_SLOT_ENV = "SERVEGATE_DEVICE_SLOT"
"""Names the device this gate's worker runs on (e.g. ``gpu-box-3-gpu0``). When set, a gate holds
the Prefect global concurrency limit ``device-<slot>`` from before its run folder is created
until its worker is stopped, so two gates never share a device. Unset: no limit (local runs)."""


_T = TypeVar("_T")


def call_flow(flow: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Run a Prefect flow for a CLI command; Prefect failing to start its API server becomes an
    ``InfraError`` that says what to do (the flow's own failures are recorded in its result).

    Before anything starts (Prefect's temporary API server is the first child), the process gets
    its guardian and a SIGTERM that unwinds: no process outlives the command, however it ends.
    """
    exit_on_sigterm()
    guard_process_tree()
    try:
        return flow(*args, **kwargs)
    except RuntimeError as exc:
        if "Prefect" not in str(exc):
            raise
        raise InfraError(f"{exc} Set PREFECT_API_URL to a running `prefect server start`, or raise "
                         f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS on a loaded machine.") from exc


def device_slot_limit() -> str | None:
    """The global concurrency limit this process must hold (``device-<slot>``), or None when unset."""
    slot = os.environ.get(DEVICE_SLOT_ENV, "").strip()
    return f"device-{slot}" if slot else None


def hold_device_slot() -> contextlib.ExitStack:
    """Acquire this machine's device slot, if one is configured; close the returned stack to release it.

    Waits as long as another gate holds the slot. The limit must exist on the Prefect server
    (``prefect gcl create device-<slot> --limit 1``): a missing limit is an error, not a
    silently unlimited device.
    """
    held = contextlib.ExitStack()
    name = device_slot_limit()
    if name is None:
        return held
    from prefect.concurrency.sync import concurrency
    from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError

    try:
        # A transient API error while renewing the lease must not kill an hour-long gate.
        held.enter_context(concurrency(name, occupy=1, strict=True, raise_on_lease_renewal_failure=False))
    except ConcurrencySlotAcquisitionError as exc:
        raise ConfigError(f"cannot hold the device slot {name!r} ({DEVICE_SLOT_ENV}="
                          f"{os.environ.get(DEVICE_SLOT_ENV)}): {exc}; create it once with "
                          f"`prefect gcl create {name} --limit 1`, or unset {DEVICE_SLOT_ENV}") from exc
    logger.info("holding device slot %s", name)
    return held


def resolve_config(config: GateConfig | None, profile: str | None, overrides: list[str] | None) -> GateConfig:
    """A flow's config from its parameters: a full config, or a profile plus overrides."""
    from servegate.config import apply_overrides, load_config

    if config is not None:
        if profile is not None:
            raise ConfigError("give the gate flow either config or profile, not both")
        if overrides:
            # Python mode keeps secrets (the JSON form redacts them).
            data = apply_overrides(config.model_dump(by_alias=True), list(overrides))
            return GateConfig.model_validate(data)
        return config
    return load_config(profile=profile or "smoke", overrides=list(overrides or []))


@dataclass
class StageOutcome:
    stage: str
    status: str  # ok | failed | skipped | not_applicable
    duration_s: float = 0.0
    error: str | None = None
    tables: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "status": self.status, "duration_s": round(self.duration_s, 3),
                "error": self.error, "tables": self.tables}


class GateRun:
    """The state of one gate run, shared by the tasks of one flow run (in-process)."""

    def __init__(self, config: GateConfig, folder: Any) -> None:
        self.config = config
        self.folder = folder
        self.engine: Engine = get_engine(config.worker.engine)
        self.worker: Any = None  # servegate.launch.WorkerHandle once launched
        self.tables: dict[str, pd.DataFrame] = {}
        self.stages: dict[str, StageOutcome] = {}
        self.infra_errors: list[str] = []
        self.outcomes: list[Any] | None = None  # ExpectationOutcome list once validated
        self.started_at = time.time()
        self.closed = False  # True once the gate stopped the worker on purpose
        self.attempt_of: str | None = None  # the recorded run this one re-runs (servegate rerun)
        self.calibration: dict[str, Any] | None = None  # the key's calibration summary (compare stage)
        self.device_slot = contextlib.ExitStack()  # the held device slot (hold_device_slot), released by close()
        self.deadline = time.monotonic() + config.max_wall_s
        self.overrun: str | None = None  # set (from a timer thread) when a stage ran past its deadline

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def open(cls, config: GateConfig) -> "GateRun":
        from servegate.results import RunFolder
        from servegate.validate import load_suites

        # A suite that cannot run (a typo in a type or a column) is found now, not after the
        # measurements: nothing is launched and no run folder is made.
        load_suites(config.validate_.expectation_profile,
                    Path(config.validate_.expectations_dir) if config.validate_.expectations_dir else None)
        held = hold_device_slot()  # before the folder: started_at is when the device became ours
        try:
            folder = RunFolder.create(Path(config.output_dir), config.name)
            try:
                folder.write_config(config)
            except BaseException:
                folder.discard()
                raise
            run = cls(config, folder)
        except BaseException:
            held.close()
            raise
        run.device_slot = held
        return run

    @property
    def path(self) -> Path:
        return Path(self.folder.path)

    def config_snapshot(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json", by_alias=True)

    @property
    def base_url(self) -> str:
        if self.worker is None:
            raise WorkerDiedError("no worker is running: the launch stage failed; see launch in stages.json")
        return self.worker.base_url

    @property
    def api_key(self) -> str | None:
        return self.config.worker.api_key_value()

    # -- stage bookkeeping ----------------------------------------------------------------
    def stage_enabled(self, stage: str) -> bool:
        section = getattr(self.config, stage, None)
        return bool(getattr(section, "enabled", True))

    def blocked_reason(self, stage: str | None = None) -> str | None:
        """Why ``stage`` (or any further stage) cannot run, or None when it can.

        A measurement stage needs a live worker and a successful flush just before it:
        measuring a worker that is not idle with a cold cache measures something else.
        """
        if self.overrun is not None:
            return self.overrun
        if self.worker is None:
            return "the worker was never launched (launch failed)"
        if not self.worker.is_alive():
            return f"the worker exited (code {self.worker.returncode})"
        warm = self.stages.get("warmup")
        if warm is not None and warm.status == "failed":
            return f"warmup failed: {warm.error}"
        if stage is not None:
            flushed = self.stages.get(f"flush:{stage}")
            if flushed is not None and flushed.status == "failed":
                return f"the flush before {stage} failed: {flushed.error}"
        return None

    def check_worker(self, stage: str) -> None:
        """A stage that ran while the worker died measured a dying server: infra, not data."""
        if self.overrun is not None:
            raise DeadlineError(self.overrun)
        if self.worker is not None and not self.closed and not self.worker.is_alive():
            raise WorkerDiedError(
                f"the worker exited (code {self.worker.returncode}) during {stage}; its measurements are kept in "
                f"{self.path} but not trusted. Log tail:\n{self.worker.log_tail(20)}")

    def not_applicable_reason(self, stage: str) -> str | None:
        """Why the engine cannot serve ``stage`` (STAGE_NEEDS), or None when it can."""
        need = STAGE_NEEDS.get(stage)
        if need is None or getattr(self.engine, need[0], True):
            return None
        return f"engine {self.engine.name} {need[1]}"

    def skipped(self, stage: str) -> bool:
        """True (and the skip recorded with its reason) when ``stage`` is disabled, not applicable
        to the engine, or blocked."""
        if not self.stage_enabled(stage):
            self.skip(stage, "disabled in config")
            return True
        if (reason := self.not_applicable_reason(stage)) is not None:
            self.skip(stage, reason, status="not_applicable")
            return True
        if (reason := self.blocked_reason(stage)) is not None:
            self.skip(stage, reason)
            return True
        return False

    def skip(self, stage: str, reason: str, status: str = "skipped") -> None:
        self.stages[stage] = StageOutcome(stage, status, error=reason)
        self._write_stages(self.stages[stage])

    @contextlib.contextmanager
    def stage(self, stage: str) -> Iterator[StageOutcome]:
        """Time a stage and record how it ended; infra failures are recorded, then re-raised."""
        outcome = StageOutcome(stage, "ok")
        started = time.perf_counter()
        timer = self._arm_deadline(stage)
        try:
            if self.overrun is not None and not self.closed:
                raise DeadlineError(self.overrun)
            yield outcome
            self.check_worker(stage)
        except BaseException as exc:
            outcome.status = "failed"
            outcome.error = self._describe_failure(stage, exc)
            self.infra_errors.append(f"{stage}: {outcome.error}")
            raise
        finally:
            timer.cancel()
            outcome.duration_s = time.perf_counter() - started
            self.stages[stage] = outcome
            self._write_stages(outcome)

    def _arm_deadline(self, stage: str) -> threading.Timer:
        """A timer that ends ``stage`` when it runs past ``stage_max_s`` or the gate's ``max_wall_s``.

        It stops the worker: whatever the stage waits on then fails at once (a hung server, a drip,
        a stuck decode), and every later stage is blocked. Socket timeouts alone cannot bound a
        stage: a server may answer one byte at a time.
        """
        stage_limit = self.config.stage_max_s
        gate_left = self.deadline - time.monotonic()
        if gate_left < stage_limit:
            why = (f"the gate ran past its deadline (max_wall_s = {self.config.max_wall_s:g} s) during {stage}; "
                   f"raise max_wall_s if the gate needs longer, or find what hung (worker log)")
        else:
            why = (f"{stage} ran past stage_max_s = {stage_limit:g} s; raise stage_max_s if it needs longer, "
                   f"or find what hung (worker log)")
        timer = threading.Timer(max(0.0, min(stage_limit, gate_left)), self._overran, args=(why,))
        timer.daemon = True
        timer.start()
        return timer

    def _overran(self, why: str) -> None:
        if self.overrun is None:
            self.overrun = why
        logger.error("%s: stopping the worker", why)
        if self.worker is not None:
            try:
                self.worker.stop()
            except InfraError as exc:
                logger.error("stopping the worker after a deadline failed: %s", exc)

    def _describe_failure(self, stage: str, exc: BaseException) -> str:
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit(143), Prefect's TerminationSignal
            return f"interrupted ({'Ctrl-C' if isinstance(exc, KeyboardInterrupt) else 'SIGTERM'}) during {stage}"
        if self.overrun is not None and not isinstance(exc, DeadlineError):
            return f"DeadlineError: {self.overrun} (the stage then failed with {type(exc).__name__}: {exc})"
        message = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ServegateError):
            message = f"internal error ({message}); this is a servegate bug, please report it with the run folder"
        if (self.worker is not None and not self.closed and not isinstance(exc, WorkerDiedError)
                and not self.worker.is_alive()):
            message += (f"\nThe worker exited during {stage} (code {self.worker.returncode}); "
                        f"log tail:\n{self.worker.log_tail(20)}")
        return message

    def save_table(self, name: str, df: pd.DataFrame, outcome: StageOutcome | None = None) -> None:
        self.tables[name] = df
        self.folder.write_table(name, df)
        if outcome is not None:
            outcome.tables.append(name)

    def carry_stage(self, outcome: StageOutcome, tables: dict[str, pd.DataFrame]) -> None:
        """Take a stage an earlier attempt measured (``servegate rerun``): its outcome, and its
        tables written into this run's folder, so the attempt is validated and kept whole."""
        for name, df in tables.items():
            self.save_table(name, df)
        self.stages[outcome.stage] = outcome
        self._write_stages(outcome)

    def save_partial(self, exc: BaseException, name: str) -> None:
        """Keep what a stage measured before it failed (``exc.partial``), if anything."""
        partial = getattr(exc, "partial", None)
        if isinstance(partial, pd.DataFrame) and not partial.empty:
            self.folder.write_table(f"{name}.partial", partial)
        elif partial is not None and hasattr(partial, "requests"):
            self.folder.write_table(f"{name}_requests.partial", partial.requests)

    def _write_stages(self, latest: StageOutcome) -> None:
        from servegate.results import StageRecord

        self.folder.write_json("stages", {name: o.as_dict() for name, o in self.stages.items()})
        self.folder.record_stage(StageRecord(stage=latest.stage, status=latest.status, error=latest.error,
                                             duration_s=latest.duration_s, tables=latest.tables))

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """End the worker's whole process tree, then release the device slot. Safe to call more than once."""
        self.closed = True
        try:
            if self.worker is not None:
                try:
                    self.worker.stop()
                except InfraError as exc:  # never let teardown hide the real outcome
                    self.infra_errors.append(f"teardown: {exc}")
                    logger.error("teardown failed: %s", exc)
        finally:
            self.device_slot.close()
