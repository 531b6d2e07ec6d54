"""Many machines on Prefect, on one machine: a real server on PostgreSQL, two process workers, the nightly matrix.

What a team runs (docs/team.md), shrunk: ``prefect server start`` on loopback with its database on
PostgreSQL (``PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...``, a database of its own in
the session's throwaway cluster), the gates' history on PostgreSQL too (``SERVEGATE_DB=
postgresql+psycopg://...``, another database), the work pools, ``prefect --no-prompt deploy
--prefect-file deployments/prefect.yaml --all``, a global concurrency limit for the device slot, two
``prefect worker start --type process --limit 1`` (the "machines"), then the nightly matrix flow
fanning two gate deployments out with ``run_deployment``. The gates use the embedded worker with the
tiny random model: this tests Prefect fan-out, not measurement. PostgreSQL only (the real deployment):
the test is slow, and the SQLite history and ephemeral server are what every other gate test runs.

Checked: each Prefect worker ran exactly one gate (its own log names the flow run it submitted), the
two gates never held the shared device slot at once, the aggregate verdict is right (one gate passes,
one meets an impossible threshold: fail), every process with PREFECT_API_URL set used the long-lived
server (the flow runs are in its PostgreSQL database; no temporary server was started), both gate
runs are recorded with their verdicts in the shared history database, and the PostgreSQL password
(given in the environment only) appears in no log, run folder, Prefect home or database.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from uuid import uuid4

import pandas as pd
import psycopg
import pytest
import requests
from prefect.client.schemas.objects import FlowRun
from prefect.states import Cancelled, Completed, Crashed, Failed, Running

from pgcluster import PostgresCluster
from servegate.flows.nightly import aggregate, gate_outcome
from servegate.history import Store
from servegate.launch import free_port
from servegate.proctree import terminate_tree


REPO = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
POOLS = ("servegate-cpu", "servegate-h100", "servegate-control")
SLOT = "shared-cpu"  # both "machines" here share two cores: one device slot
TEMPORARY_SERVER = "Starting temporary server"  # what Prefect logs (INFO) when a process starts an ephemeral API

TINY = ["worker.model=tiny-random", "warmup.num_requests=1", "warmup.max_new_tokens=4",
        "one_batch.batch_sizes=[1]", "one_batch.input_lens=[8]", "one_batch.output_lens=[4]",
        "serving.num_prompts=4", "serving.random_input_len=8", "serving.random_output_len=4",
        "serving.request_rate=inf", "occupancy.enabled=false", "quality.enabled=false", "report.html=false",
        "compare.enabled=false",
        # the test's own Prefect server, workers and matrix are "other processes" to a gate's host check
        "host.enabled=false",
        "validate.expectation_profile=smoke"]


def _env(tmp_path: Path, port: int, prefect_db_url: str, history_db_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        # Secrets in the environment only: the server's and the gates' database URLs carry the password.
        "PREFECT_API_DATABASE_CONNECTION_URL": prefect_db_url,
        "SERVEGATE_DB": history_db_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_LOGGING_LEVEL": "INFO",
        # the workers' console shows their flow runs' INFO lines (the test reads who ran what there, and
        # that none of them started a temporary server)
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
        "SERVEGATE_REPO": str(REPO),
    })
    env.pop("SERVEGATE_DEVICE_SLOT", None)
    return env


def _cli(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    fh = open(log, "w")  # noqa: SIM115 - kept open for the process's lifetime, closed with it
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"prefect server exited {server.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"prefect server not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def team_prefect_server(tmp_path: Path, pg_cluster: PostgresCluster):
    """``prefect server start`` on its own PostgreSQL database; the gates' history in another one."""
    suffix = uuid4().hex[:8]
    prefect_db = pg_cluster.create_database(f"prefect_{suffix}")
    history_db = pg_cluster.create_database(f"history_{suffix}")
    port = free_port()
    env = _env(tmp_path, port, pg_cluster.url(prefect_db, driver="asyncpg"), pg_cluster.url(history_db))
    (tmp_path / "prefect-home").mkdir()
    procs: list[subprocess.Popen] = []
    log = tmp_path / "server.log"
    server = _start([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log)
    procs.append(server)
    try:
        _wait_healthy(env["PREFECT_API_URL"], server, log)
        yield env, procs, {"prefect": prefect_db, "history": history_db}
    finally:
        for proc in reversed(procs):
            terminate_tree(proc.pid, timeout_s=15)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.mark.timeout(600)
@pytest.mark.gate
def test_nightly_matrix_on_two_process_workers(team_prefect_server, pg_cluster: PostgresCluster, tmp_path: Path):
    env, procs, databases = team_prefect_server
    for pool in POOLS:
        _cli([*PREFECT, "work-pool", "create", pool, "--type", "process"], env)
    _cli([*PREFECT, "gcl", "create", f"device-{SLOT}", "--limit", "1"], env)
    deployed = _cli([*PREFECT, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all"], env,
                    timeout=400)
    assert "regression-gate/smoke-cpu" in deployed.stdout and "nightly-matrix/nightly-cpu" in deployed.stdout
    assert "calibrate-gate/calibrate-smoke-cpu" in deployed.stdout

    logs = {}
    for name in ("machine-a", "machine-b"):
        logs[name] = tmp_path / f"{name}.log"
        worker_env = {**env, "SERVEGATE_DEVICE_SLOT": SLOT}
        procs.append(_start([*PREFECT, "worker", "start", "--pool", "servegate-cpu", "--type", "process",
                             "--name", name, "--limit", "1"], worker_env, logs[name]))

    impossible = tmp_path / "expectations"
    shutil.copytree(REPO / "expectations", impossible)
    smoke = json.loads((impossible / "smoke.json").read_text())
    smoke["suites"]["serving_summary"]["expectations"].append({
        "type": "expect_column_values_to_be_between",
        "kwargs": {"column": "output_throughput", "min_value": 1.0e9},
        "meta": {"source": "test: a threshold no machine meets"}})
    (impossible / "smoke.json").write_text(json.dumps(smoke))
    common = [*TINY, f"output_dir={tmp_path / 'runs'}"]
    gates = [
        {"deployment": "regression-gate/smoke-cpu", "parameters": {"overrides": common}},
        {"deployment": "regression-gate/cpu-nightly",
         # no history in this test's database: compare off, so the breach is a plain fail
         "parameters": {"overrides": [*common, f"validate.expectations_dir={impossible}", "compare.enabled=false"]}},
    ]
    script = ("import json, sys; from servegate.flows.nightly import nightly_matrix; "
              "print('RESULT ' + json.dumps(nightly_matrix(gates=json.loads(sys.argv[1]), timeout_s=400)))")
    matrix = _cli([sys.executable, "-c", script, json.dumps(gates)], env, timeout=500)
    line = next(x for x in matrix.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))

    by_gate = {g["deployment"]: g for g in result["gates"]}
    assert by_gate["regression-gate/smoke-cpu"]["status"] == "pass", by_gate
    assert by_gate["regression-gate/cpu-nightly"]["status"] == "fail", by_gate
    assert result["status"] == "fail" and result["exit_code"] == 1

    # Each "machine" ran exactly one of the two gate flow runs: a process worker streams its flow
    # runs' own logs, so the run's final log line is in the log of the worker that executed it.
    # (Submission lines are no proof: both workers may try to submit a run; the server aborts one.)
    names = {g["flow_run_name"] for g in result["gates"]}
    ran = {machine: {n for n in names if f"Flow run '{n}' - Finished in state Completed" in log.read_text()}
           for machine, log in logs.items()}
    assert sorted(len(v) for v in ran.values()) == [1, 1] and set().union(*ran.values()) == names, ran
    run_ids = {g["flow_run_id"] for g in result["gates"]}
    api = env["PREFECT_API_URL"]
    for rid in run_ids:
        fr = requests.get(f"{api}/flow_runs/{rid}", timeout=10).json()
        assert fr["work_pool_name"] == "servegate-cpu" and fr["state_type"] == "COMPLETED", fr

    # Every process with PREFECT_API_URL set used the long-lived server and started no temporary one:
    # the matrix (started by hand, like `servegate run`) and both gates are flow runs in the server's
    # own PostgreSQL database, and no process logged a temporary server (the matrix's and the
    # workers' consoles show Prefect's INFO lines, the gates' included).
    # (The deployed nightly schedules add SCHEDULED runs of their own: the one started by hand has no deployment.)
    matrix_runs = [r for r in requests.post(f"{api}/flow_runs/filter", timeout=10,
                                            json={"flows": {"name": {"any_": ["nightly-matrix"]}}}).json()
                   if r["deployment_id"] is None]
    assert [r["state_type"] for r in matrix_runs] == ["COMPLETED"], matrix_runs
    ours = [*run_ids, matrix_runs[0]["id"]]
    with psycopg.connect(pg_cluster.url(databases["prefect"]).replace("postgresql+psycopg", "postgresql"),
                         connect_timeout=10) as conn:
        in_db = dict(conn.execute("SELECT id::text, state_type::text FROM flow_run WHERE id::text = ANY(%s)",
                                  (ours,)).fetchall())
    assert in_db == dict.fromkeys(ours, "COMPLETED"), in_db
    for where, text in [("matrix", matrix.stdout + matrix.stderr), *((m, p.read_text()) for m, p in logs.items())]:
        assert TEMPORARY_SERVER not in text, f"{where} started a temporary Prefect server:\n{text[-3000:]}"

    # Both gate runs are in the shared history database (PostgreSQL), with the verdicts the matrix got.
    verdicts = {json.loads((Path(g["run_dir"]) / "manifest.json").read_text())["run_id"]: g["status"]
                for g in result["gates"]}
    with Store(env["SERVEGATE_DB"]) as store:
        recorded = {r.run_id: r.status for r in store.runs()}
    assert recorded == verdicts and sorted(verdicts.values()) == ["fail", "pass"], (recorded, verdicts)

    # The PostgreSQL password reached no log, run folder, Prefect home or database row.
    secret = pg_cluster.password
    leaks = [str(p) for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    leaks += [f"database {db}" for db in databases.values() if secret in pg_cluster.dump(db)]
    assert not leaks, f"the database password is in {leaks}"

    # The shared device slot: the second gate's folder appeared only after the first's serving ended.
    folders = sorted((Path(g["run_dir"]) for g in result["gates"]),
                     key=lambda p: json.loads((p / "manifest.json").read_text())["started_at"])
    first_served = (folders[0] / "serving_summary.parquet").stat().st_mtime
    second_started = pd.Timestamp(json.loads((folders[1] / "manifest.json").read_text())["started_at"]).timestamp()
    assert second_started >= first_served, (folders, first_served, second_started)


# ---- the aggregation rule and how one gate run's outcome is read (no server) ---------------
def _gates(*statuses: str) -> list[dict]:
    return [{"deployment": f"regression-gate/g{i}", "status": s} for i, s in enumerate(statuses)]


@pytest.mark.parametrize(("statuses", "expected"), [
    (("pass", "pass"), "pass"),
    (("pass", "fail"), "fail"),
    (("inconclusive", "fail", "pass"), "fail"),  # a regression found is never hidden by a broken gate
    (("pass", "inconclusive"), "inconclusive"),
    ((), "inconclusive"),  # an empty matrix decided nothing
])
def test_aggregate_verdict(statuses, expected):
    result = aggregate(_gates(*statuses))
    assert result["status"] == expected
    assert result["exit_code"] == {"pass": 0, "fail": 1, "inconclusive": 2}[expected]
    assert len(result["gates"]) == len(statuses)


def _flow_run(state) -> FlowRun:
    return FlowRun(id=uuid4(), name="gate-run", flow_id=uuid4(), state=state)


def test_gate_outcome_reads_the_verdict_or_says_why_it_cannot():
    done = gate_outcome("regression-gate/smoke-cpu", _flow_run(Completed(
        data={"verdict": {"status": "fail", "reason": "1 expectation(s) breached"}, "run_dir": "/runs/x"})))
    assert (done["status"], done["run_dir"]) == ("fail", "/runs/x")
    unpersisted = gate_outcome("d", _flow_run(Completed()))
    assert unpersisted["status"] == "inconclusive" and "PREFECT_RESULTS_PERSIST_BY_DEFAULT" in unpersisted["reason"]
    for state in (Failed(message="boom"), Crashed(message="worker died"), Cancelled()):
        row = gate_outcome("d", _flow_run(state))
        assert row["status"] == "inconclusive" and state.name in row["reason"]
    late = gate_outcome("d", _flow_run(Running()))
    assert late["status"] == "inconclusive" and "timeout" in late["reason"]
