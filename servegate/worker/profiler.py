"""The worker's operator profiler: torch.profiler (CPU activity) in the scheduler thread, on request.

``--profiler-dir DIR`` turns on ``POST /start_profile`` and ``POST /stop_profile`` (vLLM's route
names; without the option they answer 404, as vLLM without a profiler). The HTTP handler only
queues a command and waits for its answer: the scheduler thread, which runs the model, starts and
stops the profiler between two steps (:meth:`StepProfiler.apply`), so that the trace holds whole
forward passes and the profiler's thread-local state lives in the thread that runs the operators.

``/stop_profile`` answers once the Chrome trace (``<DIR>/servegate-worker-<pid>.<ns>.pt.trace.json.gz``,
torch.profiler's Kineto format, gzipped as vLLM's) has been written.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

from servegate.errors import ConfigError

__all__ = ["StepProfiler", "ProfileCommand", "TRACE_SUFFIX"]

log = logging.getLogger(__name__)

TRACE_SUFFIX = ".pt.trace.json.gz"

ProfileCommand = Literal["start", "stop"]


class StepProfiler:
    """One torch.profiler session at a time, started and stopped by the scheduler thread.

    ``submit`` (any thread) returns a future the scheduler resolves in :meth:`apply`: ``None`` for
    ``start``, the trace's path for ``stop``; ``ConfigError`` for a start while profiling, or a stop
    without a start (the route answers 400).
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self._profile: Any = None
        self._pending: list[tuple[ProfileCommand, concurrent.futures.Future]] = []

    @property
    def active(self) -> bool:
        return self._profile is not None

    def submit(self, command: ProfileCommand) -> concurrent.futures.Future:
        """Queue ``command`` for the scheduler thread (the caller holds the scheduler's lock)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._pending.append((command, future))
        return future

    def has_pending(self) -> bool:
        return bool(self._pending)

    def take(self) -> list[tuple[ProfileCommand, concurrent.futures.Future]]:
        """The queued commands, removed (the caller holds the scheduler's lock)."""
        taken, self._pending = self._pending, []
        return taken

    def apply(self, commands: list[tuple[ProfileCommand, concurrent.futures.Future]]) -> None:
        """Run ``commands`` in the calling (scheduler) thread, between two steps."""
        for command, future in commands:
            try:
                future.set_result(self._start() if command == "start" else self._stop())
            except (ConfigError, OSError, RuntimeError) as exc:
                future.set_exception(exc)

    def abandon(self, message: str) -> None:
        """Fail every queued command and drop a running profile (the worker is shutting down)."""
        for _, future in self.take():
            future.set_exception(ConfigError(message))
        if self._profile is not None:
            try:
                self._profile.stop()
            except RuntimeError:  # pragma: no cover - torch refuses a stop it cannot do; nothing to keep
                pass
            self._profile = None

    def _start(self) -> None:
        import torch.profiler

        if self._profile is not None:
            raise ConfigError("the profiler is already running; POST /stop_profile first")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
        profile.start()
        self._profile = profile
        log.info("profiler started (traces go to %s)", self.out_dir)

    def _stop(self) -> str:
        if self._profile is None:
            raise ConfigError("the profiler is not running; POST /start_profile first")
        profile, self._profile = self._profile, None
        profile.stop()
        path = self.out_dir / f"servegate-worker-{os.getpid()}.{time.time_ns()}{TRACE_SUFFIX}"
        t0 = time.perf_counter()
        profile.export_chrome_trace(str(path))
        log.info("profiler stopped: %s written in %.2f s", path, time.perf_counter() - t0)
        return str(path)
