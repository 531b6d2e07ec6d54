"""Process trees: end one whole, and make sure none outlives the gate that started it.

Two tools, one job — no process survives the gate:

- :func:`end_session` / :func:`terminate_tree` end a tree on purpose (SIGTERM, wait, SIGKILL the
  survivors, then wait until every member is really gone, zombies included as gone). A caller
  that returns from them can rely on it: ``kill()`` only *sends* a signal, and a grandchild that
  was SIGKILLed is still "running" for a moment after ``killpg`` returns.
- :func:`guard_process_tree` covers the exits no ``finally`` sees: ``kill -9`` of the gate, or of
  its whole process group (a CI runner's timeout). It starts one small guardian process per gate
  process, in a session of its own so that the group kill misses it. The guardian keeps a
  snapshot of the gate's descendants (every second, and at once for each worker group the gate
  registers) and holds the read end of a pipe whose write end only the gate holds. When the gate
  dies by any means the kernel closes that pipe; the guardian then ends every process of the
  snapshot that still runs, and exits. SGLang uses ``PR_SET_PDEATHSIG`` for the same purpose; it
  fires when the *thread* that forked exits (Prefect runs tasks in worker threads), and it only
  reaches direct children, so a guardian is used instead.

The module imports nothing from servegate, so anything (launch, engine install, the CLI) can use it.
"""

from __future__ import annotations

import io
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time

import psutil

__all__ = ["KILL_WAIT_S", "descendants", "end_session", "exit_on_sigterm", "group_members", "guard_process_tree",
           "pin_tree", "terminate_tree", "tree_cpu_seconds", "wait_gone", "watch_group"]

logger = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
"""How long to wait for SIGKILLed processes to disappear."""
GUARD_SNAPSHOT_S = 1.0
"""How often the guardian re-reads the gate's descendants."""
GUARD_TERM_WAIT_S = 5.0
"""How long the guardian lets orphans end on SIGTERM before SIGKILL."""


def _is_gone(proc: psutil.Process) -> bool:
    # A zombie has exited; it only waits for its (possibly new) parent to reap it.
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until every process has exited; the ones still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if not _is_gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if not _is_gone(p)]
    return alive


