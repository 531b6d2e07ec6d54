"""``servegate profiles``: list the shipped gate profiles."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "cmd_profiles"]


def add_arguments(subparsers: Any) -> None:
    """Add ``profiles`` to the main parser's subparsers."""
    profiles = subparsers.add_parser("profiles", help="list the shipped gate profiles")
    profiles.set_defaults(func=cmd_profiles)


def cmd_profiles(_: argparse.Namespace) -> int:
    from servegate.config import available_profiles, load_config
    from servegate.verdict import ExitCode

    for name in available_profiles():
        cfg = load_config(profile=name)
        print(f"{name:14s} engine={cfg.worker.engine:9s} model={cfg.worker.model}")
    return ExitCode.PASS
