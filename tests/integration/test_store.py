"""The history store against a real SQLite file and a real PostgreSQL database (``store_url``, each
test once per backend): round trips, attempts, transactions, migrations, baselines, and a writer
SIGKILLed in the middle of its transaction (a real subprocess). What only a SQLite file can be
(empty, not SQLite, another application's, locked by a sqlite3 shell) is tested on SQLite alone."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa

from servegate.baseline import (BaselinePolicy, active_pin, mark_distribution_change, pin, resolve_baseline,
                                unpin)
from servegate.errors import ConfigError, InfraError
from servegate.commands.history import parse_since
from servegate.history import MIGRATIONS, SCHEMA_VERSION, GateKey, Store, default_url

T0 = datetime(2026, 11, 1, 2, 0, tzinfo=timezone.utc)
KEY = GateKey("smoke", "embedded", "cpu", "smollm2-135m")


# ---- synthetic runs shaped like the contract tables (docs/contracts.md "Tables") ------------
def synthetic_tables(seed: int = 0, *, slowdown: float = 1.0, n_requests: int = 64, occupancy: float = 80.0,
                     repeats: int = 1) -> dict[str, pd.DataFrame]:
    """One run's tables; ``slowdown`` multiplies every latency (1.3 = 30 % slower decode)."""
    rng = np.random.default_rng(seed)
    n = n_requests
    itls = [list(rng.lognormal(np.log(40.0), 0.15, 16) * slowdown) for _ in range(n)]
    ttft = rng.lognormal(np.log(120.0), 0.2, n) * slowdown
    serving_requests = pd.DataFrame({
        "request_id": [f"r{i}" for i in range(n)], "input_tokens": rng.integers(100, 140, n),
        "output_tokens": np.full(n, 16), "scheduled_send_s": np.linspace(0, 5, n),
        "actual_send_s": np.linspace(0, 5, n) + 0.001, "dispatch_lag_ms": np.full(n, 1.0), "ttft_ms": ttft,
        "e2e_latency_ms": ttft + np.array([sum(x) for x in itls]), "tpot_ms": np.array([np.mean(x) for x in itls]),
        "itls_ms": itls, "success": np.ones(n, dtype=bool), "error": [None] * n})
    rows = []
    for _ in range(repeats):
        for bs in (1, 2, 4, 8):
            latency = 0.4 * bs ** 0.6 * slowdown * rng.normal(1, 0.01)
            rows.append({"run_name": "default", "mode": "server", "batch_size": bs, "input_len": 128,
                         "output_len": 32, "status": "measured", "skip_reason": None, "latency": latency,
                         "last_ttft": latency / 4, "ttft_ms": latency * 250, "input_throughput": bs * 128 / latency,
                         "output_throughput": bs * 32 / latency, "overall_throughput": bs * 160 / latency,
                         "prefill_latency": np.nan, "median_decode_latency": np.nan, "error": None})
    rows.append({**rows[-1], "batch_size": 64, "status": "skipped", "skip_reason": "token capacity",
                 "latency": np.nan, "output_throughput": np.nan})
    t = np.arange(40) * 0.5
    occ = rng.normal(occupancy / slowdown, 2.0, t.size)
    occ[0] = np.nan  # the gauge is NaN at a window start
    occupancy_samples = pd.DataFrame({"t_s": t, "fwd_occupancy": occ, "spec_accept_length": np.nan,
                                      "token_usage": rng.uniform(0.1, 0.3, t.size), "num_running_reqs": 1.0,
                                      "num_queue_reqs": 0.0})
    serving_summary = pd.DataFrame([{"completed": n, "failed": 0, "median_ttft_ms": float(np.median(ttft)),
                                     "client_fell_behind": False}])
    return {"one_batch": pd.DataFrame(rows), "serving_requests": serving_requests,
            "serving_summary": serving_summary, "occupancy_samples": occupancy_samples}


