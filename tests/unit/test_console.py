"""The stage view of servegate.console: live on a terminal, plain lines under CI or a pipe."""

from __future__ import annotations

import io
import logging
import os

import pytest

from servegate import console


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _no_view_left():
    yield
    console.uninstall()


def test_under_ci_or_a_pipe_each_stage_is_one_plain_line_when_it_ends(monkeypatch, tmp_path):
    monkeypatch.setenv("CI", "true")
    out = _Terminal()
    console.install(out)
    console.stage_started("serving")
    console.progress(3, 8)  # no animation, no progress lines
    console.stage_ended("serving", "ok", 12.34)
    console.stage_ended("paired", "skipped", None, "no baseline worker configured\nsecond line")
    console.stage_ended("occupancy", "failed", 1.0, "metrics missing \x1b[31m")
    assert out.getvalue().splitlines() == [
        "✓ serving              12.3 s  ok",
        "– paired                       skipped: no baseline worker configured",
        "✗ occupancy             1.0 s  failed: metrics missing \N{REPLACEMENT CHARACTER}[31m",
    ]


def test_on_a_terminal_the_running_stage_shows_its_progress_and_what_it_waits_on(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    out = _Terminal()
    console.install(out)
    view = console._view
    assert isinstance(view, console._LiveView)
    console.stage_started("flush:serving")
    console.stage_ended("flush:serving", "ok", 0.01)
    console.stage_started("serving")
    console.progress(3, 8)
    from rich.console import Console

    shown = Console(file=io.StringIO(), width=160)
    shown.print(view)
    text = shown.file.getvalue()
    assert "serving" in text and "3/8 requests" in text and "serving load" in text, text
    assert "flush:serving" not in text  # ended: printed once above the live lines, not running
    console.uninstall()
    assert "✓ flush:serving" in out.getvalue()


def test_the_run_log_gets_every_info_record_and_the_terminal_only_warnings(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    for name in console.ENV_SET:
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()  # the handler and variables it adds are undone by conftest
    console.configure_logging(verbose=False)
    terminal = root.handlers[-1]
    assert os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] == "WARNING"
    console.install(io.StringIO())
    console.run_folder_opened(tmp_path)
    logging.getLogger("httpx").info("HTTP Request: POST http://x/api/logs/")
    logging.getLogger("servegate.x").warning("worker slow")
    console.uninstall()
    log = (tmp_path / console.LOG_FILE).read_text()
    assert "INFO httpx: HTTP Request" in log and "WARNING servegate.x: worker slow" in log
    assert terminal.level == logging.WARNING
