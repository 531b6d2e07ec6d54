"""One gate run's state: its folder, its worker, its device slot and its deadlines — nothing else.

Measurements do not live here: each stage returns a ``servegate.stages.StageResult`` that the
flow passes on (compare, validate, verdict, record). What the run keeps is what must be shared
by every stage of one run: the run folder (every table is written the moment it is measured, so
a stage that fails later loses nothing), the worker handle, the held device slot, and the
deadline timers that stop a stage (and its worker) past ``stage_max_s`` or ``max_wall_s``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from filelock import FileLock

from servegate import console
from servegate.config import GateConfig
from servegate.engines import get_engine
from servegate.engines.base import Engine
from servegate.errors import ConfigError, DeadlineError, InfraError, ServegateError, WorkerDiedError
from servegate.launch import EXIT_GRACE_S
from servegate.proctree import exit_on_sigterm, guard_process_tree
from servegate.stages import StageResult, StageSpec

if TYPE_CHECKING:  # pragma: no cover
    from servegate.launch import WorkerHandle
    from servegate.results import RunFolder

__all__ = ["DEVICE_SLOT_ENV", "GateRun", "call_flow", "check_suites", "device_slot_limit", "hold_device_slot",
           "prefect_api_starting", "resolve_config", "start_worker_early"]

logger = logging.getLogger("servegate.runstate")

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
        if _temporary_api_needed():
            _start_temporary_api()  # under the start lock; already up after `servegate run`'s own
        return flow(*args, **kwargs)
    except RuntimeError as exc:
        mapped = _prefect_start_error(exc)
        if mapped is exc:
            raise
        raise mapped from exc


_EARLY_LOG = (".worker-", ".log")
"""An early-started worker's log in ``output_dir``: this prefix, the gate's pid, this suffix."""


def start_worker_early(config: GateConfig) -> bool:
    """Start the gate's worker's process now, for the launch stage to adopt (``servegate.launch.start_early``),
    when the gate will launch it: an engine that launches, an enabled stage that measures the gate's worker,
    and no device slot to hold first (the worker must not take the device before the gate holds it).

    Its model load then overlaps the gate's own start (Prefect's API server, the flow's set-up). The
    log goes to ``output_dir`` and moves into the run folder when the launch adopts the process; a
    process nothing adopted is stopped by ``GateRun.stop_worker``/``close`` (and by the usual exit
    hooks and guardian). Returns whether a process was started.
    """
    from servegate.launch import start_early
    from servegate.stages import MEASUREMENT_STAGES

    if device_slot_limit() is not None or not get_engine(config.worker.engine).launches:
        return False
    if not _measures_gate_worker(config, MEASUREMENT_STAGES):
        return False
    remove_stale_early_logs(Path(config.output_dir))
    prefix, suffix = _EARLY_LOG
    log_path = Path(config.output_dir) / f"{prefix}{os.getpid()}{suffix}"
    try:
        return start_early(config.worker, log_path) is not None
    except (OSError, ServegateError) as exc:
        # Only a head start: an output folder that cannot take the log (full disk, read-only), or a launch
        # that cannot be made (an engine not installed, a model not cached), is the gate's own error to
        # report where it always was (the run folder, the launch stage), with its advice; nothing is left here.
        with contextlib.suppress(OSError):
            log_path.unlink(missing_ok=True)
        logger.info("the worker's process was not started early (%s); the launch stage starts it", exc)
        return False


def remove_stale_early_logs(output_dir: Path) -> list[Path]:
    """Delete the early-start logs (``.worker-<pid>.log``) in ``output_dir`` whose gate process is gone: a
    gate killed (SIGKILL) before its launch stage adopted the worker cannot remove its own (the worker dies
    with it). A log whose pid is running is another gate's, and stays. Returns what was deleted."""
    import psutil

    removed = []
    prefix, suffix = _EARLY_LOG
    for path in output_dir.glob(f"{prefix}*{suffix}"):
        pid = path.name.removeprefix(prefix).removesuffix(suffix)
        if not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def _measures_gate_worker(config: GateConfig, stages: "list[str] | tuple[str, ...]") -> bool:
    """Whether any of ``stages`` that is enabled measures the gate's own worker (so it is launched)."""
    from servegate.stages import STAGES

    for name in stages:
        stage = STAGES[name]
        section = getattr(config, stage.section, None) if stage.section else None
        if stage.flushed and getattr(section, "enabled", True):
            return True
    return False


