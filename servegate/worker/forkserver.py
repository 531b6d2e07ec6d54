"""A fork server for embedded workers: one parent imports torch, transformers and the worker's code
once, and each new worker is a fork of it that loads its weights fresh.

A worker started with ``python -m servegate worker`` spends ~2.5 s of its ~3.3 s start importing
torch and transformers; a fork of a parent that has imported them starts in well under a second.
Each child is a whole worker: its own session (as ``start_new_session=True`` gives), its own log
file, the environment the caller gives it, ``servegate worker``'s own entry and exit. Only what
Python imported is shared (copy on write); the model is loaded by the child, so its memory is its
own, placed afresh at every start.

The parent stays single-threaded and never runs a tensor operation, so no thread pool exists to be
broken by ``fork``. It answers one request at a time on a Unix socket, one JSON line each way:

- ``{"op": "spawn", "argv": [...], "env": {...}, "log": path, "cwd": path}`` → ``{"pid": N}``
- ``{"op": "status", "pid": N}`` → ``{"returncode": None | int}`` (negative: the signal, as Popen)

It reaps its children, and when its owner goes (the pipe only the owner writes to closes, whatever
the way it died) it ends every child's session and exits. :class:`ForkServer` is the owner's side;
:class:`ForkedWorker` is a ``subprocess.Popen``-like handle on one child.

Used by the worker tests (tests/worker/conftest.py). Where a test's subject is how a worker process is
*started* (its command line), it starts one with ``python -m servegate worker`` instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["ForkServer", "ForkedWorker"]

READY_TIMEOUT_S = 120.0
"""How long the parent may take to import what it preloads and answer."""
REQUEST_TIMEOUT_S = 30.0
"""How long one request to the parent may take (a fork takes milliseconds)."""
POLL_S = 0.05
"""How often :meth:`ForkedWorker.wait` asks for a child's status."""


def _request(path: Path, message: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REQUEST_TIMEOUT_S)
        sock.connect(str(path))
        sock.sendall(json.dumps(message).encode() + b"\n")
        with sock.makefile("rb") as reader:
            line = reader.readline()
    if not line:
        raise RuntimeError(f"the fork server at {path} closed the connection without an answer")
    answer = json.loads(line)
    if "error" in answer:
        raise RuntimeError(f"the fork server refused {message.get('op')!r}: {answer['error']}")
    return answer


