"""Launch an inference worker with a bounded memory budget, wait for readiness, end its tree.

The worker is started from an argument list in its own session (own process group), with
stdout and stderr streamed to a log file. Readiness is polled with backoff (retries belong
to launch). A process that exits during start-up fails the launch at once; exit by SIGKILL
is reported as a likely out-of-memory kill with the memory budget in the message.

No process survives the gate: ``WorkerHandle.stop()`` ends the whole tree (descendants found
with psutil plus anything left in the worker's process group: SIGTERM, wait, SIGKILL), and
every live handle is also stopped

- on any exception or ``KeyboardInterrupt`` inside ``launch_worker`` and inside ``with handle:``;
- at interpreter exit (``atexit``);
- on SIGTERM: when the process has no SIGTERM handler of its own (``SIG_DFL``) and the first
  launch runs in the main thread, servegate installs one that raises ``SystemExit(143)`` so that
  ``finally`` blocks, context managers and ``atexit`` run. A handler someone else installed —
  Prefect's flow engine installs one that raises ``TerminationSignal`` during a flow run — is
  left alone: it also unwinds the stack, which stops the handles.

``servegate run`` starts the worker's process early (:func:`start_early`, the same start as
``launch_worker``'s), so that its model load overlaps the gate's own set-up; the launch stage's
``launch_worker`` adopts it, and one that no launch adopted is stopped by :func:`discard_early`.

What a launch costs is recorded on the handle: ``startup_s`` (from just before the process starts to
the first ready probe, which a thread sends from the start on, an early-started process's too) and
``memory`` (:class:`MemoryHighWater`, the resident memory of the worker's whole process tree sampled
with psutil from the launch until ``stop()``).

A SIGKILL of the gate itself (or of its process group) cannot be caught: for that, every
launch starts the process's guardian (``servegate.proctree.guard_process_tree``) and registers
the worker's group with it; the guardian ends the worker's tree when the gate is gone.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType

import psutil
import requests

from servegate.config import WorkerSpec, redact_url
from servegate.engines import Engine, get_engine
from servegate.errors import (ConfigError, ServerUnreachableError, StageError, WorkerDiedError, WorkerLaunchError,
                              WorkerOOMError)
from servegate.http import make_session
from servegate.proctree import end_session, exit_on_sigterm, guard_process_tree, pin_tree, watch_group

__all__ = ["WorkerHandle", "MemoryHighWater", "launch_worker", "start_worker", "start_early", "discard_early",
           "free_port"]

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 5.0
"""After a request to a worker failed: how long its exit may take to show (a worker that crashed is
often still exiting when the first request to it fails); the error then names the exit, not only the
refused connection."""

PROBE_TIMEOUT_S = 30.0
"""Longest single readiness probe (SGLang's /health_generate runs a 1-token generate)."""
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 0.5
"""Readiness probes back off from 0.1 s to at most this: a worker is seen ready within half a second
(at 2 s, a 5-7 s start-up was seen up to 2 s late: every paired restart, every gate's launch, paid it).
A probe of a server still starting is a refused connection: cheap at any rate."""


MEMORY_SAMPLE_S = 0.5
"""How often the worker tree's resident memory is sampled. An inference worker's memory is a plateau
(weights and the KV pool are allocated at start-up and kept), which half-second samples find; a spike
shorter than this can be missed."""
TREE_REFRESH_SAMPLES = 10
"""Descendants are looked up every this many samples (every 5 s): that is a scan of /proc, 2-10 ms of the
gate process's time on a 120-process host, which also runs the load generator; the known processes'
memory (one small /proc read each) every sample. Engines start their subprocesses while loading, long
before the measurements."""
MIB = 1024 * 1024


class MemoryHighWater:
    """The high-water mark of the resident memory (RSS) of a process and all its descendants, summed,
    sampled every ``interval_s`` in a daemon thread from :meth:`start` to :meth:`stop`.

    Why sampling and not ``getrusage(RUSAGE_CHILDREN).ru_maxrss``: that is the largest single process
    among the *terminated and waited-for* children of the gate — known only after the worker exits,
    blind to a worker's own subprocesses it did not wait for (vLLM's engine core), and never the sum of
    a tree whose processes peak together. Summed RSS counts pages the tree's processes share once per
    process: for a multi-process engine it is an upper bound, for the embedded worker (one process) exact
    to the sampling interval.
    """

    def __init__(self, pid: int, interval_s: float = MEMORY_SAMPLE_S) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.samples = 0
        self._root: psutil.Process | None = None
        self._tree: list[psutil.Process] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"servegate-rss-{pid}", daemon=True)

    def start(self) -> "MemoryHighWater":
        try:
            self._root = psutil.Process(self.pid)
        except psutil.Error:
            return self  # exited already: the launch reports that
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def sample(self) -> int:
        """Sample now (also the loop's step): the tree's summed RSS in bytes, 0 once it is gone."""
        with self._lock:
            if self._root is None:
                return 0
            if self.samples % TREE_REFRESH_SAMPLES == 0 or not self._tree:
                try:
                    self._tree = [self._root, *self._root.children(recursive=True)]
                except psutil.Error:
                    self._tree = []
            total = 0
            for proc in self._tree:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass  # exited between the lookup and the read
            self.samples += 1
            self.peak_bytes = max(self.peak_bytes, total)
            return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB if self.samples else math.nan


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (another process may still take it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _connect_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def worker_base_environ(spec: WorkerSpec) -> dict[str, str]:
    """The environment a launched worker inherits from the gate, without the gate's own secrets: the
    variable that holds the worker's key (``worker.api_key_env``: the engine gets the key under its own
    variable, :meth:`Engine.launch_env`) and the history database's password (``SERVEGATE_DB`` keeps
    its URL, password hidden: the worker never writes the history). Anything else passes, so that an
    engine still finds ``HF_TOKEN``, proxies and thread settings."""
    env = dict(os.environ)
    if spec.api_key_env:
        env.pop(spec.api_key_env, None)
    if "SERVEGATE_DB" in env:
        env["SERVEGATE_DB"] = redact_url(env["SERVEGATE_DB"]) or ""
    return env


def _digest(environ: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(environ.items())).encode()).hexdigest()