def _send(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)  # psutil checks the pid still names the same process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def group_members(pgid: int) -> list[psutil.Process]:
    """Processes in process group ``pgid`` (orphans reparented away from the tree included)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def pin_tree(pid: int, cpus: set[int], passes: int = 3) -> None:
    """Set the CPU affinity of every thread of ``pid`` and its descendants to ``cpus``. A thread
    started during a pass inherits its creator's mask, pinned or not; the next pass finds it, and
    the passes end when one changes nothing. Threads and processes that end meanwhile are skipped.
    ``psutil.NoSuchProcess`` when ``pid`` itself is gone."""
    root = psutil.Process(pid)
    for _ in range(passes):
        changed = False
        for proc in [root, *descendants(pid)]:
            try:
                tids = [t.id for t in proc.threads()]
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            for tid in tids:
                try:
                    if os.sched_getaffinity(tid) != cpus:
                        os.sched_setaffinity(tid, cpus)
                        changed = True
                except ProcessLookupError:  # the thread ended
                    continue
        if not changed:
            return


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def tree_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of ``pid`` and every live descendant (each process's own, its exited
    threads included; clock-tick resolution); NaN when ``pid`` is gone. A descendant that exits between
    two reads takes its time with it: read around a span in which the tree does not change."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return math.nan
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            if proc is root:
                return math.nan
            continue
        total += times.user + times.system
    return total


def _end(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """SIGTERM, wait up to ``timeout_s``, SIGKILL the survivors and wait for them; the unkillable."""
    _send(procs, signal.SIGTERM)
    alive = wait_gone(procs, timeout_s)
    _send(alive, signal.SIGKILL)
    return wait_gone(alive, KILL_WAIT_S)


def terminate_tree(pid: int, timeout_s: float = 10.0) -> None:
    """End ``pid`` and all its descendants: SIGTERM, wait up to ``timeout_s``, SIGKILL survivors.

    For a worker started by ``launch_worker`` use ``WorkerHandle.stop()``, which also reaps the
    process and records its exit code.
    """
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    _end([root, *descendants(pid)], timeout_s)


def end_session(process: subprocess.Popen, timeout_s: float) -> None:
    """End a process started with ``start_new_session=True`` and everything in its group and tree.

    Returns once the leader is reaped and every other member has exited (or is a zombie waiting
    for its new parent), or after a final SIGKILL wait for members stuck in the kernel.
    """
    # Collect the tree before any signal: once a parent dies its children are reparented
    # and no longer show up as its descendants.
    pgid = process.pid
    others = {p.pid: p for p in descendants(process.pid)}
    others.update({p.pid: p for p in group_members(pgid) if p.pid != process.pid})
    procs = list(others.values())

    deadline = time.monotonic() + timeout_s
    _send(procs, signal.SIGTERM)
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        try:
            process.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            # Unkillable for now (e.g. stuck in the kernel on a GPU driver call); nothing more to do.
            logger.warning("pid %d did not exit %.0f s after SIGKILL", process.pid, KILL_WAIT_S)
    alive = wait_gone(procs, max(0.0, deadline - time.monotonic()))
    _send(alive, signal.SIGKILL)
    wait_gone(alive, KILL_WAIT_S)
    # Anything still in the group (e.g. forked during teardown) gets SIGKILL too.
    stragglers = [p for p in group_members(pgid) if not _is_gone(p)]
    _send(stragglers, signal.SIGKILL)
    left = wait_gone(stragglers, KILL_WAIT_S)
    if left:
        logger.warning("processes %s of group %d did not exit %.0f s after SIGKILL",
                       [p.pid for p in left], pgid, KILL_WAIT_S)


def _sigterm_to_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind the stack (``SystemExit(143)``) so that ``finally`` blocks, context
    managers and ``atexit`` run, when nobody else handles it. Only from the main thread (signal
    handlers can only be set there); a handler someone else installed is left alone (Prefect's
    flow engine raises its ``TerminationSignal``, which unwinds the stack too)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _sigterm_to_exit)


# ---- the guardian ---------------------------------------------------------------------------
_guard_lock = threading.Lock()
_guard: tuple[int, subprocess.Popen, io.FileIO] | None = None  # (owner pid, guardian, pipe's write end)


def guard_process_tree() -> None:
    """Start this process's guardian (idempotent; a forked child gets its own).

    From now on, however this process ends, its descendants end with it (module docstring).
    """
    global _guard
    with _guard_lock:
        if _guard is not None and _guard[0] == os.getpid() and _guard[1].poll() is None:
            return
        read_end, write_end = os.pipe()
        try:
            guardian = subprocess.Popen(
                [sys.executable, "-m", "servegate.proctree", "--guard", str(os.getpid()), str(read_end)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(read_end,), start_new_session=True)
        finally:
            os.close(read_end)
        # os.pipe() fds are not inheritable: no worker holds the write end, so it closes with us.
        _guard = (os.getpid(), guardian, os.fdopen(write_end, "wb", buffering=0))


def watch_group(pgid: int) -> None:
    """Tell the guardian at once about a new process group (a launched worker), so that a kill
    within the next snapshot interval does not miss it. A no-op without a guardian."""
    with _guard_lock:
        if _guard is None or _guard[0] != os.getpid():
            return
        try:
            _guard[2].write(f"{pgid}\n".encode())
        except OSError:
            pass  # the guardian is gone; the in-process teardown still runs


def _follow_groups(groups: set[int], tracked: dict[int, psutil.Process]) -> set[int]:
    """Track every member of the watched process groups; return the groups that still have members.

    A group found empty is forgotten at once: Linux does not reuse an id while a group of that id
    exists, but an empty group's id may go to an unrelated process (a busy machine cycles through
    its 32768 pids), and ending "its" members then would end a stranger's processes (another
    gate's workers were stopped that way).
    """
    alive = set()
    for pgid in groups:
        members = group_members(pgid)
        for proc in members:
            tracked.setdefault(proc.pid, proc)
        if members:
            alive.add(pgid)
    return alive


def _guardian_main(owner_pid: int, fd: int) -> int:
    """The guardian's loop (runs in its own process): snapshot the owner's tree until the pipe
    closes, then end what is left of it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the gate, not here
    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        return 0
    tracked: dict[int, psutil.Process] = {}
    groups: set[int] = set()
    buffered = b""
    while True:
        try:
            for proc in owner.children(recursive=True):
                if proc.pid != os.getpid():
                    tracked.setdefault(proc.pid, proc)
        except psutil.NoSuchProcess:
            break
        groups = _follow_groups(groups, tracked)
        tracked.pop(os.getpid(), None)
        tracked = {pid: p for pid, p in tracked.items() if not _is_gone(p)}
        ready, _, _ = select.select([fd], [], [], GUARD_SNAPSHOT_S)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break  # the owner closed the pipe: it is exiting or dead
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            groups.update(int(line) for line in lines if line.strip().isdigit())
    _follow_groups(groups, tracked)
    # The owner may still be running its own teardown (a normal exit closes the pipe last):
    # give it the same grace a worker gets before anything is signalled.
    try:
        owner.wait(timeout=GUARD_TERM_WAIT_S)
    except (psutil.TimeoutExpired, psutil.NoSuchProcess):
        pass
    _end([p for p in tracked.values() if not _is_gone(p)], GUARD_TERM_WAIT_S)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--guard":
        raise SystemExit(_guardian_main(int(sys.argv[2]), int(sys.argv[3])))
    raise SystemExit("usage: python -m servegate.proctree --guard OWNER_PID FD (started by servegate itself)")
