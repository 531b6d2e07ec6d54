"""What a person sees while a gate runs: the stages as they go, and nothing from the libraries.

Quiet by default. Third-party INFO logs (Prefect's API client, httpx, Great Expectations'
registries, transformers' progress bars) never reach the terminal; they go to the run folder's
``gate.log`` (everything at INFO and above, servegate's own lines included). ``-v`` brings them
back to the terminal as well.

The stages are shown on stderr (stdout keeps the verdict table or the ``--json`` document):

- on a terminal (and not under ``CI=true``), a live view (rich): one line per stage with a
  spinner, its elapsed time, how far it is (:func:`progress`: the load's finished requests) and
  what it waits on, turning into a mark and its duration;
- otherwise (CI logs, a pipe), no animation: one plain line per stage when it ends.

The gate reports to this module through :func:`stage_started`, :func:`stage_ended` and
:func:`run_folder_opened` (``servegate.runstate``); without an installed view (library use, the
tests' in-process flows) they do nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

__all__ = ["configure_logging", "install", "uninstall", "stage_started", "stage_ended", "progress", "run_folder_opened",
           "is_interactive", "LOG_FILE", "ENV_SET"]

LOG_FILE = "gate.log"
"""The run folder's log: every record at INFO and above while the run was open."""

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

ENV_SET: tuple[str, ...] = ("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "PREFECT_LOGGING_ROOT_LEVEL",
                            "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")
"""The environment variables :func:`configure_logging` sets (when unset): the command's process and
its children inherit them (tests that call the CLI in-process restore them)."""

_WAITS_ON = {
    "launch": "starting the worker and waiting until it is ready",
    "warmup": "warm-up requests",
    "one_batch": "one-batch latency grid",
    "serving": "serving load",
    "occupancy": "long request, scraping the worker's metrics",
    "quality": "scoring the quality set",
    "capacity": "request-rate sweep",
    "paired": "paired rounds against the baseline worker",
    "compare": "comparing with the baseline runs",
    "validate": "running the expectation suites",
}


def _waits_on(stage: str) -> str:
    if stage.startswith("flush:"):
        return "waiting until the worker is idle, then dropping its prefix cache"
    return _WAITS_ON.get(stage, "")


def is_interactive(stream: TextIO | None = None) -> bool:
    """A person watches ``stream`` (default stderr): a terminal, and not a CI job."""
    stream = stream or sys.stderr
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return not ci and hasattr(stream, "isatty") and stream.isatty()


def configure_logging(verbose: bool) -> None:
    """The process's logging: records at INFO and above are made (so the run's ``gate.log`` gets
    them); the terminal shows warnings and errors only, everything with ``verbose``.

    Prefect configures logging itself when it is imported; its console handler's level and its root
    level are set through its own environment overrides (``PREFECT_LOGGING_*``), so that its INFO
    lines ("Finished in state Completed()", the temporary server) stay off the terminal but reach
    the file and Prefect's API. Library progress bars (transformers, huggingface_hub) are turned off
    unless ``verbose``.
    """
    level = logging.INFO if verbose else logging.WARNING
    defaults = {"PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": logging.getLevelName(level),
                "PREFECT_LOGGING_ROOT_LEVEL": "INFO"}
    if not verbose:
        defaults.update(HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    console.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(console)


class _View(Protocol):
    def started(self, stage: str) -> None: ...

    def ended(self, stage: str, status: str, duration_s: float | None, error: str | None) -> None: ...

    def close(self) -> None: ...


class _PlainView:
    """One line per stage when it ends: for CI logs and pipes."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def started(self, stage: str) -> None:
        return None

    def ended(self, stage: str, status: str, duration_s: float | None, error: str | None) -> None:
        self._stream.write(_line(stage, status, duration_s, error) + "\n")
        self._stream.flush()

    def close(self) -> None:
        return None


_MARK = {"ok": "✓", "failed": "✗", "skipped": "–", "not_applicable": "–"}


def _line(stage: str, status: str, duration_s: float | None, error: str | None) -> str:
    from servegate.render import terminal_text

    took = f" {duration_s:6.1f} s" if duration_s is not None and status in ("ok", "failed") else " " * 9
    text = f"{_MARK.get(status, '?')} {stage:<18}{took}  {status}"
    if error:
        text += f": {terminal_text(error).splitlines()[0][:160]}"
    return text


class _LiveView:
    """A rich live view on a terminal: the running stages with a spinner and elapsed time."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.live import Live

        self._console = Console(file=stream, highlight=False)
        self._running: dict[str, float] = {}
        self._progress: dict[str, str] = {}
        self._lock = threading.Lock()
        self._live = Live(self, console=self._console, refresh_per_second=4, transient=True,
                          redirect_stdout=False, redirect_stderr=False)
        self._live.start()

    def __rich__(self) -> Any:
        from rich.spinner import Spinner
        from rich.table import Table

        table = Table.grid(padding=(0, 1))
        with self._lock:
            running = list(self._running.items())
            progress = dict(self._progress)
        now = time.monotonic()
        for stage, since in running:
            done = f"{progress[stage]}  " if stage in progress else ""
            table.add_row(Spinner("dots"), f"{stage:<18}", f"{now - since:6.1f} s",
                          f"{done}[dim]{_waits_on(stage)}[/dim]")
        return table

    def progress(self, text: str) -> None:
        with self._lock:
            if self._running:
                self._progress[next(reversed(self._running))] = text

    def started(self, stage: str) -> None:
        with self._lock:
            self._running[stage] = time.monotonic()

    def ended(self, stage: str, status: str, duration_s: float | None, error: str | None) -> None:
        with self._lock:
            self._running.pop(stage, None)
            self._progress.pop(stage, None)
        style = {"ok": "green", "failed": "red"}.get(status, "dim")
        self._live.console.print(_line(stage, status, duration_s, error), style=style, markup=False)

    def close(self) -> None:
        self._live.stop()


_view: _View | None = None
_file_handler: logging.Handler | None = None


def install(stream: TextIO | None = None) -> None:
    """Show the stages on ``stream`` (default stderr): live on a terminal, plain lines otherwise."""
    global _view
    stream = stream or sys.stderr
    _view = _LiveView(stream) if is_interactive(stream) else _PlainView(stream)


def uninstall() -> None:
    """Stop the view and close the run's log file."""
    global _view, _file_handler
    if _view is not None:
        _view.close()
        _view = None
    if _file_handler is not None:
        logging.getLogger().removeHandler(_file_handler)
        _file_handler.close()
        _file_handler = None


def stage_started(stage: str) -> None:
    if _view is not None:
        _view.started(stage)


def stage_ended(stage: str, status: str, duration_s: float | None = None, error: str | None = None) -> None:
    if _view is not None:
        _view.ended(stage, status, duration_s, error)


def progress(done: int, total: int, unit: str = "requests") -> None:
    """How far the running measurement is (e.g. the serving load's finished requests), shown next to
    the latest running stage in the live view; nothing in plain mode (one line per stage)."""
    if isinstance(_view, _LiveView):
        _view.progress(f"{done}/{total} {unit}")


def run_folder_opened(path: Path) -> None:
    """The run's folder exists: from now on its ``gate.log`` gets every log record (when a view is
    installed, i.e. a CLI run; library use configures its own logging)."""
    global _file_handler
    if _view is None:
        return
    if _file_handler is not None:
        logging.getLogger().removeHandler(_file_handler)
        _file_handler.close()
    handler = logging.FileHandler(Path(path) / LOG_FILE, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logging.getLogger().addHandler(handler)
    _file_handler = handler