def run_inputs(run_id: str, *, started_at: datetime, status: str = "pass", seed: int = 0, slowdown: float = 1.0,
               key: GateKey = KEY, branch: str | None = None, tables: dict[str, pd.DataFrame] | None = None,
               **table_kw: Any) -> dict[str, Any]:
    """Keyword arguments for ``Store.record_run`` of a synthetic run."""
    manifest = {"schema_version": "1", "run_id": run_id, "gate": key.workload, "engine": key.engine,
                "hardware": key.hardware, "model": key.model, "seeds": {"serving": seed},
                "servegate_version": "0.1.0", "git_revision": "abc123", "git_dirty": False,
                "host": {"hostname": "ci-1"}, "started_at": started_at.isoformat(), "stages": []}
    if branch is not None:
        manifest["git_branch"] = branch
    config = {"name": key.workload, "hardware": key.hardware, "worker": {"engine": key.engine, "model": key.model}}
    outcomes = [
        {"table": "serving_summary", "expectation_type": "expect_column_values_to_be_between", "column": "failed",
         "kwargs": {"column": "failed", "max_value": 0}, "success": status != "fail", "table_produced": True,
         "reason": None, "observed": 0 if status != "fail" else 3, "allowed": "<= 0",
         "meta": {"source": "contract: no failed requests"}},
        {"table": "occupancy_summary", "expectation_type": "expect_column_values_to_be_between",
         "column": "fwd_occupancy_median", "kwargs": {}, "success": None, "table_produced": False,
         "reason": "table not produced", "observed": None, "allowed": ">= 50", "meta": {"source": "SGLang CI"}},
    ]
    breach = {"table": "serving_summary", "expectation": "expect_column_values_to_be_between", "column": "failed",
              "observed": 3, "allowed": "<= 0", "source": "contract: no failed requests"}
    verdict = {"status": status, "breaches": [breach] if status == "fail" else [],
               "infra_errors": ["worker died"] if status == "inconclusive" else []}
    return {"manifest": manifest, "config": config,
            "tables": tables if tables is not None else synthetic_tables(seed, slowdown=slowdown, **table_kw),
            "outcomes": outcomes, "verdict": verdict}


@pytest.fixture()
def store(store_url: str) -> Store:
    s = Store(store_url)
    yield s
    s.close()


# ---- store --------------------------------------------------------------------------------
def test_record_run_round_trips_raw_rows_outcomes_and_provenance(store: Store) -> None:
    inputs = run_inputs("run-a", started_at=T0, branch="main")
    run_id = store.record_run(**inputs, run_dir="/tmp/run-a")
    assert run_id == "run-a"
    rec = store.get_run(run_id)
    assert rec.key == KEY and rec.status == "pass" and rec.attempt == 1 and rec.attempt_of is None
    assert rec.branch == "main" and rec.git_revision == "abc123" and rec.run_dir == "/tmp/run-a"
    assert rec.started_at == T0 and rec.manifest["host"]["hostname"] == "ci-1"
    assert store.table_names(run_id) == sorted(inputs["tables"])
    back = store.tables(run_id)
    for name, original in inputs["tables"].items():
        got = back[name]
        assert list(got.columns) == list(original.columns), name
        assert len(got) == len(original), name
    sr, orig = back["serving_requests"], inputs["tables"]["serving_requests"]
    assert sr["itls_ms"].iloc[3] == pytest.approx(orig["itls_ms"].iloc[3])  # per-token raw samples kept
    assert sr["ttft_ms"].dtype == np.float64 and sr["success"].dtype == bool
    assert sr["output_tokens"].dtype == np.int64
    np.testing.assert_allclose(sr["ttft_ms"], orig["ttft_ms"])
    ob = back["one_batch"]
    assert ob["latency"].isna().sum() == 1
    assert ob.loc[ob["status"] == "skipped", "skip_reason"].item() == "token capacity"
    occ = back["occupancy_samples"]
    assert np.isnan(occ["fwd_occupancy"].iloc[0]) and occ["spec_accept_length"].isna().all()
    outs = store.outcomes(run_id)
    assert [o["success"] for o in outs] == [True, None] and outs[1]["reason"] == "table not produced"


