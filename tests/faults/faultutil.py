"""The gate under faults: run `servegate run` as a user does, hurt it, and check what it leaves.

Every scenario ends with the same four checks (docs/faults.md has the table):

- the exit code the README promises (2 for anything that could not decide, never 0 or 1);
- a one-line reason on stderr;
- no surviving process: everything the gate started inherits this scenario's ``SERVEGATE_DB``,
  which marks it (workers, Prefect's temporary API server, the guardian);
- the history database intact, with the run either recorded whole or absent.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # the e2e tests' helpers
from e2eutil import REPO, gate_env, marked_processes, survivors, tiny_gate  # noqa: E402,F401  (re-used by the fault tests)

# The tiny random-weight model with every forward pass delayed, so that each stage lasts long
# enough (seconds) to be hit in the middle; quality needs a real model, so it is off.
SLOW_TINY = [
    *tiny_gate(decode_delay_ms=40),
    "--set", "warmup.max_new_tokens=4",
    "--set", "one_batch.batch_sizes=[1, 2]",
    "--set", "one_batch.input_lens=[16]",
    "--set", "one_batch.output_lens=[48]",
    "--set", "serving.num_prompts=40",
    "--set", "serving.random_input_len=16",
    "--set", "serving.random_output_len=16",
    "--set", "serving.request_rate=4",
    "--set", "serving.progress=false",
    "--set", "occupancy.max_new_tokens=200",
    "--set", "report.html=false",
]


def start_gate(tmp_path: Path, *args: str, own_prefect: bool = False) -> subprocess.Popen:
    """`servegate run` in a session of its own (so that its whole group can be killed, as CI does);
    ``own_prefect``: with Prefect's temporary server of its own (``e2eutil.gate_env``), part of what is hurt."""
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"),
           "--json", *SLOW_TINY, *args]
    return subprocess.Popen(cmd, cwd=REPO, env=gate_env(tmp_path, own_prefect=own_prefect), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def run_folder(tmp_path: Path) -> Path | None:
    runs = sorted((tmp_path / "runs").glob("*")) if (tmp_path / "runs").is_dir() else []
    return runs[-1] if runs else None


def stage_status(tmp_path: Path) -> dict[str, dict]:
    folder = run_folder(tmp_path)
    if folder is None or not (folder / "stages.json").is_file():
        return {}
    try:
        return json.loads((folder / "stages.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # being rewritten this instant


def wait_for_stage(gate: subprocess.Popen, tmp_path: Path, stage: str, timeout_s: float = 240) -> None:
    """Return once ``stage`` is running: its flush is done and the stage itself has not been recorded
    yet. For launch: once the worker's process runs (``servegate run`` starts it before Prefect and the
    flow are up, and the launch stage adopts it), before it is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gate.poll() is not None:
            raise AssertionError(f"the gate exited ({gate.returncode}) before {stage} began:\n{gate.stderr.read()[-3000:]}")
        stages = stage_status(tmp_path)
        if stage == "launch":
            started = bool(marked_processes(tmp_path, "servegate", "worker", "--model"))
        else:
            started = stages.get(f"flush:{stage}", {}).get("status") == "ok"
        if started and stage not in stages:
            time.sleep(0.5)  # well inside the stage, which lasts seconds
            return
        if stage in stages:
            raise AssertionError(f"{stage} ended before the test could hit it: {stages[stage]}; "
                                 f"host: {stages.get('host')}")
        time.sleep(0.1)
    raise AssertionError(f"{stage} did not begin within {timeout_s} s; stages: {stage_status(tmp_path)}")


@dataclass
class DbState:
    exists: bool
    integrity: str | None
    runs: int


def db_state(tmp_path: Path) -> DbState:
    """The history database checked with SQLite itself (not through servegate)."""
    path = tmp_path / "history.db"
    if not path.exists():
        return DbState(False, None, 0)
    con = sqlite3.connect(path)
    try:
        integrity = con.execute("PRAGMA integrity_check").fetchone()[0]
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        runs = con.execute("SELECT count(*) FROM runs").fetchone()[0] if "runs" in tables else 0
        if "run_tables" in tables and "table_rows" in tables:
            # recorded whole: every table a run lists has all its rows
            short = con.execute("SELECT count(*) FROM run_tables t WHERE t.n_rows != (SELECT count(*) FROM "
                                "table_rows r WHERE r.run_id = t.run_id AND r.table_name = t.table_name)").fetchone()[0]
            assert short == 0, f"{short} recorded table(s) miss rows"
    finally:
        con.close()
    return DbState(True, integrity, runs)