def _redacted(cmd: list[str]) -> str:
    shown = list(cmd)
    for i, arg in enumerate(shown[:-1]):
        if arg == "--api-key":
            shown[i + 1] = "***"
    return shlex.join(shown)


def _read_tail(path: Path, n_lines: int, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return "<no log>"
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n_lines:])


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class WorkerHandle:
    """A launched (or, for engine "external", attached) worker. Use as a context manager."""

    def __init__(self, spec: WorkerSpec, engine: Engine, base_url: str, log_path: Path,
                 process: subprocess.Popen[bytes] | None, command: list[str] | None = None,
                 started: float | None = None, environ: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.engine = engine
        self.base_url = base_url
        self.log_path = log_path
        self.command = command
        self.environ_digest = None if environ is None else _digest(environ)
        """What the environment the process was started with was, as a digest: it may hold the worker's key."""
        self._process = process
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.started = time.perf_counter() if started is None else started
        """``time.perf_counter()`` just before the process started (attached: when the handle was made)."""
        self.startup_s: float | None = None
        """Seconds from just before the process started to the first ready probe (None: attached)."""
        self.ready_rss_mib = math.nan
        """The tree's resident memory when it was ready (MiB)."""
        self._ready_watch: _ReadyWatch | None = None
        self.memory = MemoryHighWater(process.pid).start() if process is not None else None
        self.table: object | None = None
        """The launch stage's ``worker`` table (a pandas frame), refreshed in place after each stage on
        this worker (``servegate.stages.refresh_worker_table``)."""
        self.launch_note: str | None = None
        """How the launch came to this process when it was not a plain start: an early-started process
        adopted, or one not adopted and why (the launch stage's remark in stages.json)."""

    @property
    def pid(self) -> int | None:
        """The worker's pid; None for an attached external server."""
        return self._process.pid if self._process is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit code once the process has exited (negative: killed by that signal); else None."""
        return self._process.poll() if self._process is not None else None

    def is_alive(self) -> bool:
        """Whether the worker process runs (always True for an attached external server)."""
        return self._process is None or self._process.poll() is None

    def exited_within(self, timeout_s: float) -> bool:
        """Whether the worker process has exited or exits within ``timeout_s`` (False for an attached
        external server). A worker that crashed is often still exiting when the first request to it fails."""
        if self._process is None:
            return False
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def log_tail(self, n_lines: int = 50) -> str:
        """The last ``n_lines`` lines of the worker's log."""
        return _read_tail(self.log_path, n_lines)

    def check_alive(self) -> None:
        """Raise ``WorkerDiedError`` (exit code, log tail) when the worker process has exited."""
        if self._process is None:
            return
        rc = self._process.poll()
        if rc is None:
            return
        if self._stopped:
            raise WorkerDiedError(f"the {self.engine.name} worker (pid {self.pid}) was stopped by servegate "
                                  f"(exit code {rc}); launch a new one")
        how = f"exit code {rc}"
        if rc == -signal.SIGKILL:
            how += " (SIGKILL — likely the OOM killer; lower the memory budget)"
        elif rc < 0:
            how += f" ({_signal_name(rc)})"
        raise WorkerDiedError(
            f"the {self.engine.name} worker (pid {self.pid}) exited while the gate was using it: {how}; "
            f"see the log {self.log_path}; log tail:\n{self.log_tail()}"
        )

    def wait_ready(self) -> None:
        """Wait until a worker :func:`start_worker` started is ready; stop it and raise what made it
        fail (exit, OOM kill, not ready within ``ready_timeout_s``, a signal while waiting)."""
        if self._ready_watch is None:  # attached: probed ready when attached
            return
        try:
            self._ready_watch.result()
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the whole process tree (SIGTERM, wait ``timeout_s``, SIGKILL). Idempotent."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        _LIVE_HANDLES.discard(self)
        if self.memory is not None:
            self.memory.stop()
        if self._process is not None:
            end_session(self._process, timeout_s)

    def __enter__(self) -> "WorkerHandle":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"WorkerHandle(engine={self.engine.name!r}, base_url={self.base_url!r}, pid={self.pid})"


_LIVE_HANDLES: set[WorkerHandle] = set()
_atexit_registered = False
_sigterm_checked = False


def _stop_all_workers() -> None:
    for handle in list(_LIVE_HANDLES):
        handle.stop()


def _install_exit_hooks() -> None:
    global _atexit_registered, _sigterm_checked
    if not _atexit_registered:
        atexit.register(_stop_all_workers)
        _atexit_registered = True
    # signal.signal works only in the main thread; Prefect may run tasks in worker threads,
    # so keep trying on later launches until one happens in the main thread.
    if not _sigterm_checked and threading.current_thread() is threading.main_thread():
        _sigterm_checked = True
        exit_on_sigterm()


def _startup_exit_error(handle: WorkerHandle, rc: int) -> WorkerLaunchError:
    tail = handle.log_tail()
    cmd = _redacted(handle.command or [])
    if rc == -signal.SIGKILL:
        fields = ", ".join(f"{k}={v}" for k, v in handle.spec.budget().settings().items())
        knobs = ", ".join(handle.engine.oom_knobs()) or "the memory budget fields"
        return WorkerOOMError(
            f"the {handle.engine.name} worker was killed by SIGKILL during start-up — likely the OOM killer; "
            f"memory budget (profile {handle.spec.memory_profile!r}): {fields}; lower it ({knobs}) or pick a "
            f"smaller memory_profile; command: {cmd}; log {handle.log_path}; log tail:\n{tail}"
        )
    how = f"exit code {rc}" + (f" ({_signal_name(rc)})" if rc < 0 else "")
    return WorkerLaunchError(
        f"the {handle.engine.name} worker exited during start-up with {how}; read the log tail below "
        f"(full log: {handle.log_path}); command: {cmd}; log tail:\n{tail}"
    )


def _wait_ready(handle: WorkerHandle, session: requests.Session, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay = FIRST_BACKOFF_S
    last_probe = "no probe answered yet"
    probe_url = handle.base_url + handle.engine.readiness_path
    while True:
        process = handle._process
        if process is not None and (rc := process.poll()) is not None:
            raise _startup_exit_error(handle, rc)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            where = f"; log {handle.log_path}; log tail:\n{handle.log_tail()}" if process is not None else ""
            raise WorkerLaunchError(
                f"the {handle.engine.name} worker at {handle.base_url} was not ready after {timeout_s:g} s "
                f"(probe {probe_url}: {last_probe}); raise worker.ready_timeout_s if it is still loading, "
                f"or read its log{where}"
            )
        try:
            if handle.engine.is_ready(session, handle.base_url, min(remaining, PROBE_TIMEOUT_S)):
                return
            last_probe = "answered, but not ready"
        except (requests.RequestException, ServerUnreachableError, StageError) as exc:
            last_probe = f"{type(exc).__name__}"  # connection refused while the server starts
        pause = min(delay, max(0.0, deadline - time.monotonic()))
        delay = min(delay * 1.5, MAX_BACKOFF_S)
        if process is not None:
            try:
                process.wait(timeout=pause)  # returns early when the worker exits
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(pause)


def launch_worker(spec: WorkerSpec, log_path: Path, *, ready_timeout_s: float | None = None,
                  engine: Engine | None = None) -> WorkerHandle:
    """Start the worker ``spec`` describes and wait until it is ready: :func:`start_worker`, then
    :meth:`WorkerHandle.wait_ready`."""
    handle = start_worker(spec, log_path, ready_timeout_s=ready_timeout_s, engine=engine)
    handle.wait_ready()
    return handle


def start_worker(spec: WorkerSpec, log_path: Path, *, ready_timeout_s: float | None = None,
                 engine: Engine | None = None) -> WorkerHandle:
    """Start the worker ``spec`` describes, without waiting for it to be ready
    (:meth:`WorkerHandle.wait_ready` waits): several workers start up side by side this way (the
    paired stage's two), each known to the caller's teardown from its start.

    ``spec.port == 0`` picks a free port. The worker's stdout and stderr go to ``log_path``
    (appended; the command line, API key redacted, is written first). An engine that does not
    launch (``engine.launches`` False: "external") starts nothing: it waits for ``spec.url`` to be
    ready and returns a handle without a process.
    ``engine`` overrides ``get_engine(spec.engine)`` (tests launch a stand-in server this way).

    A process :func:`start_early` started for exactly this launch (the same command and
    environment) is adopted instead of starting a second one: its log moves to ``log_path``. Readiness
    is probed from the process's start, in a thread (``_ReadyWatch``), so ``startup_s`` and
    ``ready_timeout_s`` count from its real start, an adopted one's too.

    Raises ``WorkerLaunchError`` (executable missing; an external server not ready in time) and
    ``ConfigError`` (bad timeout); :meth:`WorkerHandle.wait_ready` raises ``WorkerOOMError`` (SIGKILL
    during start-up) and ``WorkerLaunchError`` (other exit, not ready in time).
    """
    timeout_s = spec.ready_timeout_s if ready_timeout_s is None else ready_timeout_s
    if isinstance(timeout_s, bool) or math.isnan(timeout_s) or math.isinf(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"ready_timeout_s must be a finite number > 0 (seconds), got {timeout_s!r}")
    engine = engine or get_engine(spec.engine)
    log_path = Path(log_path)

    if not engine.launches:
        assert spec.url, "WorkerSpec requires worker.url of an engine that attaches"
        handle = WorkerHandle(spec, engine, spec.url.rstrip("/"), log_path, None)
        with make_session(spec.api_key_value()) as session:
            _wait_ready(handle, session, timeout_s)
        return handle

    handle, note = _adopt_early(spec, engine, log_path, timeout_s)
    if handle is None:
        handle = _start(spec, engine, log_path, timeout_s)
    handle.launch_note = note
    return handle


class _ReadyWatch:
    """The readiness wait of a started process, run in a thread from the moment it starts: ``startup_s``
    is then the worker's own start-up, however late the gate asks (an early-started worker's launch
    stage comes 10-40 s after its start, when probing only then would count the gate's set-up too)."""

    def __init__(self, handle: "WorkerHandle", timeout_s: float) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, name=f"servegate-ready-{handle.pid}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        handle = self.handle
        try:
            with make_session(handle.spec.api_key_value()) as session:
                _wait_ready(handle, session, self.timeout_s)
            if handle.spec.cpus and handle.engine.pins_after_start:
                try:
                    pin_tree(handle.pid, set(handle.spec.cpus))
                except psutil.NoSuchProcess:
                    pass  # it exited right after answering: the gate's next use of it says so
            handle.startup_s = time.perf_counter() - handle.started
            if handle.memory is not None:
                handle.ready_rss_mib = handle.memory.sample() / MIB
        except BaseException as exc:  # raised again in the thread that waits for the launch
            self._error = exc

    def result(self) -> None:
        """Wait until the worker is ready; raise what made it fail (exit, OOM kill, timeout)."""
        while self._thread.is_alive():
            self._thread.join(0.2)  # short joins: a signal handler (Ctrl-C, SIGTERM) runs in between
        if self._error is not None:
            raise self._error


def _launch_environ(spec: WorkerSpec, engine: Engine) -> dict[str, str]:
    """The environment a worker's process starts with (and what an early-started one is matched on).
    PYTHONUNBUFFERED so that the log tail shows the last words of a crashing Python worker."""
    return {**worker_base_environ(spec), "PYTHONUNBUFFERED": "1", **engine.launch_env(spec)}


def _start(spec: WorkerSpec, engine: Engine, log_path: Path, ready_timeout_s: float) -> WorkerHandle:
    """Start the worker's process — argument list, own session, its group registered with the guardian,
    output to ``log_path`` — and its readiness wait (:class:`_ReadyWatch`), without waiting: the one
    place a worker is started."""
    port = spec.port or free_port(spec.host)
    cmd = engine.launch_command(spec, port)
    env = _launch_environ(spec, engine)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _install_exit_hooks()
    guard_process_tree()
    started = time.perf_counter()
    with open(log_path, "ab") as log:
        log.write(f"# servegate: launching {engine.name}: {_redacted(cmd)}\n".encode())
        log.flush()
        try:
            # worker.cpus: the affinity is set in the child before exec, so every thread and
            # process of the worker's tree inherits it (setting it afterwards would race them), or,
            # for an engine that allows it (pins_after_start), on the whole tree once it is ready.
            cpus = set(spec.cpus) if spec.cpus and not engine.pins_after_start else None
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True, close_fds=True,
                                       preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
            watch_group(process.pid)
        except OSError as exc:
            raise WorkerLaunchError(
                f"could not start the {engine.name} worker ({_redacted(cmd)}): {exc}; check that the engine is "
                f"installed, or point worker.python at the interpreter of its virtualenv"
            ) from exc
    handle = WorkerHandle(spec, engine, f"http://{_connect_host(spec.host)}:{port}", log_path, process, cmd,
                          started=started, environ=env)
    _LIVE_HANDLES.add(handle)
    handle._ready_watch = _ReadyWatch(handle, ready_timeout_s)
    return handle


# ---- starting the worker early ----------------------------------------------------------------
# The worker's start-up (interpreter, lazy imports, model load: 5-15 s) need not wait for the gate's
# own (Prefect's API server, the flow's set-up: another 8-14 s): `servegate run` starts the process
# first, and the launch stage adopts it. Still one launch path (_start), one handle, one teardown.
_early_lock = threading.Lock()
_early: WorkerHandle | None = None


def start_early(spec: WorkerSpec, log_path: Path, *, engine: Engine | None = None) -> WorkerHandle | None:
    """Start the process that a later ``launch_worker(spec, ...)`` in this process will adopt, without
    waiting for it (one at a time: a previous one nobody adopted is stopped). Nothing starts for an
    engine that attaches (None). The caller must :func:`discard_early` when the launch does not happen."""
    global _early
    engine = engine or get_engine(spec.engine)
    if not engine.launches:
        return None
    discard_early()
    handle = _start(spec, engine, Path(log_path), spec.ready_timeout_s)
    with _early_lock:
        _early = handle
    logger.info("started the %s worker early (pid %s), for the launch stage to adopt", engine.name, handle.pid)
    return handle


def discard_early() -> None:
    """Stop the process :func:`start_early` started if no launch adopted it (the launch stage was skipped
    or never reached), and delete its log. A no-op otherwise."""
    global _early
    with _early_lock:
        handle, _early = _early, None
    if handle is None:
        return
    handle.stop()
    logger.info("stopped the early-started %s worker (pid %s): no launch adopted it", handle.engine.name, handle.pid)
    handle.log_path.unlink(missing_ok=True)


def _adopt_early(spec: WorkerSpec, engine: Engine, log_path: Path,
                 ready_timeout_s: float) -> tuple[WorkerHandle | None, str | None]:
    """``(the early-started process, what happened)``: the process when it is exactly what this launch
    would start (same spec, command, environment and readiness timeout), its log moved to ``log_path``;
    else None, and a process that differs is stopped. The note says which (None: nothing started early)."""
    global _early
    with _early_lock:
        handle, _early = _early, None
    if handle is None:
        return None, None
    port = int(handle.base_url.rsplit(":", 1)[1])
    watch = handle._ready_watch
    same = (handle.spec == spec and type(handle.engine) is type(engine)
            and handle.environ_digest == _digest(_launch_environ(spec, engine))
            and handle.command == engine.launch_command(spec, port)
            and watch is not None and watch.timeout_s == ready_timeout_s)
    # One that exited during start-up is adopted all the same: the launch then reports its exit and log.
    why = None if same else "it was started for a different launch"
    if why is None:
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            if log_path.exists():
                why = f"{log_path} exists already"
            else:
                os.replace(handle.log_path, log_path)  # the same filesystem (the run folder's parent)
                handle.log_path = log_path
        except OSError as exc:
            why = f"its log could not move to {log_path}: {exc}"
    if why is not None:
        logger.info("not adopting the early-started worker (pid %s): %s; starting a fresh one", handle.pid, why)
        handle.stop()
        handle.log_path.unlink(missing_ok=True)
        return None, (f"the worker process started early (pid {handle.pid}) was not adopted: {why}; "
                      f"this launch started a fresh one")
    ahead = time.perf_counter() - handle.started
    return handle, (f"adopted the worker process started early (pid {handle.pid}, {ahead:.1f} s before this stage), "
                    f"the same command and environment this launch would start; startup_s counts from its start")
