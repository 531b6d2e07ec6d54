"""The servegate command line.

    servegate run [--profile NAME | --config FILE] [--set section.field=value ...]
    servegate rerun RUN --task STAGE [--set section.field=value ...] [--json]
    servegate worker [--model smollm2-135m] [--host 127.0.0.1] [--port P] ...
    servegate model fetch [--model smollm2-135m]
    servegate profiles
    servegate calibrate [--profile NAME] [--aa-runs N] [--slowdowns 5,10,30] [--bounds 0.02,0.05] [--json]

Exit codes of ``run`` and ``rerun``: 0 pass, 1 regression (fail), 2 could not decide (inconclusive,
bad input, infra failure).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence

from servegate.errors import ConfigError, ServegateError

__all__ = ["main", "build_parser"]

EXIT_PASS, EXIT_FAIL, EXIT_UNDECIDED = 0, 1, 2


def _quiet_defaults() -> None:
    # Nothing can be fetched from a model hub here, and no analytics leave the machine.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect's ephemeral API server needs ~8-14 s on 2 busy cores; its 20 s default is too tight.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servegate", description="A regression gate for LLM serving engines.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the gate end to end and print the verdict",
                         description="Run the regression gate. Exit 0 pass, 1 regression, 2 could not decide.")
    src = run.add_mutually_exclusive_group()
    src.add_argument("--profile", help="a shipped profile (see `servegate profiles`); default smoke")
    src.add_argument("--config", help="a gate config file (.toml, .yaml)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field, e.g. --set flush.timeout_s=30 (repeatable)")
    run.add_argument("--output-dir", help="parent folder of the run folder (config output_dir)")
    run.add_argument("--json", action="store_true", help="print the verdict as JSON instead of a table")

    worker = sub.add_parser("worker", help="serve the embedded CPU worker (SGLang-compatible HTTP)")
    from servegate.worker import cli as worker_cli

    worker_cli.add_arguments(worker)

    model = sub.add_parser("model", help="manage the embedded worker's model cache")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    fetch = model_sub.add_parser("fetch", help="download and convert the model into the cache (idempotent)")
    fetch.add_argument("--model", default="smollm2-135m", help="model alias (smollm2-135m, tiny-random)")

    sub.add_parser("profiles", help="list the shipped gate profiles")

    from servegate import history_cli

    history_cli.add_arguments(sub)  # status, report, baseline
    from servegate import rerun

    rerun.add_arguments(sub)  # rerun RUN --task STAGE
    from servegate import engine_install

    engine_install.add_arguments(sub)  # engine install NAME, engine path NAME
    from servegate import calibrate_cli

    calibrate_cli.add_arguments(sub)  # calibrate [--profile ...] [--aa-runs N] [--slowdowns 5,10,30]
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from servegate.config import load_config

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    config = load_config(path=args.config, profile=None if args.config else (args.profile or "smoke"),
                         overrides=overrides)

    from servegate.flows.gate import regression_gate
    from servegate.gate import call_flow
    from servegate.verdict import Verdict, format_verdict_table

    result = call_flow(regression_gate, config)
    verdict = Verdict.model_validate(result["verdict"])
    if args.json:
        print(json.dumps({**result["verdict"], "run_dir": result["run_dir"]}, indent=2))
    else:
        print(format_verdict_table(verdict))
        print(f"run folder: {result['run_dir']}")
    return verdict.exit_code


def _cmd_model(args: argparse.Namespace) -> int:
    from servegate.models import ensure_model, model_identity

    path = ensure_model(args.model)
    print(json.dumps({"path": str(path), **model_identity(path)}, indent=2))
    return EXIT_PASS


def _cmd_profiles(_: argparse.Namespace) -> int:
    from servegate.config import available_profiles, load_config

    for name in available_profiles():
        cfg = load_config(profile=name)
        print(f"{name:14s} engine={cfg.worker.engine:9s} model={cfg.worker.model}")
    return EXIT_PASS


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


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_defaults()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "worker":
            from servegate.worker import cli as worker_cli

            return worker_cli.run(args)
        if args.command == "model":
            return _cmd_model(args)
        if args.command == "profiles":
            return _cmd_profiles(args)
        if getattr(args, "func", None) is not None:
            return args.func(args)
    except ConfigError as exc:
        print(f"servegate: error: {exc}", file=sys.stderr)
        return EXIT_UNDECIDED
    except ServegateError as exc:
        print(f"servegate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNDECIDED
    except KeyboardInterrupt:
        print("servegate: interrupted; the worker was stopped. Verdict: could not decide.", file=sys.stderr)
        return EXIT_UNDECIDED
    except BaseException as exc:
        if _is_termination(exc):
            print("servegate: terminated (SIGTERM); the worker was stopped and what was measured is kept in the "
                  "run folder. Verdict: could not decide.", file=sys.stderr)
            return EXIT_UNDECIDED
        if not isinstance(exc, Exception):
            raise
        _report_crash(exc)
        return EXIT_UNDECIDED
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse guarantees a known command


if __name__ == "__main__":
    raise SystemExit(main())
