"""The ``servegate`` commands, one module per command or group of commands::

    run        servegate run [--profile NAME | --config FILE] [--set KEY=VALUE ...] [--json]
    worker     servegate worker [--model smollm2-135m] [--host 127.0.0.1] [--port P] ...
    model      servegate model fetch [--model smollm2-135m]
    profiles   servegate profiles
    history    servegate status | report RUN | baseline show|pin|unpin|distribution-change
    rerun      servegate rerun RUN --task STAGE [--set KEY=VALUE ...] [--json]
    engine     servegate engine install|path NAME
    calibrate  servegate calibrate [--profile NAME] [--aa-runs N] [--slowdowns 5,10,30] [--json]
    bisect     servegate bisect --profile NAME --builds FILE [--good REF] [--bad REF] [--json]
    dashboard  servegate dashboard --out DIR [--key PATTERN] [--since 30d] [--copy-reports]
    alerts     servegate alerts install --block TYPE/NAME [--deadline-s [NAME=]SECONDS ...] | alerts list

Each module has ``add_arguments(subparsers)``, which adds its command(s) to the main parser and
sets ``func`` (``args -> ExitCode``, :class:`servegate.verdict.ExitCode`) on each. A module
imports at its top only what building the parser needs; a handler imports the rest when it
runs, so that ``servegate --help`` and the worker do not pay for pandas, SQLAlchemy or Prefect.
Handlers raise :class:`~servegate.errors.ServegateError` subclasses; ``servegate.cli.main``
prints them and maps every failure to an exit code.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from servegate.commands import (alerts, bisect, calibrate, dashboard, engine, history, model, profiles, rerun, run,
                                worker)

__all__ = ["COMMAND_MODULES", "add_commands"]

COMMAND_MODULES: tuple[ModuleType, ...] = (run, worker, model, profiles, history, rerun, engine, calibrate, bisect,
                                              dashboard, alerts)
"""In the order ``servegate --help`` lists them."""


def add_commands(subparsers: Any) -> None:
    """Add every command to ``subparsers`` (from the main parser's ``add_subparsers``)."""
    for module in COMMAND_MODULES:
        module.add_arguments(subparsers)
