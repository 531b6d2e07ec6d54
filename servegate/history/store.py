"""Gate history: every gate run, its provenance, its raw tables and its verdict, in a database.

SQLite file by default, any SQLAlchemy URL (``postgresql+psycopg://...``) for a team::

    Store()                        # $SERVEGATE_DB, else <$SERVEGATE_HOME or ~/.local/share/servegate>/history.db
    Store("sqlite:////tmp/h.db")   # any SQLAlchemy URL; a plain path is taken as a SQLite file

:meth:`Store.record_run` writes a run, its tables (raw rows kept), its expectation outcomes
and its verdict in one transaction; the readers give back :class:`RunRecord` and DataFrames
with the dtypes they were recorded with. The schema is :mod:`servegate.history.schema`;
connecting, the write lock and the schema check on first use are
:mod:`servegate.history.database`.

**A re-run adds an attempt, never overwrites.** ``record_run(..., attempt_of=RUN)`` records
a new row whose ``attempt_of`` is the original (root) run and whose ``attempt`` is the next
number; the original measurements stay. A run group's *effective* record is its latest attempt.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import pandas as pd
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from servegate import jsonio
from servegate.errors import ConfigError
from servegate.history.database import HistoryDatabase
from servegate.history.keys import GateKey, RunRecord
from servegate.history.rows import aware_utc, branch_of, frame_to_rows, json_record, naive_utc, restore_dtypes
from servegate.history.schema import (BASELINE_ACTIONS, baseline_actions, calibrations, check_lengths, key_match,
                                      outcomes_t, run_tables, runs, table_rows)

__all__ = ["Store"]


class Store:
    """Gate history in a SQL database. Its schema is checked on first use: created, upgraded, or
    refused with the reason (:mod:`servegate.history.database`, "Opening")."""

    def __init__(self, url: str | None = None, *, echo: bool = False) -> None:
        self._db = HistoryDatabase(url, echo=echo)

    @property
    def url(self) -> str:
        return self._db.url

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for tools and tests that need raw SQL)."""
        return self._db.engine

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self._db.display_url!r})"

    def schema_version(self) -> int:
        return self._db.schema_version()

    # ---- writing --------------------------------------------------------------------------
    def record_run(self, manifest: Mapping[str, Any] | Any, config: Mapping[str, Any] | Any,
                   tables: Mapping[str, pd.DataFrame], outcomes: Iterable[Mapping[str, Any] | Any],
                   verdict: Mapping[str, Any] | Any, attempt_of: str | None = None, *,
                   run_dir: str | os.PathLike[str] | None = None) -> str:
        """Record one gate run (or a re-run attempt) in a single transaction; return its run id.

        ``manifest``: the run folder's manifest (``RunManifest`` or its dict; ``run_id``, ``gate``,
        ``engine``, ``hardware``, ``model``, ``started_at``, ``git_revision``, optional ``git_branch``).
        ``config``: the config snapshot. ``tables``: every stage table, raw rows kept.
        ``outcomes``: the GX ``ExpectationOutcome`` list (models or dicts). ``verdict``: the Verdict
        (``status`` pass|fail|inconclusive). ``attempt_of``: the run this re-runs; the new record gets
        the next attempt number of that run's group. A run id already recorded is never overwritten:
        without ``attempt_of`` that is an error; with it, the attempt is stored as ``<root>.attempt-<n>``.
        """
        manifest_d, config_d, verdict_d = json_record(manifest), json_record(config), json_record(verdict)
        outcome_ds = [json_record(o) for o in outcomes]
        status = verdict_d.get("status")
        if status not in ("pass", "fail", "inconclusive"):
            raise ConfigError(f"verdict status must be pass, fail or inconclusive, got {status!r}")
        run_id = manifest_d.get("run_id")
        if not run_id:
            raise ConfigError("the manifest has no run_id; record a manifest written by RunFolder")
        key = GateKey.from_run(manifest_d, config_d)
        for name, df in tables.items():
            if not isinstance(df, pd.DataFrame):
                raise ConfigError(f"table {name!r} must be a pandas DataFrame, got {type(df).__name__}")
        prepared = {name: (frame_to_rows(name, df), [{"name": str(c), "dtype": str(df[c].dtype)} for c in df.columns])
                    for name, df in tables.items()}
        started_at = naive_utc(manifest_d.get("started_at"))
        with self._db.writing(f"recording run {run_id}", create=True) as conn:
            exists = conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == run_id)).first() is not None
            root, attempt = None, 1
            if attempt_of is not None:
                original = conn.execute(sa.select(runs.c.run_id, runs.c.attempt_of)
                                        .where(runs.c.run_id == attempt_of)).first()
                if original is None:
                    raise ConfigError(f"attempt_of={attempt_of!r} is not a recorded run; record the original "
                                      f"run first or drop attempt_of")
                root = original.attempt_of or original.run_id
                attempt = 1 + int(conn.execute(
                    sa.select(sa.func.max(runs.c.attempt))
                    .where(sa.or_(runs.c.run_id == root, runs.c.attempt_of == root))).scalar() or 1)
                if exists:
                    run_id = f"{root}.attempt-{attempt}"
            elif exists:
                raise ConfigError(f"run {run_id} is already recorded; a re-run must be recorded with "
                                  f"attempt_of={run_id!r} (the original measurements are never overwritten)")
            run_row = dict(
                run_id=run_id, attempt_of=root, attempt=attempt, workload=key.workload, engine=key.engine,
                hardware=key.hardware, model=key.model, status=status, started_at=started_at,
                recorded_at=naive_utc(None), branch=branch_of(manifest_d, config_d),
                git_revision=manifest_d.get("git_revision"), servegate_version=manifest_d.get("servegate_version"),
                run_dir=None if run_dir is None else str(run_dir), verdict=verdict_d, manifest=manifest_d,
                config=config_d)
            table_metas = [{"run_id": run_id, "table_name": name, "n_rows": len(rows), "columns": columns}
                           for name, (rows, columns) in prepared.items()]
            outcome_rows = [{"run_id": run_id, "idx": i, "table_name": str(o.get("table", "")),
                             "expectation_type": str(o.get("expectation_type", "")), "column_name": o.get("column"),
                             "success": o.get("success"), "data": o} for i, o in enumerate(outcome_ds)]
            check_lengths(runs, [run_row])
            check_lengths(run_tables, table_metas)
            check_lengths(outcomes_t, outcome_rows)
            conn.execute(sa.insert(runs).values(**run_row))
            for meta, (rows, _columns) in zip(table_metas, prepared.values()):
                conn.execute(sa.insert(run_tables).values(**meta))
                if rows:
                    conn.execute(sa.insert(table_rows), [
                        {"run_id": run_id, "table_name": meta["table_name"], "row_index": i, "data": row}
                        for i, row in enumerate(rows)])
            if outcome_rows:
                conn.execute(sa.insert(outcomes_t), outcome_rows)
        return run_id

    def record_baseline_action(self, key: GateKey, action: str, *, reason: str, actor: str | None = None,
                               run_id: str | None = None, at: datetime | None = None,
                               check: Callable[[list[dict[str, Any]]], None] | None = None) -> int:
        """Record a release manager's baseline action (who, when, why); return its id.
        Use :mod:`servegate.baseline` (``pin``, ``unpin``, ``mark_distribution_change``) rather than this.

        ``check`` is called with ``key``'s actions so far (as :meth:`baseline_actions` gives them) inside
        the write transaction, under the store's write lock, and may raise to refuse the action: what
        it checks (e.g. that a pin is in force) stays true until the action is recorded."""
        if action not in BASELINE_ACTIONS:
            raise ConfigError(f"unknown baseline action {action!r}; choose one of {list(BASELINE_ACTIONS)}")
        if not reason or not reason.strip():
            raise ConfigError(f"a baseline {action} needs a reason (--reason '...'): the record says why")
        actor = actor or os.environ.get("SERVEGATE_ACTOR") or os.environ.get("USER") or "unknown"
        row = dict(workload=key.workload, engine=key.engine, hardware=key.hardware, model=key.model, action=action,
                   run_id=run_id, reason=reason.strip(), actor=actor, at=naive_utc(at))
        check_lengths(baseline_actions, [row])
        with self._db.writing(f"recording baseline action {action}") as conn:
            if check is not None:
                check(self._baseline_actions(conn, key))
            result = conn.execute(sa.insert(baseline_actions).values(**row))
            return int(result.inserted_primary_key[0])

    def record_calibration(self, key: GateKey, *, plan: Mapping[str, Any], summary: Mapping[str, Any],
                           metrics: Sequence[Mapping[str, Any]], at: datetime | None = None) -> int:
        """Record one ``servegate calibrate`` result for ``key`` (one transaction); return its id."""
        from servegate import __version__

        row = dict(workload=key.workload, engine=key.engine, hardware=key.hardware, model=key.model,
                   at=naive_utc(at), servegate_version=__version__, plan=jsonio.to_jsonable(dict(plan)),
                   summary=jsonio.to_jsonable(dict(summary)), metrics=jsonio.to_jsonable(list(metrics)))
        check_lengths(calibrations, [row])
        with self._db.writing("recording a calibration", create=True) as conn:
            result = conn.execute(sa.insert(calibrations).values(**row))
            return int(result.inserted_primary_key[0])

    def latest_calibration(self, key: GateKey, mode: str = "history") -> dict[str, Any] | None:
        """The newest calibration of ``key`` (``id, key, at, plan, summary, metrics``) in ``mode``
        (``history``: of the comparison with earlier runs; ``paired``: ``calibrate --paired``), or None.
        A newer calibration of the other mode does not hide it (its figures mean something else)."""
        where = key_match(calibrations, key)
        with self._db.reading("reading calibrations") as conn:
            rows = conn.execute(sa.select(calibrations).where(where)
                                .order_by(calibrations.c.at.desc(), calibrations.c.id.desc())).mappings().all()
        row = next((r for r in rows if ((r["summary"] or {}).get("mode") or "history") == mode), None)
        if row is None:
            return None
        return {"id": row["id"], "key": str(key), "at": aware_utc(row["at"]),
                "servegate_version": row["servegate_version"],
                "plan": row["plan"], "summary": row["summary"], "metrics": row["metrics"]}

    # ---- reading --------------------------------------------------------------------------
    def _records(self, where: Any = None, *, order_desc: bool = True) -> list[RunRecord]:
        query = sa.select(runs)
        if where is not None:
            query = query.where(where)
        order = (runs.c.started_at.desc(), runs.c.attempt.desc()) if order_desc else (runs.c.started_at,
                                                                                      runs.c.attempt)
        with self._db.reading("reading runs") as conn:
            rows = conn.execute(query.order_by(*order)).all()
        return [RunRecord(run_id=r.run_id, key=GateKey(r.workload, r.engine, r.hardware, r.model), attempt=r.attempt,
                          attempt_of=r.attempt_of, status=r.status, started_at=aware_utc(r.started_at),
                          recorded_at=aware_utc(r.recorded_at), branch=r.branch, git_revision=r.git_revision,
                          run_dir=r.run_dir, verdict=r.verdict, manifest=r.manifest, config=r.config) for r in rows]

    @staticmethod
    def _key_where(key: GateKey) -> Any:
        return key_match(runs, key)

    def get_run(self, run_id: str) -> RunRecord:
        found = self._records(runs.c.run_id == run_id)
        if not found:
            raise ConfigError(f"run {run_id!r} is not in the history database {self._db.display_url}; "
                              f"list recorded runs with `servegate status`")
        return found[0]

    def keys(self) -> list[GateKey]:
        with self._db.reading("reading gate keys") as conn:
            rows = conn.execute(sa.select(runs.c.workload, runs.c.engine, runs.c.hardware, runs.c.model)
                                .distinct()).all()
        return sorted(GateKey(*r) for r in rows)

    def runs(self, key: GateKey | None = None, *, since: datetime | None = None,
             include_attempts: bool = True) -> list[RunRecord]:
        """Runs of a key (all keys when None), newest first by start time; ``include_attempts=False``
        gives each run group once, as its effective (latest) attempt."""
        clauses = []
        if key is not None:
            clauses.append(self._key_where(key))
        if since is not None:
            clauses.append(runs.c.started_at >= naive_utc(since))
        records = self._records(sa.and_(*clauses) if clauses else None)
        if include_attempts:
            return records
        effective: dict[str, RunRecord] = {}
        for rec in records:
            best = effective.get(rec.root_id)
            if best is None or rec.attempt > best.attempt:
                effective[rec.root_id] = rec
        roots = {rec.run_id: rec for rec in records if rec.attempt_of is None}
        # Order groups by the start of their original run, so a late re-run does not jump the queue.
        return sorted(effective.values(), key=lambda r: (roots.get(r.root_id, r).started_at, r.attempt),
                      reverse=True)

    def attempts(self, run_id: str) -> list[RunRecord]:
        """The original run and every re-run attempt of it, in attempt order."""
        root = self.get_run(run_id).root_id
        return sorted(self._records(sa.or_(runs.c.run_id == root, runs.c.attempt_of == root)),
                      key=lambda r: r.attempt)

    def effective(self, run_id: str) -> RunRecord:
        """The latest attempt of the run group ``run_id`` belongs to."""
        return self.attempts(run_id)[-1]

    def latest(self, pattern: str | None = None, *, since: datetime | None = None) -> dict[GateKey, RunRecord]:
        """The effective record of the newest run group per gate key (keys filtered by
        :meth:`GateKey.matches` when ``pattern`` is given)."""
        out: dict[GateKey, RunRecord] = {}
        for rec in self.runs(since=since, include_attempts=False):
            if pattern is not None and not rec.key.matches(pattern):
                continue
            out.setdefault(rec.key, rec)
        return dict(sorted(out.items()))

    def table_names(self, run_id: str) -> list[str]:
        with self._db.reading(f"reading the table names of run {run_id}") as conn:
            return list(conn.execute(sa.select(run_tables.c.table_name).where(run_tables.c.run_id == run_id)
                                     .order_by(run_tables.c.table_name)).scalars())

    def tables(self, run_id: str, names: Iterable[str] | None = None) -> dict[str, pd.DataFrame]:
        """The recorded tables of one run (all, or those named that it has) as DataFrames."""
        query = sa.select(run_tables).where(run_tables.c.run_id == run_id)
        if names is not None:
            query = query.where(run_tables.c.table_name.in_(list(names)))
        with self._db.reading(f"reading the tables of run {run_id}") as conn:
            metas = conn.execute(query).all()
            out: dict[str, pd.DataFrame] = {}
            for meta in metas:
                data = conn.execute(sa.select(table_rows.c.data)
                                    .where(table_rows.c.run_id == run_id,
                                           table_rows.c.table_name == meta.table_name)
                                    .order_by(table_rows.c.row_index)).scalars().all()
                columns = [c["name"] for c in meta.columns]
                df = pd.DataFrame.from_records(list(data), columns=columns)
                out[meta.table_name] = restore_dtypes(df, meta.columns)
        return out

    def table(self, run_id: str, name: str) -> pd.DataFrame:
        found = self.tables(run_id, [name])
        if name not in found:
            raise ConfigError(f"run {run_id} has no table {name!r}; it has {self.table_names(run_id)}")
        return found[name]

    def outcomes(self, run_id: str) -> list[dict[str, Any]]:
        with self._db.reading(f"reading the expectation outcomes of run {run_id}") as conn:
            return list(conn.execute(sa.select(outcomes_t.c.data).where(outcomes_t.c.run_id == run_id)
                                     .order_by(outcomes_t.c.idx)).scalars())

    def baseline_actions(self, key: GateKey) -> list[dict[str, Any]]:
        """Every baseline action recorded for ``key``, in the order they were recorded (a
        distribution change may carry an earlier effective ``at``; it still cancels earlier pins)."""
        with self._db.reading("reading baseline actions") as conn:
            return self._baseline_actions(conn, key)

    @staticmethod
    def _baseline_actions(conn: Connection, key: GateKey) -> list[dict[str, Any]]:
        rows = conn.execute(sa.select(baseline_actions).where(key_match(baseline_actions, key))
                            .order_by(baseline_actions.c.id)).mappings().all()
        return [{**dict(r), "at": aware_utc(r["at"])} for r in rows]
