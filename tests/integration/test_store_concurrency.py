"""The history store under real concurrency, on SQLite and on PostgreSQL (each test once per backend):
processes (spawned, released together by a barrier) and threads opening one new history at once,
re-runs of one run recorded at once, four gates recording while ``status`` and ``baseline show`` read,
and ``servegate baseline pin`` calls racing.

Each race is repeated: a check-then-act bug loses only some races, so one lucky race proves nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd
import pytest
import sqlalchemy as sa

from servegate.baseline import active_pin, resolve_baseline
from servegate.history import MIGRATIONS, SCHEMA_VERSION, GateKey, Store

RACERS = 6
TRIALS = 12
GATE_TRIALS = 3  # the four-gates and pin races: fewer, longer races (a thousand rows per run written)
KEY = GateKey("smoke", "embedded", "cpu", "m")
BIG_ROWS = 1000  # rows of each run the four gates record: long enough writes for the readers to overlap


def _tiny_run(run_id: str, *, rows: int = 50, started_at: str = "2026-11-01T02:00:00+00:00") -> dict[str, Any]:
    manifest = {"run_id": run_id, "gate": KEY.workload, "engine": KEY.engine, "hardware": KEY.hardware,
                "model": KEY.model, "started_at": started_at}
    tables = {"serving_requests": pd.DataFrame({"ttft_ms": [float(i) for i in range(rows)],
                                                "itls_ms": [[1.0, 2.0, 3.0]] * rows})}
    return {"manifest": manifest, "config": {}, "tables": tables, "outcomes": [], "verdict": {"status": "pass"}}


def _cli(*argv: str) -> tuple[int, str, str]:
    """``servegate ARGV`` through its real entry point in this racer process: exit code, stdout, stderr."""
    from servegate.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _incomplete_runs(store: Store, run_ids: list[str]) -> list[str]:
    """The runs among ``run_ids`` whose raw rows are not all there (a half-written run)."""
    half = []
    for run_id in run_ids:
        n = len(store.table(run_id, "serving_requests"))
        if n not in (50, BIG_ROWS):
            half.append(f"{run_id}: {n} rows")
    return half


def _watch(store: Store, url: str, expect: int) -> dict[str, Any]:
    """A reader during writes: ``servegate status --json`` and ``servegate baseline show`` again and again
    until all ``expect`` runs are recorded (60 s at most); each read must show complete runs only and a
    sufficient baseline of passing runs."""
    seen, problems, reads = 0, [], 0
    deadline = time.monotonic() + 60
    while seen < expect and time.monotonic() < deadline:
        seen = len(store.runs())  # before the reads: a final round happens after the last write
        code, out, err = _cli("status", "--json", "--db", url)
        if code != 0:
            problems.append(f"status exited {code}: {err.strip()[-300:]}")
            break
        shown = [row["run_id"] for row in json.loads(out)]
        code, out, err = _cli("baseline", "show", str(KEY), "--db", url)
        if code != 0 or "baseline last 5 passing: " not in out:
            problems.append(f"baseline show exited {code}: {out.strip()[:300]} {err.strip()[-300:]}")
            break
        baseline = resolve_baseline(store, KEY)
        if not baseline.sufficient or len(baseline.run_ids) != 5:
            problems.append(f"baseline {baseline.run_ids} ({baseline.reason})")
        problems += _incomplete_runs(store, shown + baseline.run_ids)
        reads += 1
    return {"reads": reads, "runs_seen": seen, "problems": problems}


def _act(store: Store, url: str, action: str, arg: Any) -> Any:
    """One racer's move: ``read`` the history, ``record`` a run, record a ``rerun`` (run id, of),
    ``record_big`` (run id, start time), ``watch`` while others write (runs expected), or ``pin`` a run
    with ``servegate baseline pin``, or ``unpin`` the key (racer number)."""
    if action == "read":
        return [r.run_id for r in store.runs()]
    if action == "record":
        return store.record_run(**_tiny_run(arg))
    if action == "record_big":
        run_id, started_at = arg
        return store.record_run(**_tiny_run(run_id, rows=BIG_ROWS, started_at=started_at))
    if action == "watch":
        return _watch(store, url, arg)
    if action == "pin":
        code, out, err = _cli("baseline", "pin", arg, "--reason", f"race {arg}", "--actor", arg, "--db", url)
        if code != 0:
            raise RuntimeError(f"servegate baseline pin {arg} exited {code}: {err.strip()[-500:]}")
        return out.strip()
    if action == "unpin":  # the exit code and stderr: all but one racer must be refused
        code, _, err = _cli("baseline", "unpin", str(KEY), "--reason", f"race {arg}", "--actor", f"racer-{arg}",
                            "--db", url)
        return code, err.strip()
    run_id, attempt_of = arg
    recorded = store.record_run(**_tiny_run(run_id), attempt_of=attempt_of)
    return recorded, store.get_run(recorded).attempt


def _act_reporting(url: str, action: str, arg: Any) -> tuple[str, Any]:
    try:
        with Store(url) as store:
            return "ok", _act(store, url, action, arg)
    except Exception as exc:  # noqa: BLE001 - the race's outcome is reported back, whatever it is
        return "error", f"{type(exc).__name__}: {exc}"


def _racer(index: int, barrier: Any, inbox: Any, results: Any) -> None:
    """A worker process: for each task, wait for every racer, then open the store and act at once."""
    while (task := inbox.get()) is not None:
        url, action, arg = task
        barrier.wait(timeout=60)
        results.put((index, *_act_reporting(url, action, arg)))
    # Every store is closed; flush the results and skip the interpreter's teardown of pandas, SQLAlchemy
    # and the CLI's imports (seconds per racer on a busy machine, all six ending at once).
    results.close()
    results.join_thread()
    os._exit(0)


class Racers:
    """``RACERS`` spawned processes that import servegate once and then race on command."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._barrier = ctx.Barrier(RACERS)
        self._inboxes = [ctx.Queue() for _ in range(RACERS)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_racer, args=(i, self._barrier, inbox, self._results), daemon=True)
                       for i, inbox in enumerate(self._inboxes)]
        for proc in self._procs:
            proc.start()

    def race(self, tasks: list[tuple[str, str, Any]]) -> list[tuple[str, Any]]:
        """Run one task per racer, all released together; the outcomes in racer order."""
        assert len(tasks) == RACERS
        for inbox, task in zip(self._inboxes, tasks):
            inbox.put(task)
        outcomes = {}
        for _ in range(RACERS):
            index, status, value = self._results.get(timeout=120)
            outcomes[index] = (status, value)
        return [outcomes[i] for i in range(RACERS)]

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