def test_rerun_adds_an_attempt_and_never_overwrites(store: Store) -> None:
    store.record_run(**run_inputs("run-a", started_at=T0, status="inconclusive", seed=1))
    original_ttft = store.table("run-a", "serving_requests")["ttft_ms"].to_numpy()
    with pytest.raises(ConfigError, match="already recorded.*attempt_of"):
        store.record_run(**run_inputs("run-a", started_at=T0, seed=2))
    # The re-run flow re-uses the run folder (same manifest run_id): stored as a new attempt.
    second = store.record_run(**run_inputs("run-a", started_at=T0, seed=2), attempt_of="run-a")
    third = store.record_run(**run_inputs("run-a-rerun", started_at=T0, seed=3, status="fail"), attempt_of=second)
    assert second == "run-a.attempt-2" and third == "run-a-rerun"
    attempts = store.attempts(third)
    assert [(a.run_id, a.attempt, a.status) for a in attempts] == [
        ("run-a", 1, "inconclusive"), ("run-a.attempt-2", 2, "pass"), ("run-a-rerun", 3, "fail")]
    assert all(a.root_id == "run-a" for a in attempts)
    np.testing.assert_array_equal(store.table("run-a", "serving_requests")["ttft_ms"].to_numpy(), original_ttft)
    assert store.effective("run-a").run_id == "run-a-rerun"
    assert [r.run_id for r in store.runs(KEY, include_attempts=False)] == ["run-a-rerun"]
    with pytest.raises(ConfigError, match="not a recorded run"):
        store.record_run(**run_inputs("run-b", started_at=T0), attempt_of="nope")


def test_latest_per_key_and_filters(store: Store) -> None:
    other = GateKey("nightly", "sglang", "h100", "meta-llama/Llama-3.1-8B-Instruct")
    for i in range(3):
        store.record_run(**run_inputs(f"smoke-{i}", started_at=T0 + timedelta(days=i), status="pass"))
    store.record_run(**run_inputs("llama-0", started_at=T0 + timedelta(days=1), status="fail", key=other))
    latest = store.latest()
    assert list(latest) == sorted([KEY, other])
    assert latest[KEY].run_id == "smoke-2" and latest[other].run_id == "llama-0"
    assert list(store.latest("*/sglang/*")) == [other]
    assert list(store.latest("smoke/embedded")) == [KEY]
    assert GateKey.parse(str(other)) == other  # model names with "/" survive the key text
    assert [r.run_id for r in store.runs(KEY, since=T0 + timedelta(hours=12))] == ["smoke-2", "smoke-1"]
    assert store.keys() == sorted([KEY, other])


def test_failed_write_inside_the_transaction_leaves_nothing(store: Store) -> None:
    store.record_run(**run_inputs("kept", started_at=T0))

    driver_error = store.engine.dialect.loaded_dbapi.OperationalError  # what the driver raises: sqlite3, psycopg

    def explode(conn, cursor, statement, *_):  # noqa: ANN001 - SQLAlchemy event signature
        if statement.lstrip().upper().startswith("INSERT INTO OUTCOMES"):
            raise driver_error("disk I/O error (injected)")

    sa.event.listen(store.engine, "before_cursor_execute", explode)
    try:
        with pytest.raises(InfraError, match="recording run doomed.*retry"):
            store.record_run(**run_inputs("doomed", started_at=T0 + timedelta(days=1)))
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", explode)
    assert [r.run_id for r in store.runs()] == ["kept"]
    with store.engine.connect() as conn:
        for table in ("run_tables", "table_rows", "outcomes"):
            count = conn.execute(sa.text(f"SELECT count(*) FROM {table} WHERE run_id = 'doomed'")).scalar()
            assert count == 0, table


