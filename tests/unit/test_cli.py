"""The command line: built from servegate.commands, cheap to build, and every failure exits 2."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from servegate import cli
from servegate.commands import COMMAND_MODULES, profiles
from servegate.errors import InfraError

HEAVY = ("pandas", "numpy", "scipy", "sqlalchemy", "great_expectations", "prefect", "torch", "transformers",
         "matplotlib", "pyarrow", "pydantic", "requests")


def test_building_the_parser_imports_nothing_heavy() -> None:
    # Every `servegate` invocation (the worker, --help) builds the parser first.
    code = ("import sys, servegate.cli as c; c.build_parser(); "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [
    ["run", "--profile", "smoke", "--json"], ["worker", "--port", "1"], ["model", "fetch"], ["profiles"],
    ["status", "--json"], ["report", "RUN"], ["baseline", "show", "a/b/c/d"], ["rerun", "RUN", "--task", "serving"],
    ["engine", "path", "vllm-cpu"], ["calibrate", "--aa-runs", "3", "--json"],
])
def test_every_command_has_a_handler_in_its_commands_module(argv: list[str]) -> None:
    args = cli.build_parser().parse_args(argv)
    assert args.func.__module__ in {m.__name__ for m in COMMAND_MODULES}, argv


def test_a_config_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--set", "no_such_section.field=1"]) == 2
    assert "servegate: error:" in capsys.readouterr().err


@pytest.mark.parametrize(("raised", "message"), [
    (InfraError("history database gone"), "InfraError: history database gone"),
    (KeyboardInterrupt(), "interrupted"),
    (SystemExit(128 + signal.SIGTERM), "terminated (SIGTERM)"),
    (RuntimeError("boom"), "internal error: RuntimeError: boom"),
    (OSError(28, "No space left on device"), "no space left on device"),
])
def test_every_failure_exits_2_never_1(raised: BaseException, message: str, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    def fail(_args: object) -> int:
        raise raised

    monkeypatch.setattr(profiles, "cmd_profiles", fail)
    assert cli.main(["profiles"]) == 2
    assert message in capsys.readouterr().err


def test_other_exits_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    def leave(_args: object) -> int:
        raise SystemExit(0)

    monkeypatch.setattr(profiles, "cmd_profiles", leave)
    with pytest.raises(SystemExit) as info:
        cli.main(["profiles"])
    assert info.value.code == 0


def test_profiles_lists_the_shipped_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["profiles"]) == 0
    assert "smoke" in capsys.readouterr().out


@pytest.mark.parametrize("argv, warned", [
    (["status", "--db", "postgresql+psycopg://gate:pw-1234@db.example/history"], ["--db holds a password"]),
    (["status", "--db", "/tmp/history.db"], []),
    (["run", "--profile", "smoke", "--set", "worker.api_key=sk-1234"], ["--set worker.api_key=..."]),
    (["run", "--profile", "smoke", "--set", "baseline.api_key=sk-1234"], ["--set baseline.api_key=..."]),
    (["run", "--profile", "smoke", "--set", "worker.api_key_env=GATE_KEY"], []),
    (["run", "--profile", "smoke", "--set", "store.url=postgresql://gate:pw-1234@db.example/h"],
     ["--set store.url=... holds a password"]),
    (["run", "--profile", "smoke", "--set", "store.url=sqlite:////tmp/h.db"], []),
])
def test_a_secret_on_the_command_line_is_warned_about_without_repeating_it(argv, warned) -> None:
    warnings = cli.secrets_on_command_line(cli.build_parser().parse_args(argv))
    assert len(warnings) == len(warned) and all(w.startswith(p) for w, p in zip(warnings, warned)), warnings
    assert not [w for w in warnings if "pw-1234" in w or "sk-1234" in w]


def test_the_warning_reaches_stderr_before_the_command_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # A closed loopback port: the command itself fails (exit 2), after the warning.
    code = cli.main(["status", "--db", "postgresql+psycopg://gate:pw-1234@127.0.0.1:9/history"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("servegate: warning: --db holds a password"), err
    assert "pw-1234" not in err and "gate:***@127.0.0.1:9" in err


def test_the_fast_exit_does_what_an_exit_must_first(tmp_path) -> None:
    """``servegate.cli.entry`` ends the process with ``os._exit`` after ``main``: before that, a non-daemon thread
    still working is joined, the exit hooks run (they stop a gate's processes), log files are flushed and closed,
    and a large output buffered in stdout reaches the pipe; the status is the one given."""
    thread_file, hook_file, log_file = tmp_path / "thread", tmp_path / "hook", tmp_path / "log"
    code = f"""
import atexit, logging, sys, threading, time
from servegate.cli import _exit_now
def late():
    time.sleep(0.5)
    open({str(thread_file)!r}, "w").write("joined")
threading.Thread(target=late).start()
atexit.register(lambda: open({str(hook_file)!r}, "w").write("ran"))
handler = logging.FileHandler({str(log_file)!r})
logging.getLogger("t").addHandler(handler)
logging.getLogger("t").error("logged")
sys.stdout.write("x" * 200000)
_exit_now(3)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "x" * 200000
    assert thread_file.read_text() == "joined" and hook_file.read_text() == "ran"
    assert log_file.read_text() == "logged\n"


def test_python_m_servegate_exits_with_mains_status() -> None:
    """``python -m servegate`` goes through ``entry``: a bad argument is 2 (argparse's SystemExit, the usual way
    out), ``profiles`` is 0 with its listing on stdout."""
    bad = subprocess.run([sys.executable, "-m", "servegate", "profiles", "--bogus"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr
    ok = subprocess.run([sys.executable, "-m", "servegate", "profiles"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "smoke" in ok.stdout
