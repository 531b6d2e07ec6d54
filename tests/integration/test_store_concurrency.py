"""The history store under real concurrency: processes (spawned, released together by a barrier)
and threads opening one fresh SQLite file at once, and re-runs of one run recorded at once.

Each race is repeated: a check-then-act bug loses only some races, so one lucky race proves nothing.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import sqlalchemy as sa

from servegate.history import MIGRATIONS, SCHEMA_VERSION, Store

RACERS = 6
TRIALS = 12


def _tiny_run(run_id: str) -> dict[str, Any]:
    manifest = {"run_id": run_id, "gate": "smoke", "engine": "embedded", "hardware": "cpu", "model": "m",
                "started_at": "2026-11-01T02:00:00+00:00"}
    tables = {"serving_requests": pd.DataFrame({"ttft_ms": [float(i) for i in range(50)]})}
    return {"manifest": manifest, "config": {}, "tables": tables, "outcomes": [], "verdict": {"status": "pass"}}


def _act(store: Store, action: str, arg: Any) -> Any:
    """One racer's move: ``read`` the history, ``record`` a run, or record a ``rerun`` (run id, of)."""
    if action == "read":
        return [r.run_id for r in store.runs()]
    if action == "record":
        return store.record_run(**_tiny_run(arg))
    run_id, attempt_of = arg
    recorded = store.record_run(**_tiny_run(run_id), attempt_of=attempt_of)
    return recorded, store.get_run(recorded).attempt


def _act_reporting(url: str, action: str, arg: Any) -> tuple[str, Any]:
    try:
        with Store(url) as store:
            return "ok", _act(store, action, arg)
    except Exception as exc:  # noqa: BLE001 - the race's outcome is reported back, whatever it is
        return "error", f"{type(exc).__name__}: {exc}"


def _racer(index: int, barrier: Any, inbox: Any, results: Any) -> None:
    """A worker process: for each task, wait for every racer, then open the store and act at once."""
    while (task := inbox.get()) is not None:
        url, action, arg = task
        barrier.wait(timeout=60)
        results.put((index, *_act_reporting(url, action, arg)))


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
def test_six_processes_start_one_new_history_at_once(racers: Racers, tmp_path: Path) -> None:
    """Six gates on a machine with no history yet: three read it (compare), three record at once."""
    lost: list[list[str]] = []  # the errors of each race that had any
    for trial in range(TRIALS):
        url = f"sqlite:///{tmp_path / f'history-{trial}.db'}"
        tasks = [(url, "read", None)] * 3 + [(url, "record", f"run-{i}") for i in range(3)]
        errors = _errors(racers.race(tasks))
        if errors:
            lost.append(errors)
        else:
            _check_history(url, {"run-0", "run-1", "run-2"})
    assert not lost, f"{len(lost)} of {TRIALS} races had failures, e.g. {lost[0][:2]}"


@pytest.mark.timeout(120)
def test_six_reruns_of_one_run_recorded_at_once_get_distinct_attempts(racers: Racers, tmp_path: Path) -> None:
    """Re-runs of one run finishing together: each is a new attempt with its own number, none lost.
    Half re-use the run folder (same manifest run id, stored as ``<root>.attempt-<n>``)."""
    url = f"sqlite:///{tmp_path / 'history.db'}"
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
def test_six_threads_start_one_new_history_at_once(tmp_path: Path) -> None:
    """The same race between threads of one process (a Prefect worker runs tasks in threads)."""
    lost: list[list[str]] = []
    for trial in range(TRIALS):
        url = f"sqlite:///{tmp_path / f'history-{trial}.db'}"
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
