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
