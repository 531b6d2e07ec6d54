"""``servegate worker``: serve the embedded CPU worker (SGLang-compatible HTTP); the worker's own
flags and start-up are :mod:`servegate.worker.cli`."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "cmd_worker"]


def add_arguments(subparsers: Any) -> None:
    """Add ``worker`` (with the worker's flags) to the main parser's subparsers."""
    from servegate.worker import cli as worker_cli

    worker = subparsers.add_parser("worker", help="serve the embedded CPU worker (SGLang-compatible HTTP)")
    worker_cli.add_arguments(worker)
    worker.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    """Run the worker until it is stopped; its exit status is the worker's own."""
    from servegate.worker import cli as worker_cli

    return worker_cli.run(args)