def check_suites(config: GateConfig) -> None:
    """Load the config's expectation suites with GX (``servegate.validate.load_suites``): a suite that
    cannot run, or a paired gate without a suite on its table, is a ConfigError before anything is
    measured. The first call in a process imports GX (~5 s on 2 busy cores); later ones take ms."""
    from servegate.validate import load_suites

    suites = load_suites(config.validate_.expectation_profile,
                         Path(config.validate_.expectations_dir) if config.validate_.expectations_dir else None)
    if config.is_paired and "paired" not in suites:
        # Without a suite on its table, the paired stage's decisions would never reach the verdict.
        raise ConfigError(f"the gate pairs its worker with a baseline, but the suites "
                          f"{config.validate_.expectation_profile!r} have none for the 'paired' table, so no "
                          f"paired decision could fail or pass the gate; use a paired profile's suites (e.g. "
                          f"validate.expectation_profile=smoke-ab) or add a 'paired' suite "
                          f"(expectations/smoke-ab.json shows one), or set paired.enabled=false")


@contextlib.contextmanager
def prefect_api_starting() -> Iterator[None]:
    """Start Prefect's temporary API server — when no ``PREFECT_API_URL`` names a running one — in a
    thread while the body runs, and wait for it at the end; the flow then finds it up.

    Prefect starts that server (its own process, 8-14 s on 2 busy cores) only when the flow is
    called; what a command does before its flow (GX, ``check_suites``) runs meanwhile instead of
    before it. A server that fails to start is an ``InfraError``, as in :func:`call_flow`.
    """
    if not _temporary_api_needed():
        yield
        return
    importlib.import_module("prefect.server.api.server")  # here: the thread below should import nothing

    exit_on_sigterm()  # as call_flow: the server is this command's child, and must not outlive it
    guard_process_tree()
    failed: list[BaseException] = []

    def start() -> None:
        try:
            _start_temporary_api()
        except BaseException as exc:  # raised again in the command's thread
            failed.append(exc)

    thread = threading.Thread(target=start, name="servegate-prefect-api", daemon=True)
    thread.start()
    yield
    while thread.is_alive():
        thread.join(0.2)  # short joins: a signal handler (Ctrl-C, SIGTERM) runs in between
    if failed:
        raise _prefect_start_error(failed[0])