@pytest.fixture(scope="module")
def racers() -> Iterator[Racers]:
    pool = Racers()
    try:
        yield pool
    finally:
        pool.close()


def _errors(outcomes: list[tuple[str, Any]]) -> list[str]:
    return [value for status, value in outcomes if status != "ok"]


def _check_history(url: str, run_ids: set[str]) -> None:
    with Store(url) as store:
        assert store.schema_version() == SCHEMA_VERSION
        assert {r.run_id for r in store.runs()} == run_ids
        with store.engine.connect() as conn:
            versions = conn.execute(sa.text("SELECT version FROM schema_migrations ORDER BY version")).scalars()
            assert list(versions) == [v for v, _, _ in MIGRATIONS]


@pytest.mark.timeout(120)
def test_six_processes_start_one_new_history_at_once(racers: Racers, new_store_url: Callable[[], str]) -> None:
    """Six gates with no history yet: three read it (compare), three record at once."""
    lost: list[list[str]] = []  # the errors of each race that had any
    for trial in range(TRIALS):
        url = new_store_url()
        tasks = [(url, "read", None)] * 3 + [(url, "record", f"run-{i}") for i in range(3)]
        errors = _errors(racers.race(tasks))
        if errors:
            lost.append(errors)
        else:
            _check_history(url, {"run-0", "run-1", "run-2"})
    assert not lost, f"{len(lost)} of {TRIALS} races had failures, e.g. {lost[0][:2]}"


@pytest.mark.timeout(120)
def test_six_reruns_of_one_run_recorded_at_once_get_distinct_attempts(racers: Racers, store_url: str) -> None:
    """Re-runs of one run finishing together: each is a new attempt with its own number, none lost.
    Half re-use the run folder (same manifest run id, stored as ``<root>.attempt-<n>``)."""
    url = store_url
    lost: list[str] = []  # what went wrong in each race that went wrong
    for trial in range(TRIALS):
        root = f"root-{trial}"
        with Store(url) as store:
            store.record_run(**_tiny_run(root))
        tasks = [(url, "rerun", (root if i % 2 else f"{root}-rerun-{i}", root)) for i in range(RACERS)]
        errors = _errors(racers.race(tasks))
        with Store(url) as store:
            attempts = sorted(a.attempt for a in store.attempts(root))
        if errors or attempts != list(range(1, RACERS + 2)):
            lost.append(f"attempts {attempts}, errors {errors[:1]}")
    assert not lost, f"{len(lost)} of {TRIALS} races lost or duplicated attempts, e.g. {lost[:2]}"