class ForkedWorker:
    """One forked worker, with the parts of ``subprocess.Popen`` the callers use."""

    def __init__(self, server: "ForkServer", pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _request(self._server.socket_path, {"op": "status", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(POLL_S)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The owner's side: start the parent, fork workers from it, stop it."""

    def __init__(self, folder: Path | None = None, env: dict[str, str] | None = None) -> None:
        """``folder``: where the server's own log goes (a new temporary folder when None)."""
        self._folder = Path(tempfile.mkdtemp(prefix="servegate-forkserver-", dir=folder))
        # A Unix socket's path has ~100 bytes (sun_path): a short folder of its own, whatever `folder` is.
        self._socket_folder = Path(tempfile.mkdtemp(prefix="sgfork-"))
        self.socket_path = self._socket_folder / "socket"
        if len(str(self.socket_path)) > 100:
            raise RuntimeError(f"the temporary folder's path is too long for a Unix socket ({self.socket_path}); "
                               f"set TMPDIR to a shorter folder")
        read_end, self._owner_fd = os.pipe()
        self._log = (self._folder / "forkserver.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "servegate.worker.forkserver", "--socket", str(self.socket_path),
             "--owner-fd", str(read_end)],
            pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True)
        os.close(read_end)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self.process.returncode} while starting: "
                                   f"{(self._folder / 'forkserver.log').read_text(errors='replace')[-2000:]}")
            with contextlib.suppress(OSError):
                _request(self.socket_path, {"op": "ping"})
                break
            if time.monotonic() >= deadline:
                self.stop()
                raise RuntimeError(f"the fork server did not answer within {READY_TIMEOUT_S:g} s")
            time.sleep(0.05)

    def spawn(self, argv: list[str], *, env: dict[str, str], log_path: Path, cwd: Path | None = None) -> ForkedWorker:
        """A new worker: ``servegate worker ARGV`` in a fork, with exactly ``env``, its output to ``log_path``."""
        answer = _request(self.socket_path, {"op": "spawn", "argv": list(argv), "env": dict(env),
                                             "log": str(log_path), "cwd": str(cwd or Path.cwd())})
        return ForkedWorker(self, answer["pid"], ["servegate", "worker", *argv])

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the parent; it ends the sessions of the children still running first."""
        if self._owner_fd >= 0:
            os.close(self._owner_fd)  # the parent sees EOF: ends its children, exits
            self._owner_fd = -1
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self._log.close()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
        with contextlib.suppress(OSError):
            self._socket_folder.rmdir()


# ---------------------------------------------------------------------------------------- the parent
def _preload() -> None:
    """Import what every worker imports (no tensor operation: no thread pool may exist at fork)."""
    import psutil  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import uvicorn  # noqa: F401
    # transformers imports lazily: the classes a Llama-shaped model (SmolLM2, tiny-random) resolves to.
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig,  # noqa: F401
                              LlamaForCausalLM, PreTrainedTokenizerFast)
    from transformers.models.auto import modeling_auto, tokenization_auto  # noqa: F401

    import servegate.cli  # noqa: F401
    import servegate.models  # noqa: F401
    import servegate.worker.cli  # noqa: F401
    import servegate.worker.fastpath  # noqa: F401
    import servegate.worker.scheduler  # noqa: F401
    import servegate.worker.server  # noqa: F401


def _child(request: dict[str, Any], listener: socket.socket, owner_fd: int) -> None:
    """In the fork: become ``servegate worker ARGV`` in a session of its own. Never returns."""
    status = 2
    try:
        listener.close()
        os.close(owner_fd)
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["servegate", "worker", *request["argv"]]
        from servegate.cli import entry

        entry()  # main, then servegate's own exit (os._exit with main's status)
    except SystemExit as exc:  # argparse's --help or a usage error
        status = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # noqa: BLE001 — whatever happened, the fork must not return into the parent's loop
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def _reap(children: dict[int, int | None]) -> None:
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children[pid] = os.waitstatus_to_exitcode(wait_status)


def _end_children(children: dict[int, int | None]) -> None:
    running = [pid for pid, code in children.items() if code is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)  # each child leads its own session, so its group is its tree
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            _reap(children)
            running = [pid for pid in running if children.get(pid) is None]
            if not running:
                return
            time.sleep(0.05)


def _answer(conn: socket.socket, children: dict[int, int | None], listener: socket.socket,
            owner_fd: int) -> None:
    with conn, conn.makefile("rb") as reader:
        conn.settimeout(REQUEST_TIMEOUT_S)
        line = reader.readline()
        try:
            request = json.loads(line)
            op = request.get("op")
            if op == "ping":
                answer: dict[str, Any] = {"ok": True}
            elif op == "spawn":
                pid = os.fork()
                if pid == 0:
                    _child(request, listener, owner_fd)
                children[pid] = None
                answer = {"pid": pid}
            elif op == "status":
                _reap(children)
                pid = int(request["pid"])
                if pid not in children:
                    raise KeyError(f"pid {pid} is not a child of this fork server")
                answer = {"returncode": children[pid]}
            else:
                raise ValueError(f"unknown op {op!r}")
        except (ValueError, KeyError, TypeError, OSError) as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        conn.sendall(json.dumps(answer).encode() + b"\n")


def serve(socket_path: Path, owner_fd: int) -> int:
    _preload()
    children: dict[int, int | None] = {}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(16)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # out through the finally: children ended
    try:
        while True:
            readable, _, _ = select.select([listener, owner_fd], [], [], 0.5)
            _reap(children)
            if owner_fd in readable and not os.read(owner_fd, 1):
                return 0  # the owner is gone (or stopped us)
            if listener in readable:
                conn, _ = listener.accept()
                _answer(conn, children, listener, owner_fd)
    finally:
        _end_children(children)
        listener.close()
        with contextlib.suppress(OSError):  # the owner may be gone: the socket's folder is ours to remove
            socket_path.unlink()
            socket_path.parent.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servegate.worker.forkserver", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, type=Path, help="the Unix socket to answer on")
    parser.add_argument("--owner-fd", required=True, type=int, help="read end of the owner's pipe (EOF: stop)")
    args = parser.parse_args(argv)
    return serve(args.socket, args.owner_fd)


if __name__ == "__main__":
    raise SystemExit(main())
