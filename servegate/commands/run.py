"""``servegate run``: run the gate end to end and print the verdict."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "cmd_run", "add_config_source", "load_gate_config", "show_verdict"]


def add_config_source(parser: argparse.ArgumentParser,
                      set_help: str = "override a config field, e.g. --set flush.timeout_s=30 (repeatable)") -> None:
    """``--profile | --config`` and ``--set``: which gate config a command runs (run, calibrate)."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--profile", help="a shipped profile (see `servegate profiles`); default smoke")
    src.add_argument("--config", help="a gate config file (.toml, .yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def load_gate_config(args: argparse.Namespace, extra_overrides: list[str] | None = None) -> Any:
    """The GateConfig that ``--profile | --config`` and ``--set`` name (smoke by default)."""
    from servegate.config import load_config

    overrides = [*args.overrides, *(extra_overrides or [])]
    return load_config(path=args.config, profile=None if args.config else (args.profile or "smoke"),
                       overrides=overrides)


def add_arguments(subparsers: Any) -> None:
    """Add ``run`` to the main parser's subparsers."""
    run = subparsers.add_parser("run", help="run the gate end to end and print the verdict",
                                description="Run the regression gate. Exit 0 pass, 1 regression, 2 could not decide.")
    add_config_source(run)
    run.add_argument("--output-dir", help="parent folder of the run folder (config output_dir)")
    run.add_argument("--json", action="store_true", help="print the verdict as JSON instead of a table")
    run.add_argument("--github", action="store_true",
                     help="GitHub Actions outputs (also when GITHUB_ACTIONS=true): summary.md appended to "
                          "$GITHUB_STEP_SUMMARY, ::error per breach and ::warning per undecided metric, "
                          "pr_comment.md in the run folder")
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    quiet = [] if getattr(args, "verbose", False) else ["serving.progress=false"]  # the stage view shows progress
    config = load_gate_config(args, [*quiet, *([f"output_dir={args.output_dir}"] if args.output_dir else [])])

    # Prefect and the flow only once the config is known to be good: a bad --set fails at once. The
    # worker's process starts first: its model load overlaps Prefect's start and the flow's set-up,
    # and the launch stage adopts it (a process nothing adopted is stopped below). GX loads the
    # suites while Prefect's API server starts (the flow's own check of them then takes ms).
    from servegate.launch import discard_early
    from servegate.runstate import call_flow, check_suites, prefect_api_starting, start_worker_early

    try:
        start_worker_early(config)
        from servegate import console
        from servegate.flows.gate import regression_gate

        with prefect_api_starting():
            check_suites(config)
        console.install()
        try:
            result = call_flow(regression_gate, config)
        finally:
            console.uninstall()
    finally:
        discard_early()
    return show_verdict(result, as_json=args.json, footer=f"run folder: {result['run_dir']}",
                        github=bool(getattr(args, "github", False)))


def show_verdict(result: dict[str, Any], *, as_json: bool, footer: str, extra: dict[str, Any] | None = None,
                 github: bool = False) -> int:
    """Print a gate flow's result (``run``, ``rerun``): the JSON document, or the metric table, the
    verdict and where its report is; GitHub's outputs too (``servegate.ci_output``); returns the
    exit code."""
    from pathlib import Path

    from servegate import jsonio
    from servegate.ci_output import github_enabled, write_github_outputs
    from servegate.render import format_verdict_table, metric_rows
    from servegate.verdict import Verdict

    verdict = Verdict.model_validate(result["verdict"])
    if github_enabled(github):
        write_github_outputs(verdict, _gate_key(Path(result["run_dir"])), Path(result["run_dir"]))
    if as_json:
        print(jsonio.dumps({**result["verdict"], "run_dir": result["run_dir"], **(extra or {})}, indent=True,
                           ascii_only=True))
        return verdict.exit_code
    run_dir = Path(result["run_dir"])
    print(format_verdict_table(verdict, result.get("paired") or (), _metrics(run_dir, metric_rows)))
    print(footer)
    for name in ("report.html", "summary.md"):
        if (run_dir / name).is_file():
            print(f"{name.split('.')[0]}: {run_dir / name}")
    return verdict.exit_code


def _metrics(run_dir: Any, metric_rows: Any) -> list[list[str]]:
    """The metric table's rows from the run folder (expectations.json, comparison); none when the
    folder lacks them (a gate that stopped before validation)."""
    import json

    from servegate.errors import ServegateError
    from servegate.results import RunFolder

    try:
        outcomes = json.loads((run_dir / "expectations.json").read_text())
    except (OSError, ValueError):
        outcomes = []
    comparison: list[dict[str, Any]] = []
    try:
        folder = RunFolder.open(run_dir)
        if folder.has_table("comparison"):
            comparison = folder.read_table("comparison").to_dict(orient="records")
    except (OSError, ValueError, ServegateError):
        pass
    return metric_rows(outcomes if isinstance(outcomes, list) else [], comparison)


def _gate_key(run_dir: Any) -> str:
    """The run's gate key, from its manifest and config snapshot."""
    import json

    from servegate.history.keys import GateKey

    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        config = json.loads((run_dir / "config.json").read_text())
        return str(GateKey.from_run(manifest, config))
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir.name  # a folder without its records still gets its annotations