def _temporary_api_needed() -> bool:
    """Whether Prefect would start its temporary API server: no ``PREFECT_API_URL``, as Prefect's get_client."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())


def _start_temporary_api() -> None:
    """Start the temporary API server Prefect's client uses, unless it is up, under a lock in ``PREFECT_HOME``.

    Gates started at once (a CI matrix) share one ``PREFECT_HOME`` and so one SQLite database, and
    each server's start-up migrates it and registers Prefect's block types: run side by side, those
    inserts collide (``UNIQUE constraint failed: block_type.slug``) and a server fails to start.
    Held only for the start (8-14 s), so a second gate waits that long, not for the first gate's run.
    """
    from prefect.server.api import server as prefect_server
    from prefect.settings import PREFECT_HOME

    server = prefect_server.SubprocessASGIServer()  # the instance Prefect's client uses (one per port, None: any)
    if server.running:
        return
    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(home / "servegate-api-start.lock"), _in_a_process_group_of_its_own(prefect_server):
        server.start()


@contextlib.contextmanager
def _in_a_process_group_of_its_own(module: types.ModuleType) -> Iterator[None]:
    """While the body runs, the processes ``module`` starts with ``subprocess.Popen`` get a process group of
    their own (``process_group=0``); used for Prefect's temporary API server.

    A signal sent to the gate's whole process group — Ctrl-C in a terminal, a CI job's cancellation, GNU
    ``timeout`` — would otherwise stop that server at the same instant as the gate: the flows then report
    their crash to a server that is gone, and Prefect's client retries each report with back-off for
    minutes (measured: a group SIGTERM to ``servegate calibrate`` mid-round hung > 150 s, its workers still
    running). Out of the group, the server lives until the gate's exit hook stops it, after the flows have
    said how they ended; the guardian still ends it if the gate is killed (it follows every descendant).
    """
    real = module.subprocess
    shim = types.ModuleType("subprocess")
    shim.__dict__.update(vars(real))
    shim.Popen = functools.partial(real.Popen, process_group=0)
    module.subprocess = shim
    try:
        yield
    finally:
        module.subprocess = real


def _prefect_start_error(exc: BaseException) -> BaseException:
    if not isinstance(exc, RuntimeError) or "Prefect" not in str(exc):
        return exc
    return InfraError(f"{exc} Set PREFECT_API_URL to a running `prefect server start`, or raise "
                      f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS on a loaded machine.")


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


class GateRun:
    """The state of one gate run, shared by the tasks of one flow run (in-process)."""

    def __init__(self, config: GateConfig, folder: "RunFolder", *, attempt_of: str | None = None) -> None:
        self.config = config
        self.folder = folder
        self.engine: Engine = get_engine(config.worker.engine)
        self.worker: "WorkerHandle | None" = None
        self.side_workers: list["WorkerHandle"] = []  # launched by a stage with its own workers (paired)
        self.attempt_of = attempt_of  # the recorded run this one re-runs (servegate rerun)
        self.closed = False  # True once the gate stopped the worker on purpose
        self.device_slot = contextlib.ExitStack()  # the held device slot (hold_device_slot), released by close()
        self.deadline = time.monotonic() + config.max_wall_s
        self.overrun: str | None = None  # set (from a timer thread) when a stage ran past its deadline
        self._records: dict[str, Any] = {}  # stage -> StageRecord, as stages.json shows them

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def open(cls, config: GateConfig, *, parent: Path | None = None, attempt_of: str | None = None,
             documents: dict[str, Any] | None = None) -> "GateRun":
        """Check the suites, hold the device slot, make the run folder (under ``parent``, default
        ``config.output_dir``) with its config and ``documents`` (name -> JSON, e.g. ``rerun``)."""
        from servegate.results import RunFolder

        # A suite that cannot run (a typo in a type or a column) is found now, not after the
        # measurements: nothing is launched and no run folder is made.
        check_suites(config)
        held = hold_device_slot()  # before the folder: a run's start is when the device became ours
        try:
            folder = RunFolder.create(parent or Path(config.output_dir), config.name)
            try:
                folder.write_config(config)
                for name, doc in (documents or {}).items():
                    folder.write_json(name, doc)
            except BaseException:
                folder.discard()
                raise
            run = cls(config, folder, attempt_of=attempt_of)
            console.run_folder_opened(folder.path)
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

    def adopt_worker(self, handle: "WorkerHandle") -> None:
        """A worker a stage launched itself (the paired stage's): stopped with the gate's worker by a
        deadline and by ``close``."""
        self.side_workers = [h for h in self.side_workers if h.is_alive()] + [handle]
        if self.overrun is not None:
            handle.stop()

    def uses_worker(self, stages: "list[str] | tuple[str, ...]") -> bool:
        """Whether any of ``stages`` that is enabled measures the gate's own worker (so it is launched)."""
        return _measures_gate_worker(self.config, stages)

    def stop_worker(self) -> list[str]:
        """Stop the gate's worker (before a stage that runs its own), and an early-started one no launch
        adopted; teardown errors are returned."""
        from servegate.launch import discard_early

        self.closed = True
        try:
            discard_early()
            if self.worker is None:
                return []
            self.worker.stop()
        except InfraError as exc:
            logger.error("teardown failed: %s", exc)
            return [f"teardown: {exc}"]
        return []

    # -- whether a stage runs ---------------------------------------------------------------
    def skip_reason(self, stage: StageSpec, *upstream: StageResult) -> tuple[str, str] | None:
        """``(status, reason)`` when ``stage`` does not run — disabled, not applicable to the
        engine, or blocked by what came before (``upstream``: the results it depends on) — else None.

        A measurement needs a live worker and a successful flush just before it: measuring a
        worker that is not idle with a cold cache measures something else.
        """
        section = getattr(self.config, stage.section, None) if stage.section else None
        if section is not None and not getattr(section, "enabled", True):
            return "skipped", "disabled in config"
        if stage.needs and not getattr(self.engine, stage.needs, True):
            return "not_applicable", f"engine {self.engine.name} {stage.needs_why}"
        if stage.name == "launch":
            return None
        if self.overrun is not None:
            return "skipped", self.overrun
        if stage.own_workers:
            if self.config.baseline is None:
                return "skipped", "no baseline worker configured (set [baseline] to measure the worker against it)"
            return None
        if self.worker is None:
            return "skipped", "the worker was never launched (launch failed)"
        if not self.worker.is_alive():
            return "skipped", f"the worker exited (code {self.worker.returncode})"
        for before in upstream:
            if before.status == "failed":
                return "skipped", f"{before.stage} failed: {before.error}"
        return None

    # -- running a stage ----------------------------------------------------------------------
    def skipped(self, stage: str, status: str, reason: str) -> StageResult:
        """Record that ``stage`` did not run, and why."""
        result = StageResult(stage, status=status, error=reason)  # type: ignore[arg-type]
        self._keep(result, started_at=datetime.now(timezone.utc))
        console.stage_ended(stage, status, None, reason)
        return result

    @contextlib.contextmanager
    def stage(self, stage: str) -> Iterator[StageResult]:
        """Time a stage and record how it ended; yields the result the stage fills.

        A stage's own failure (any ``Exception``) is recorded in the result — status failed, the
        error, what it measured before kept as ``<table>.partial`` — and not raised, so that the
        flow goes on to tear down, validate and decide (inconclusive, never a pass). An interrupt
        (Ctrl-C, SIGTERM) is recorded and raised: the gate stops.
        """
        result = StageResult(stage)
        started_at = datetime.now(timezone.utc)
        timer = self._arm_deadline(stage)
        console.stage_started(stage)
        try:
            if self.overrun is not None and not self.closed:
                raise DeadlineError(self.overrun)
            yield result
            result.complete = True  # the measurement ended; a worker found dead now taints it, it is not partial
            self.check_worker(stage)
        except Exception as exc:
            result.status, result.error = "failed", self._describe_failure(stage, exc)
            logger.error("%s failed: %s", stage, result.error)
        except BaseException as exc:
            result.status, result.error = "failed", self._describe_failure(stage, exc)
            raise
        finally:
            timer.cancel()
            result.duration_s = time.perf_counter() - result.started
            try:
                self._keep(result, started_at=started_at)
            finally:
                console.stage_ended(stage, result.status, result.duration_s, result.error)

    def _keep(self, result: StageResult, started_at: datetime | None = None) -> None:
        """Write the result's tables and its record, at once. A stage that failed before its
        measurement ended keeps what it had as ``<table>.partial`` (on disk, never validated); one
        whose measurement ended but whose worker was then found dead keeps its tables (recorded and
        validated, the verdict inconclusive all the same: the breaches are listed, not trusted).
        ``started_at`` (UTC) goes into the manifest's record, so that the time between stages can be
        told from the stages (``benchmarks/gate_overhead.py``); a carried record has none."""
        for name, df in result.tables.items():
            if result.ok or result.complete:
                self.folder.write_table(name, df)
            elif df is not None and not df.empty:
                self.folder.write_table(f"{name}.partial", df)
        if not (result.ok or result.complete):
            result.tables = {}
        record = result.record()
        if started_at is not None:
            record.started_at = started_at
        self._records[record.stage] = record
        self.folder.write_json("stages", {name: r.model_dump(mode="json", exclude={"started_at"})
                                          for name, r in self._records.items()})
        self.folder.record_stage(record)

    def carry(self, result: StageResult) -> None:
        """Take a stage an earlier attempt measured (``servegate rerun``): its record, and its
        tables written into this run's folder, so the attempt is validated and kept whole."""
        self._keep(result)

    def check_worker(self, stage: str) -> None:
        """A stage that ran while the worker died measured a dying server: infra, not data."""
        if self.overrun is not None:
            raise DeadlineError(self.overrun)
        if self.worker is not None and not self.closed and not self.worker.is_alive():
            raise WorkerDiedError(
                f"the worker exited (code {self.worker.returncode}) during {stage}; its measurements are kept in "
                f"{self.path} but not trusted. Log tail:\n{self.worker.log_tail(20)}")

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
        for handle in [self.worker, *self.side_workers]:
            if handle is not None:
                try:
                    handle.stop()
                except InfraError as exc:
                    logger.error("stopping a worker after a deadline failed: %s", exc)

    def _describe_failure(self, stage: str, exc: BaseException) -> str:
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit(143), Prefect's TerminationSignal
            return f"interrupted ({'Ctrl-C' if isinstance(exc, KeyboardInterrupt) else 'SIGTERM'}) during {stage}"
        if self.overrun is not None and not isinstance(exc, DeadlineError):
            return f"DeadlineError: {self.overrun} (the stage then failed with {type(exc).__name__}: {exc})"
        message = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ServegateError):
            message = f"internal error ({message}); this is a servegate bug, please report it with the run folder"
        if (self.worker is not None and not self.closed and not isinstance(exc, WorkerDiedError)
                and self.worker.exited_within(EXIT_GRACE_S)):
            message += (f"\nThe worker exited during {stage} (code {self.worker.returncode}); "
                        f"log tail:\n{self.worker.log_tail(20)}")
        return message

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> list[str]:
        """End the worker's whole process tree, then release the device slot. Safe to call more than
        once; returns teardown errors (never raised: they must not hide the run's outcome)."""
        from servegate.launch import discard_early

        self.closed = True
        errors = []
        try:
            try:
                discard_early()
            except InfraError as exc:
                errors.append(f"teardown: {exc}")
                logger.error("teardown failed: %s", exc)
            for handle in [self.worker, *self.side_workers]:
                if handle is not None:
                    try:
                        handle.stop()
                    except InfraError as exc:
                        errors.append(f"teardown: {exc}")
                        logger.error("teardown failed: %s", exc)
        finally:
            self.device_slot.close()
        return errors
