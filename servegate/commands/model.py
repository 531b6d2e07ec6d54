"""``servegate model fetch``: download and convert the embedded worker's model into the cache."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "cmd_model_fetch"]


def add_arguments(subparsers: Any) -> None:
    """Add ``model fetch`` to the main parser's subparsers."""
    model = subparsers.add_parser("model", help="manage the embedded worker's model cache")
    actions = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    fetch = actions.add_parser("fetch", help="download and convert the model into the cache (idempotent)")
    fetch.add_argument("--model", default="smollm2-135m", help="model alias (smollm2-135m, tiny-random)")
    fetch.set_defaults(func=cmd_model_fetch)


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from servegate import jsonio
    from servegate.models import ensure_model, model_identity
    from servegate.verdict import ExitCode

    path = ensure_model(args.model)
    print(jsonio.dumps({"path": str(path), **model_identity(path)}, indent=True, ascii_only=True))
    return ExitCode.PASS