@pytest.mark.timeout(60)
def test_six_threads_start_one_new_history_at_once(new_store_url: Callable[[], str]) -> None:
    """The same race between threads of one process (a Prefect worker runs tasks in threads)."""
    lost: list[list[str]] = []
    for trial in range(TRIALS):
        url = new_store_url()
        barrier = threading.Barrier(RACERS)
        outcomes: list[tuple[str, Any]] = [("error", "did not finish")] * RACERS

        def race(i: int) -> None:
            barrier.wait(timeout=30)
            outcomes[i] = _act_reporting(url, *(("read", None) if i < 3 else ("record", f"run-{i}")))

        threads = [threading.Thread(target=race, args=(i,)) for i in range(RACERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        errors = _errors(outcomes)
        if errors:
            lost.append(errors)
        else:
            _check_history(url, {"run-3", "run-4", "run-5"})
    assert not lost, f"{len(lost)} of {TRIALS} races had failures, e.g. {lost[0][:2]}"


def _seed(url: str, n: int) -> list[str]:
    """``n`` passing runs of KEY, a day apart, before the race."""
    with Store(url) as store:
        return [store.record_run(**_tiny_run(f"seed-{i}", started_at=f"2026-10-{i + 1:02d}T02:00:00+00:00"))
                for i in range(n)]


@pytest.mark.timeout(300)
def test_four_gates_record_at_once_while_status_and_baseline_are_read(racers: Racers,
                                                                      new_store_url: Callable[[], str]) -> None:
    """Four gates record at once into a history with five passing runs, while two release managers run
    ``servegate status`` and ``servegate baseline show`` again and again: no error, no lost run, and
    every read shows whole runs only and a baseline of five passing runs."""
    failures: list[str] = []
    for trial in range(GATE_TRIALS):
        url = new_store_url()
        seeded = _seed(url, 5)
        gates = [f"gate-{i}" for i in range(4)]
        tasks = [(url, "record_big", (g, f"2026-11-0{i + 1}T02:00:00+00:00")) for i, g in enumerate(gates)]
        tasks += [(url, "watch", len(seeded) + len(gates))] * 2
        outcomes = racers.race(tasks)
        failures += [f"trial {trial}: {e}" for e in _errors(outcomes)]
        for status, value in outcomes[4:]:
            if status == "ok" and (value["problems"] or value["reads"] == 0):
                failures.append(f"trial {trial}: reader {value}")
        with Store(url) as store:
            assert sorted(r.run_id for r in store.runs()) == sorted(seeded + gates)
            assert _incomplete_runs(store, gates + seeded) == []
            assert resolve_baseline(store, KEY).run_ids == ["gate-3", "gate-2", "gate-1", "gate-0", "seed-4"]
    assert not failures, f"{len(failures)} failures, e.g. {failures[:3]}"


@pytest.mark.timeout(300)
def test_baseline_pin_calls_racing_leave_one_pin_in_force(racers: Racers, new_store_url: Callable[[], str]) -> None:
    """Six release managers run ``servegate baseline pin`` on six runs at once: every pin is recorded
    (none lost, distinct ids), and the pin in force is the last one recorded, read the same way by the
    baseline, ``active_pin`` and ``baseline show``."""
    failures: list[str] = []
    for trial in range(GATE_TRIALS):
        url = new_store_url()
        seeded = _seed(url, RACERS)
        outcomes = racers.race([(url, "pin", run_id) for run_id in seeded])
        failures += [f"trial {trial}: {e}" for e in _errors(outcomes)]
        with Store(url) as store:
            pins = [a for a in store.baseline_actions(KEY) if a["action"] == "pin"]
            if sorted(a["run_id"] for a in pins) != sorted(seeded) or len({a["id"] for a in pins}) != RACERS:
                failures.append(f"trial {trial}: pins recorded {[(a['id'], a['run_id']) for a in pins]}")
                continue
            last = pins[-1]["run_id"]
            in_force = (active_pin(store, KEY)["run_id"], resolve_baseline(store, KEY).run_ids)
            if in_force != (last, [last]):
                failures.append(f"trial {trial}: last pin {last}, in force {in_force}")
        code, out, _ = _cli("baseline", "show", str(KEY), "--db", url)
        if code != 0 or f"baseline pinned {last} by {last}: {last}" not in out:
            failures.append(f"trial {trial}: baseline show ({code}): {out[:300]}")
    assert not failures, f"{len(failures)} failures, e.g. {failures[:3]}"


@pytest.mark.timeout(300)
def test_baseline_unpin_calls_racing_unpin_once(racers: Racers, new_store_url: Callable[[], str]) -> None:
    """Six ``servegate baseline unpin`` calls at once on a pinned key: one unpins, five are told there is
    nothing to unpin (exit 2), and one unpin is recorded, not six (the pin is checked under the write lock)."""
    failures: list[str] = []
    for trial in range(GATE_TRIALS):
        url = new_store_url()
        seeded = _seed(url, 2)
        code, _, err = _cli("baseline", "pin", seeded[0], "--reason", "before the race", "--db", url)
        assert code == 0, err
        outcomes = racers.race([(url, "unpin", i) for i in range(RACERS)])
        failures += [f"trial {trial}: {e}" for e in _errors(outcomes)]
        codes = sorted(code for status, (code, _) in outcomes if status == "ok")
        refused = [err for status, (code, err) in outcomes if status == "ok" and code == 2]
        if codes != [0] + [2] * (RACERS - 1) or not all("nothing to unpin" in e for e in refused):
            failures.append(f"trial {trial}: exit codes {codes}, refusals {refused[:2]}")
        with Store(url) as store:
            unpins = [a for a in store.baseline_actions(KEY) if a["action"] == "unpin"]
            if len(unpins) != 1 or active_pin(store, KEY) is not None:
                failures.append(f"trial {trial}: {len(unpins)} unpins recorded, pin in force {active_pin(store, KEY)}")
    assert not failures, f"{len(failures)} failures, e.g. {failures[:3]}"