def test_bad_inputs_are_config_errors(store: Store) -> None:
    bad = run_inputs("x", started_at=T0)
    with pytest.raises(ConfigError, match="pass, fail or inconclusive"):
        store.record_run(**{**bad, "verdict": {"status": "ok"}})
    with pytest.raises(ConfigError, match="cannot be stored"):
        store.record_run(**{**bad, "tables": {"t": pd.DataFrame({"a": [object()]})}})
    manifest = {k: v for k, v in bad["manifest"].items() if k not in ("gate", "engine")}
    with pytest.raises(ConfigError, match="gate key"):
        store.record_run(**{**bad, "manifest": manifest, "config": {}})
    # Too long for its column: refused up front on both backends (PostgreSQL would fail mid-write, SQLite store it).
    with pytest.raises(ConfigError, match=r"runs\.model is 501 characters long, over .* limit of 500"):
        store.record_run(**{**bad, "manifest": {**bad["manifest"], "model": "m" * 501}})
    with pytest.raises(ConfigError, match=r"baseline_actions\.actor is 201 characters"):
        store.record_baseline_action(KEY, "pin", reason="r", actor="a" * 201)
    assert store.runs() == [] and store.baseline_actions(KEY) == []


def test_schema_is_versioned_and_newer_databases_are_refused(store_url: str) -> None:
    with Store(store_url) as s:
        assert s.schema_version() == SCHEMA_VERSION
    with Store(store_url) as s:  # re-open: no migration re-applied
        with s.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM schema_migrations")).scalar() == len(MIGRATIONS)
        with s.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO schema_migrations VALUES (999, 'future', '2030-01-01')"))
    with Store(store_url) as s, pytest.raises(InfraError, match="newer than this servegate.*upgrade servegate"):
        s.runs()


# ---- what is not a history ----------------------------------------------------------------
def test_a_server_database_without_the_schema_is_a_new_history(pg_url: str) -> None:
    """A team names a PostgreSQL database for servegate: its first use, a read included, creates the schema,
    beside any tables of its own."""
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE team_notes (id integer PRIMARY KEY, note text)"))
        with Store(pg_url) as s:
            assert s.runs() == [] and s.schema_version() == SCHEMA_VERSION
            s.record_run(**run_inputs("first", started_at=T0))
        with engine.connect() as conn:
            tables = set(sa.inspect(conn).get_table_names())
        assert {"team_notes", "runs", "table_rows", "schema_migrations", "calibrations"} <= tables
    finally:
        engine.dispose()
    with Store(pg_url) as s:
        assert [r.run_id for r in s.runs()] == ["first"]


