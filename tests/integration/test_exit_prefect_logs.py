"""``servegate``'s fast exit (``servegate.cli.entry`` -> ``_exit_now``) delivers a flow run's last log records
to Prefect's temporary API server before an exit hook stops that server.

Run the other way round (Python's own order: the exit hooks, then ``logging.shutdown``), Prefect's API
log handler flushed into a stopped server: the flow run's closing record ("Finished in state
Completed()") never reached Prefect's database, and the flush waited out its 5 s timeout.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2eutil import gate_env, survivors  # noqa: E402

pytestmark = [pytest.mark.gate, pytest.mark.timeout(180)]

FLOW = textwrap.dedent("""
    from prefect import flow, get_run_logger

    from servegate.cli import _exit_now
    from servegate.runstate import call_flow

    @flow(name="servegate-exit-logs")
    def tiny() -> int:
        get_run_logger().info("the flow's own record")
        return 7

    print("flow returned", call_flow(tiny))
    _exit_now(0)
""")


def _flow_run_logs(prefect_home: Path) -> list[tuple[str, str]]:
    """(logger, message) of every record the temporary server stored for the one flow run, in time order."""
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        runs = db.execute("SELECT id FROM flow_run").fetchall()
        assert len(runs) == 1, runs
        return db.execute("SELECT name, message FROM log WHERE flow_run_id = ? ORDER BY timestamp",
                          runs[0]).fetchall()


def test_a_flow_runs_closing_log_record_reaches_prefects_api_before_the_server_stops(tmp_path: Path) -> None:
    env = gate_env(tmp_path, own_prefect=True)
    out = subprocess.run([sys.executable, "-c", FLOW], env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "flow returned 7" in out.stdout

    logs = _flow_run_logs(Path(env["PREFECT_HOME"]))
    assert ("prefect.flow_runs", "the flow's own record") in logs, logs
    assert logs[-1] == ("prefect.flow_runs", "Finished in state Completed()"), logs

    # The guardian's grace (30 s), should Prefect's own atexit stop miss it.
    assert not survivors(tmp_path, 30, "uvicorn"), "Prefect's server outlived the command"
