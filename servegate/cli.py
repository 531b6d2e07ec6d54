"""The servegate command line: builds the parser from :mod:`servegate.commands` (one module per
command or group: run, worker, model, profiles, status/report/baseline, rerun, engine,
calibrate) and runs the chosen command.

Exit codes (:class:`servegate.verdict.ExitCode`): 0 pass, 1 regression (fail), 2 could not decide
(inconclusive, bad input, infra failure, interruption, a crash). :func:`main` maps every error
to 2 here, so a command never exits 1 unless a verdict said "regression".
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import NoReturn

from servegate.commands import add_commands
from servegate.console import configure_logging
from servegate.errors import ConfigError, ServegateError

__all__ = ["main", "entry", "build_parser"]


def _quiet_defaults() -> None:
    # Nothing can be fetched from a model hub here, and no analytics leave the machine.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect's ephemeral API server needs ~8-14 s on 2 busy cores; its 20 s default is too tight.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def build_parser() -> argparse.ArgumentParser:
    """The ``servegate`` parser, every command added by its module in :mod:`servegate.commands`."""
    parser = argparse.ArgumentParser(prog="servegate", description="A regression gate for LLM serving engines.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show every library's INFO log lines in the terminal (they always go to the run "
                             "folder's gate.log)")
    add_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


def _is_termination(exc: BaseException) -> bool:
    """SIGTERM as it reaches main: servegate's handler raises SystemExit(143); Prefect's flow
    engine raises its TerminationSignal (looked up only if Prefect was imported)."""
    if isinstance(exc, SystemExit):
        return exc.code == 128 + signal.SIGTERM
    prefect_exceptions = sys.modules.get("prefect.exceptions")
    return prefect_exceptions is not None and isinstance(exc, prefect_exceptions.TerminationSignal)


def _report_crash(exc: Exception) -> None:
    """Anything not mapped to a ServegateError: exit 2 (could not decide), never 1 (a regression)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = f" writing {exc.filename}" if exc.filename else ""
        print(f"servegate: error: no space left on device{where}; free disk space (or point --output-dir and "
              f"SERVEGATE_DB elsewhere) and run again. Verdict: could not decide.", file=sys.stderr)
        return
    print(f"servegate: internal error: {type(exc).__name__}: {exc}. Verdict: could not decide. This is a "
          f"servegate bug: please report it with the traceback below and the run folder.", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)


def _could_not_decide() -> int:
    # Imported here, not at the top: building the parser (and --help) does without pydantic, and a
    # failure while the command's own imports run still ends in this exit code.
    from servegate.verdict import ExitCode

    return ExitCode.UNDECIDED


_SECRET_OVERRIDES = ("worker.api_key=", "baseline.api_key=")


def secrets_on_command_line(args: argparse.Namespace) -> list[str]:
    """Warnings for secrets given as arguments, which every user of the machine reads in ``ps``: a
    database URL with a password (``--db``, ``--set store.url=``) and an API key (``--set
    worker.api_key=``). They still work; the warning says where the secret should go instead."""
    from servegate.config import redact_url

    out = []
    db = getattr(args, "db", None)
    if db and redact_url(db) != db:
        out.append("--db holds a password, which every user of this machine can read in `ps`; "
                   "put the URL in $SERVEGATE_DB instead")
    for item in getattr(args, "overrides", None) or []:
        key, _, value = item.partition("=")
        if item.startswith(_SECRET_OVERRIDES) and value:
            out.append(f"--set {key}=... puts the key where every user of this machine can read it (`ps`); "
                       f"put it in an environment variable and --set {key}_env=NAME instead")
        elif key.strip() == "store.url" and redact_url(value) != value:
            out.append("--set store.url=... holds a password, which every user of this machine can read in "
                       "`ps`; put the URL in $SERVEGATE_DB instead")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_defaults()
    args = build_parser().parse_args(argv)
    configure_logging(verbose=args.verbose)
    for warning in secrets_on_command_line(args):
        print(f"servegate: warning: {warning}", file=sys.stderr)
    command = getattr(args, "func", None)
    if command is None:  # every command module sets func; argparse guarantees a known command
        raise AssertionError(f"unhandled command {args.command!r}")
    try:
        return command(args)
    except ConfigError as exc:
        print(f"servegate: error: {exc}", file=sys.stderr)
        return _could_not_decide()
    except ServegateError as exc:
        print(f"servegate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _could_not_decide()
    except KeyboardInterrupt:
        print("servegate: interrupted; the worker was stopped. Verdict: could not decide.", file=sys.stderr)
        return _could_not_decide()
    except BaseException as exc:
        if _is_termination(exc):
            print("servegate: terminated (SIGTERM); the worker was stopped and what was measured is kept in the "
                  "run folder. Verdict: could not decide.", file=sys.stderr)
            return _could_not_decide()
        if not isinstance(exc, Exception):
            raise
        _report_crash(exc)
        return _could_not_decide()


def entry() -> NoReturn:
    """The ``servegate`` command (console script and ``python -m servegate``): :func:`main`, then an exit
    that leaves out the interpreter's own tear-down.

    Freeing what torch, transformers, GX and Prefect loaded took ~2 s after every gate (measured: a
    smoke gate's ``main`` returned at 43.65 s, its process ended at 45.93 s). Everything an exit must
    do is done first: other non-daemon threads are joined, the log records queued for Prefect's API are
    sent (:func:`_send_prefect_logs`, the one step Python would take later), the exit hooks run (the
    worker's tree, Prefect's temporary API server), logging is shut down (files flushed and closed) and
    the standard streams flushed; then the process ends with ``main``'s status. An exception out of
    ``main`` (``--help``, a crash ``main`` does not map) takes the usual way out.
    """
    status = main()
    _exit_now(0 if status is None else status)


def _exit_now(status: int) -> NoReturn:
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    try:
        _send_prefect_logs()
        atexit._run_exitfuncs()  # CPython's own exit hooks, run as at a normal exit (then cleared)
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def _send_prefect_logs() -> None:
    """Send the log records still queued for Prefect's API while its temporary server is up.

    One of the exit hooks stops that server, and ``logging.shutdown`` after them flushes Prefect's API
    log handler: into a stopped server, so the flow run's last records were lost and the flush waited
    out its 5 s timeout (5.3 s of a smoke gate's 8.4 s after the flow, py-spy). Sent first, the queue
    is empty by then. Nothing to do when Prefect's logging was never imported. Whatever goes wrong here
    is Prefect's log delivery only: it must not keep the exit hooks, which stop processes, from running.
    """
    handlers = sys.modules.get("prefect.logging.handlers")
    if handlers is not None:
        with contextlib.suppress(Exception):
            handlers.APILogWorker.drain_all(timeout=5)


if __name__ == "__main__":
    entry()