def test_an_empty_file_is_not_a_history_to_read_but_the_gate_may_start_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    no_schema = r"empty\.db is not a servegate history database \(no schema.*check --db / SERVEGATE_DB.*remove the file"
    with Store(str(path)) as s:
        for read in (s.runs, s.latest, s.keys, lambda: s.get_run("run-a"), s.schema_version):
            with pytest.raises(InfraError, match=no_schema):
                read()
    assert path.stat().st_size == 0  # reading left the file as it was
    # The release manager's view: an error that says what is wrong, not "no gate runs recorded".
    from servegate.cli import main

    assert main(["status", "--db", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a servegate history database" in err and "no gate runs" not in err
    # The gate's recording path may start a history in an empty file.
    with Store(str(path)) as s:
        s.record_run(**run_inputs("first", started_at=T0))
    with Store(str(path)) as s:
        assert [r.run_id for r in s.runs()] == ["first"] and s.schema_version() == SCHEMA_VERSION


def test_a_file_that_is_not_sqlite_says_so_and_does_not_blame_a_lock(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    garbage = np.random.default_rng(0).bytes(8192)
    path.write_bytes(garbage)
    with Store(str(path)) as s:
        for use in (s.runs, lambda: s.record_run(**run_inputs("x", started_at=T0))):
            with pytest.raises(InfraError) as info:
                use()
            message = str(info.value)
            assert "not a SQLite database" in message and "check that --db / SERVEGATE_DB" in message, message
            assert "lock" not in message, message
    assert path.read_bytes() == garbage


def test_another_applications_sqlite_file_is_refused_for_reading_and_writing(tmp_path: Path) -> None:
    path = tmp_path / "places.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE moz_places (id INTEGER PRIMARY KEY, url TEXT)")
    with Store(str(path)) as s:
        for use in (s.runs, lambda: s.record_run(**run_inputs("x", started_at=T0))):
            with pytest.raises(InfraError, match=r"another application's SQLite database \(tables moz_places\)"):
                use()
    with sqlite3.connect(path) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["moz_places"]


def test_a_locked_database_keeps_the_locking_hint(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer holds the write lock past the timeout: the error says so (SQLite: an open sqlite3
    shell's ``BEGIN IMMEDIATE``; PostgreSQL: a session holding the store's advisory lock)."""
    import servegate.history.database as database_mod

    with Store(store_url) as s:
        s.record_run(**run_inputs("first", started_at=T0))
    monkeypatch.setattr(database_mod, "_WRITE_LOCK_TIMEOUT_S", 0.2)
    if store_url.startswith("sqlite"):
        writer = sqlite3.connect(sa.engine.make_url(store_url).database, isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")
        release = writer.close  # closing rolls the open transaction back
        locked = r"database is locked"
    else:
        engine = sa.create_engine(store_url)
        writer = engine.connect()
        writer.execute(sa.select(sa.func.pg_advisory_lock(database_mod._PG_WRITE_LOCK_KEY)))

        def release() -> None:
            writer.close()
            engine.dispose()

        locked = r"LockNotAvailable.*lock timeout"
    try:
        with Store(store_url) as s:
            assert [r.run_id for r in s.runs()] == ["first"]  # readers are not blocked
            with pytest.raises(InfraError, match=locked + r".*another process held its write lock for over 0\.2 s"
                                                          r".*then retry"):
                s.record_run(**run_inputs("second", started_at=T0))
    finally:
        release()
    with Store(store_url) as s:
        assert [r.run_id for r in s.runs()] == ["first"]  # the refused write left nothing


def test_default_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SERVEGATE_DB", raising=False)
    monkeypatch.setenv("SERVEGATE_HOME", str(tmp_path / "home"))
    assert default_url() == f"sqlite:///{tmp_path / 'home' / 'history.db'}"
    with Store() as s:
        assert s.schema_version() == SCHEMA_VERSION and (tmp_path / "home" / "history.db").is_file()
    monkeypatch.setenv("SERVEGATE_DB", "sqlite:///" + str(tmp_path / "env.db"))
    assert default_url().endswith("env.db")
    with pytest.raises(ConfigError, match="SQLAlchemy URL"):
        Store("nosuchdialect://x/y")


def test_parse_since() -> None:
    assert abs((datetime.now(timezone.utc) - parse_since("7d")) - timedelta(days=7)) < timedelta(seconds=5)
    assert parse_since("2026-11-30") == datetime(2026, 11, 30, tzinfo=timezone.utc)
    with pytest.raises(ConfigError, match="7d, 12h"):
        parse_since("last week")


# ---- the killed writer --------------------------------------------------------------------
_KILLED_WRITER = textwrap.dedent("""
    import time
    import pandas as pd
    import sqlalchemy as sa
    from servegate.history import Store

    store = Store()  # $SERVEGATE_DB: a URL with a password never goes on a command line

    @sa.event.listens_for(store.engine, "after_cursor_execute")
    def _pause_inside_transaction(conn, cursor, statement, *args):
        # The run row and its first table rows are written, the transaction is open.
        if statement.lstrip().upper().startswith("INSERT INTO TABLE_ROWS"):
            print("IN_TRANSACTION", flush=True)
            time.sleep(120)

    manifest = {"run_id": "victim", "gate": "smoke", "engine": "embedded", "hardware": "cpu",
                "model": "smollm2-135m", "started_at": "2026-11-02T02:00:00+00:00"}
    rows = pd.DataFrame({"ttft_ms": [float(i) for i in range(5000)], "itls_ms": [[1.0, 2.0]] * 5000})
    store.record_run(manifest, {}, {"serving_requests": rows}, [], {"status": "pass"})
    print("FINISHED", flush=True)
""")


def _write_lock_held_elsewhere(store: Store) -> bool:
    """Whether another connection holds the store's write lock (SQLite: its hot journal is on disk;
    PostgreSQL: a granted advisory lock)."""
    if store.engine.dialect.name == "sqlite":
        return Path(f"{store.engine.url.database}-journal").exists()
    with store.engine.connect() as conn:
        held = conn.execute(sa.text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted")).scalar()
        return held == 1


@pytest.mark.timeout(60)
def test_sigkill_during_write_leaves_database_readable_and_run_absent(store_url: str, tmp_path: Path) -> None:
    with Store(store_url) as s:
        s.record_run(**run_inputs("survivor", started_at=T0))
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "SERVEGATE_DB": store_url})
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=45)
        assert line and line[0].strip() == "IN_TRANSACTION", (line, proc.poll())
        with Store(store_url) as s:
            assert _write_lock_held_elsewhere(s)  # the writer holds the write lock, its transaction open
            assert [r.run_id for r in s.runs()] == ["survivor"]  # readers neither wait nor see half a run
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    if store_url.startswith("sqlite"):
        with sqlite3.connect(sa.engine.make_url(store_url).database) as conn:  # a plain reader: hot journal rolled back
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with Store(store_url) as s:
        with s.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM table_rows WHERE run_id = 'victim'")).scalar() == 0
        assert [r.run_id for r in s.runs()] == ["survivor"]
        assert len(s.table("survivor", "serving_requests")) == 64
        # Not locked, not damaged: the next write goes through (PostgreSQL released the dead client's lock).
        s.record_run(**run_inputs("after", started_at=T0 + timedelta(days=1)))
        assert [r.run_id for r in s.runs()] == ["after", "survivor"]


# ---- baselines ----------------------------------------------------------------------------
def _history(store: Store) -> None:
    statuses = ["pass", "pass", "fail", "pass", "pass", "pass", "inconclusive", "pass", "pass"]
    for i, status in enumerate(statuses):
        store.record_run(**run_inputs(f"n{i}", started_at=T0 + timedelta(days=i), status=status, seed=i,
                                      branch="main" if i != 8 else "feature"))


def test_last_n_passing_runs_on_a_branch(store: Store) -> None:
    _history(store)
    b = resolve_baseline(store, KEY)
    assert b.run_ids == ["n8", "n7", "n5", "n4", "n3"] and b.sufficient and b.policy == "last 5 passing"
    b = resolve_baseline(store, KEY, BaselinePolicy(n=3, branch="main"), exclude_run="n8")
    assert b.run_ids == ["n7", "n5", "n4"] and b.policy == "last 3 passing on main"
    now = T0 + timedelta(days=8, hours=1)
    b = resolve_baseline(store, KEY, BaselinePolicy(kind="window", days=3.5), now=now)
    assert b.run_ids == ["n8", "n7", "n5"]
    empty = resolve_baseline(store, GateKey("smoke", "embedded", "cpu", "other-model"))
    assert not empty.sufficient and "too little history" in empty.reason


def test_a_run_is_never_its_own_baseline(store: Store) -> None:
    store.record_run(**run_inputs("only", started_at=T0))
    b = resolve_baseline(store, KEY, exclude_run="only")
    assert b.runs == [] and "too little history" in b.reason
    store.record_run(**run_inputs("only", started_at=T0), attempt_of="only")
    assert resolve_baseline(store, KEY, exclude_run="only.attempt-2").runs == []


def test_pin_unpin_and_distribution_change_are_recorded_with_who_when_why(store: Store) -> None:
    _history(store)
    pin(store, "n4", reason="known good build 1.2.3", actor="rm-alice")
    b = resolve_baseline(store, KEY)
    assert b.run_ids == ["n4"] and b.policy == "pinned n4 by rm-alice"
    assert active_pin(store, KEY)["run_id"] == "n4"
    unpin(store, KEY, reason="1.2.4 released", actor="rm-alice")
    assert resolve_baseline(store, KEY).run_ids[0] == "n8"
    with pytest.raises(ConfigError, match="nothing to unpin"):
        unpin(store, KEY, reason="again")
    pin(store, "n5", reason="pre-change pin", actor="rm-bob")
    mark_distribution_change(store, KEY, reason="engine 0.5 -> 0.6 changes the scheduler", actor="rm-bob",
                             at=T0 + timedelta(days=6, hours=12))
    b = resolve_baseline(store, KEY)
    assert b.run_ids == ["n8", "n7"]  # the pin made before the change is dropped too
    assert active_pin(store, KEY) is None
    b = resolve_baseline(store, KEY, exclude_run="n8", policy=BaselinePolicy(min_runs=2))
    assert not b.sufficient and "distribution change" in b.reason and "engine 0.5" in b.reason
    actions = store.baseline_actions(KEY)
    assert [(a["action"], a["actor"], a["run_id"]) for a in actions] == [
        ("pin", "rm-alice", "n4"), ("unpin", "rm-alice", None), ("pin", "rm-bob", "n5"),
        ("distribution_change", "rm-bob", None)]
    assert all(a["reason"] and a["at"].tzinfo is not None for a in actions)
    with pytest.raises(ConfigError, match="needs a reason"):
        mark_distribution_change(store, KEY, reason="  ")
    pin(store, "n2", reason="accepting the failure", actor="rm-bob")
    assert "verdict: fail" in store.baseline_actions(KEY)[-1]["reason"]


def test_a_version_1_database_is_upgraded_in_place_and_keeps_its_runs(store_url: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from servegate.history import schema

    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 1)
    with Store(store_url) as old:
        run_id = old.record_run(**run_inputs("old-run", started_at=datetime.now(timezone.utc)))
        assert old.schema_version() == 1
        assert "calibrations" not in sa.inspect(old.engine).get_table_names()
    monkeypatch.undo()
    with Store(store_url) as s:
        assert s.schema_version() == SCHEMA_VERSION >= 2
        assert s.get_run(run_id).status == "pass"
        assert s.latest_calibration(KEY) is None
        first = s.record_calibration(KEY, plan={"aa_runs": 6}, summary={"aa_runs": 6},
                                     metrics=[{"metric": "serving.itl_ms.median", "run_sd": float("nan")}])
        second = s.record_calibration(KEY, plan={"aa_runs": 8}, summary={"aa_runs": 8}, metrics=[])
        latest = s.latest_calibration(KEY)
        assert second > first and latest["id"] == second and latest["plan"] == {"aa_runs": 8}
        assert latest["key"] == str(KEY) and latest["at"].tzinfo is not None
        other = GateKey("other", KEY.engine, KEY.hardware, KEY.model)
        assert s.latest_calibration(other) is None
        # A newer paired calibration does not hide the history one from the comparison (nor the reverse).
        paired = s.record_calibration(KEY, plan={"mode": "paired"}, summary={"mode": "paired"}, metrics=[])
        assert s.latest_calibration(KEY)["id"] == second
        assert s.latest_calibration(KEY, mode="paired")["id"] == paired
