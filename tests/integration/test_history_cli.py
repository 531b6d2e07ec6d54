"""`servegate status | report | baseline` as real processes against a real history database: a SQLite
file and a PostgreSQL database (``store_url``: each test once per backend)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from test_store import KEY, T0, run_inputs, synthetic_tables

from servegate.cli import main
from servegate.commands.history import add_arguments
from servegate.compare import compare_run
from servegate.history import GateKey, Store

OTHER = GateKey("nightly", "sglang", "h100", "meta-llama/Llama-3.1-8B-Instruct")


def _cli(db: str, *args: str) -> subprocess.CompletedProcess:
    """The commands as a real process (what a release manager runs); the database URL in the environment,
    as a team sets it (a URL with a password never goes on a command line)."""
    env = {**os.environ, "SERVEGATE_DB": db, "SERVEGATE_ACTOR": "rm-carol"}
    return subprocess.run([sys.executable, "-m", "servegate", *args], capture_output=True, text=True,
                          timeout=120, env=env, check=False)


@pytest.fixture()
def cli_in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """The same entry point in this process (each real process pays ~3 s of pandas/SQLAlchemy imports)."""

    def run(db: str, *args: str) -> subprocess.CompletedProcess:
        monkeypatch.setenv("SERVEGATE_DB", db)
        monkeypatch.setenv("SERVEGATE_ACTOR", "rm-carol")
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


@pytest.fixture()
def db(store_url: str, tmp_path: Path) -> str:
    """A history with three passing runs of KEY, a failing fourth (with its report), and a re-run of OTHER."""
    with Store(store_url) as store:
        for i in range(3):
            store.record_run(**run_inputs(f"smoke-{i}", started_at=T0 + timedelta(days=i), seed=i))
        current = synthetic_tables(50, slowdown=1.3)
        comparison = compare_run(store, current, KEY)
        run_dir = tmp_path / "runs" / "smoke-3"
        run_dir.mkdir(parents=True)
        (run_dir / "report.html").write_text("<html></html>")
        store.record_run(**run_inputs("smoke-3", started_at=T0 + timedelta(days=3), status="fail", seed=50,
                                      tables={**current, "comparison": comparison}), run_dir=run_dir)
        store.record_run(**run_inputs("llama-0", started_at=T0 + timedelta(days=1), status="inconclusive",
                                      key=OTHER))
        store.record_run(**run_inputs("llama-0", started_at=T0 + timedelta(days=1), status="pass", key=OTHER),
                         attempt_of="llama-0")
    return store_url


def test_add_arguments_wires_subcommands_with_handlers() -> None:
    parser = argparse.ArgumentParser(prog="servegate")
    add_arguments(parser.add_subparsers(dest="command", required=True))
    for argv in (["status", "--json"], ["report", "RUN", "--out", "x.html"],
                 ["baseline", "pin", "RUN", "--reason", "r"], ["baseline", "unpin", "a/b/c/d", "--reason", "r"],
                 ["baseline", "distribution-change", "a/b/c/d", "--reason", "r"], ["baseline", "show", "a/b/c/d"]):
        args = parser.parse_args(argv)
        assert callable(args.func), argv
    with pytest.raises(SystemExit):
        parser.parse_args(["baseline", "pin", "RUN"])  # --reason is required


@pytest.mark.timeout(120)
def test_status_one_line_per_key_with_failing_metrics_and_attempts(db: str, cli_in_process) -> None:
    res = _cli(db, "status")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    heads = [line for line in lines if not line.startswith(" ")]
    assert len(heads) == 2
    assert heads[0].startswith(str(OTHER)) and " PASS " in heads[0] and "attempt 2 (inconclusive/pass)" in heads[0]
    assert heads[1].startswith(str(KEY)) and " FAIL " in heads[1] and "smoke-3" in heads[1]
    assert "vs last 5 passing (3 run(s))" in heads[1]
    itl = next(line for line in lines if "serving.itl_ms.median" in line)
    assert re.fullmatch(r"\s+- serving\.itl_ms\.median ×1\.3\d{3} \[1\.\d{4}, 1\.\d{4}\]", itl), itl  # ratio [interval]
    assert any("serving_summary.failed: observed 3, allowed <= 0" in line for line in lines)
    assert any(line.strip().startswith("report: ") and line.strip().endswith("report.html") for line in lines)

    res = cli_in_process(db, "status", "--json", "--key", "smoke")
    rows = json.loads(res.stdout)
    assert [r["key"] for r in rows] == [str(KEY)]
    row = rows[0]
    assert row["status"] == "fail" and row["baseline"]["run_ids"] == ["smoke-2", "smoke-1", "smoke-0"]
    failing = {f["metric"]: f for f in row["failing"]}
    assert failing["serving.itl_ms.median"]["ci_low"] > 1.05
    since = json.loads(cli_in_process(db, "status", "--json", "--since", "2026-11-03T12:00").stdout)
    assert [r["key"] for r in since] == [str(KEY)]


@pytest.mark.timeout(120)
def test_baseline_pin_unpin_change_and_show(db: str, cli_in_process) -> None:
    res = cli_in_process(db, "baseline", "pin", "smoke-1", "--reason", "last build before the allocator change")
    assert res.returncode == 0 and "pinned smoke-1" in res.stdout, res.stderr
    show = cli_in_process(db, "baseline", "show", str(KEY)).stdout
    assert "baseline pinned smoke-1 by rm-carol: smoke-1" in show
    assert "pin smoke-1  by rm-carol: last build before the allocator change" in show
    res = cli_in_process(db, "baseline", "distribution-change", str(KEY), "--reason", "new engine version",
                         "--actor", "dave")
    assert res.returncode == 0, res.stderr
    show = cli_in_process(db, "baseline", "show", str(KEY)).stdout
    assert "baseline last 5 passing: none" in show and "too little history" in show
    assert "distribution_change  by dave: new engine version" in show
    res = cli_in_process(db, "baseline", "unpin", str(KEY), "--reason", "x")
    assert res.returncode == 2 and "nothing to unpin" in res.stderr
    res = cli_in_process(db, "baseline", "show", "not-a-key")
    assert res.returncode == 2 and "workload/engine/hardware/model" in res.stderr


@pytest.mark.timeout(120)
def test_report_command_writes_html(db: str, tmp_path: Path, cli_in_process) -> None:
    out = tmp_path / "r" / "smoke-3.html"
    res = _cli(db, "report", "smoke-3", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"report: {out}"
    assert "<svg" in out.read_text()
    res = cli_in_process(db, "report", "no-such-run")
    assert res.returncode == 2 and "not in the history database" in res.stderr
    url = make_url(db)
    if url.password:  # PostgreSQL: the error names the database, with its password hidden
        assert url.render_as_string(hide_password=True) in res.stderr and url.password not in res.stderr
