"""Gate history: every gate run, its provenance, its raw tables and its verdict, in a database.

SQLite file by default, any SQLAlchemy URL (``postgresql+psycopg://...``) for a team::

    Store()                        # $SERVEGATE_DB, else <$SERVEGATE_HOME or ~/.local/share/servegate>/history.db
    Store("sqlite:////tmp/h.db")   # any SQLAlchemy URL; a plain path is taken as a SQLite file

Schema (SQLAlchemy Core, portable across SQLite and PostgreSQL)::

    schema_migrations  version, description, applied_at          one row per applied migration
    runs               run_id, attempt_of, attempt, gate key, provenance, verdict, manifest, config
    run_tables         run_id, table_name, n_rows, columns (name + dtype, to restore types)
    table_rows         run_id, table_name, row_index, data (one JSON object per raw row)
    outcomes           run_id, idx, table_name, expectation_type, column, success, data (JSON)
    baseline_actions   gate key, action (pin|unpin|distribution_change), run_id, reason, actor, at
    calibrations       gate key, at, plan, summary, metrics (``servegate calibrate`` results)

Raw per-request rows (``serving_requests`` with its ``itls_ms`` lists, ``occupancy_samples``)
are kept row by row, so every statistic can be recomputed later.

**Writes are transactional and one at a time.** :meth:`Store.record_run` writes a run, its
tables, its expectation outcomes in one transaction: a run is either fully recorded or absent; a
killed writer leaves the database valid (SQLite rolls the hot journal back on the next open).
Every write transaction takes the store's write lock before it reads anything (SQLite
``BEGIN IMMEDIATE``, waiting up to a 30 s busy timeout; PostgreSQL ``pg_advisory_xact_lock``), so
gates recording at once cannot both take the same attempt number or both create the schema.
Readers do not take it. SQLite keeps its default rollback journal, not WAL: switching a file to
WAL fails at once (no busy wait) while another connection writes, writes to the file (a reader
would turn a user's empty file into a database), and needs shared memory that network file
systems lack; writers are serialised by ``BEGIN IMMEDIATE`` either way.

**A re-run adds an attempt, never overwrites.** ``record_run(..., attempt_of=RUN)`` records
a new row whose ``attempt_of`` is the original (root) run and whose ``attempt`` is the next
number; the original measurements stay. A run group's *effective* record is its latest attempt.

**Migrations are versioned** with a small ordered list (:data:`MIGRATIONS`) and a
``schema_migrations`` table rather than Alembic: the schema is a handful of tables, it must
upgrade itself on first use in any process (CLI, Prefect worker, test), and an Alembic script
folder would have to be shipped and located as package data. Add a migration by appending
``(version, description, function(connection))``; the pending ones run in one transaction under
the write lock, re-checked once the lock is held (another process may have applied them while
this one waited), and are recorded. A database written by a newer servegate (higher version) is
refused, not guessed at.

**Opening.** ``Store(url)`` only connects on first use; then the schema is checked once:

- a SQLite path that does not exist yet starts a new history: the file is built complete in a
  scratch file beside it and hard-linked into place, so no one ever sees a servegate file
  without its schema;
- an existing database with the schema is upgraded if it is older;
- an existing SQLite file without it is refused for reading (an empty file: "not a servegate
  history database ... check --db"), so a wrong ``--db`` never reads as "no gate runs"; the
  gate's own records (:meth:`Store.record_run`, :meth:`Store.record_calibration`) may start a
  history in an empty file, never in a SQLite file holding another application's tables;
- a server database (PostgreSQL) without the schema is a new history: any use creates it there
  (the team named that database for servegate; it may share it with other tables);
- a file that is not SQLite at all is refused as such, not as a locking problem.
"""

from __future__ import annotations

import fnmatch
import math
import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from servegate.config import redact_url
from servegate.errors import ConfigError, InfraError

__all__ = [
    "GateKey",
    "RunRecord",
    "Store",
    "default_url",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "BASELINE_ACTIONS",
    "parse_since",
]

BASELINE_ACTIONS = ("pin", "unpin", "distribution_change")

_SQLITE_BUSY_TIMEOUT_S = 30.0
# The execution option that makes a transaction take the write lock first (see Store._locked).
_WRITE_LOCK = "servegate_write_lock"
# PostgreSQL advisory lock id of the store's write lock ("servegat" as a 64-bit integer). One lock
# for the whole store: a gate run writes once, so writers queue only for the seconds a record takes.
_PG_WRITE_LOCK_KEY = int.from_bytes(b"servegat", "big")


# ---- identity -----------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class GateKey:
    """What a baseline is per: (workload = gate name, engine, hardware profile, model).

    Written ``workload/engine/hardware/model``; the model comes last because model names
    often contain ``/`` (``meta-llama/Llama-3.1-8B-Instruct``).
    """

    workload: str
    engine: str
    hardware: str
    model: str

    def __str__(self) -> str:
        return f"{self.workload}/{self.engine}/{self.hardware}/{self.model}"

    @classmethod
    def parse(cls, text: str) -> "GateKey":
        parts = text.split("/", 3)
        if len(parts) != 4 or not all(parts):
            raise ConfigError(f"gate key {text!r} must look like workload/engine/hardware/model, "
                              f"e.g. smoke/embedded/cpu/smollm2-135m (see `servegate status`)")
        return cls(*parts)

    @classmethod
    def from_run(cls, manifest: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> "GateKey":
        """The key of a run from its manifest (``gate, engine, hardware, model``), falling back to
        the config snapshot (``name, worker.engine, hardware, worker.model``)."""
        config = config or manifest.get("config") or {}
        worker = config.get("worker") or {}
        values = {
            "workload": manifest.get("gate") or config.get("name"),
            "engine": manifest.get("engine") or worker.get("engine"),
            "hardware": manifest.get("hardware") or config.get("hardware"),
            "model": manifest.get("model") or worker.get("model"),
        }
        missing = [k for k, v in values.items() if not v]
        if missing:
            raise ConfigError(f"cannot tell the gate key of run {manifest.get('run_id')!r}: {missing} missing from "
                              f"its manifest and config; write the config snapshot (RunFolder.write_config) first")
        return cls(**{k: str(v) for k, v in values.items()})

    def matches(self, pattern: str) -> bool:
        """True when ``pattern`` is this key, a leading part of it (``smoke``, ``smoke/embedded``),
        or a shell-style wildcard over the whole key (``*/sglang/*``)."""
        text = str(self)
        if any(c in pattern for c in "*?["):
            return fnmatch.fnmatchcase(text, pattern)
        return text == pattern or text.startswith(pattern.rstrip("/") + "/")


@dataclass(frozen=True)
class RunRecord:
    """One recorded attempt of a gate run."""

    run_id: str
    key: GateKey
    attempt: int
    attempt_of: str | None  # the root run when this is a re-run, else None
    status: str  # the verdict: pass | fail | inconclusive
    started_at: datetime
    recorded_at: datetime
    branch: str | None
    git_revision: str | None
    run_dir: str | None
    verdict: dict[str, Any] = field(repr=False)
    manifest: dict[str, Any] = field(repr=False)
    config: dict[str, Any] = field(repr=False)

    @property
    def root_id(self) -> str:
        return self.attempt_of or self.run_id


# ---- schema -------------------------------------------------------------------------------
def _key_columns() -> list[sa.Column]:
    """The gate key's four columns, as every per-key table holds them."""
    return [sa.Column("workload", sa.String(200), nullable=False), sa.Column("engine", sa.String(100), nullable=False),
            sa.Column("hardware", sa.String(200), nullable=False), sa.Column("model", sa.String(500), nullable=False)]


def _key_match(table: sa.Table, key: GateKey) -> Any:
    return sa.and_(table.c.workload == key.workload, table.c.engine == key.engine,
                   table.c.hardware == key.hardware, table.c.model == key.model)


metadata = sa.MetaData()

schema_migrations = sa.Table(
    "schema_migrations", metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("description", sa.String(200), nullable=False),
    sa.Column("applied_at", sa.DateTime, nullable=False),
)

runs = sa.Table(
    "runs", metadata,
    sa.Column("run_id", sa.String(200), primary_key=True),
    sa.Column("attempt_of", sa.String(200), sa.ForeignKey("runs.run_id"), nullable=True, index=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    *_key_columns(),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("started_at", sa.DateTime, nullable=False),
    sa.Column("recorded_at", sa.DateTime, nullable=False),
    sa.Column("branch", sa.String(200), nullable=True),
    sa.Column("git_revision", sa.String(100), nullable=True),
    sa.Column("servegate_version", sa.String(50), nullable=True),
    sa.Column("run_dir", sa.String(1000), nullable=True),
    sa.Column("verdict", sa.JSON, nullable=False),
    sa.Column("manifest", sa.JSON, nullable=False),
    sa.Column("config", sa.JSON, nullable=False),
    sa.Index("ix_runs_key_started", "workload", "engine", "hardware", "model", "started_at"),
)

run_tables = sa.Table(
    "run_tables", metadata,
    sa.Column("run_id", sa.String(200), sa.ForeignKey("runs.run_id"), primary_key=True),
    sa.Column("table_name", sa.String(100), primary_key=True),
    sa.Column("n_rows", sa.Integer, nullable=False),
    sa.Column("columns", sa.JSON, nullable=False),
)

table_rows = sa.Table(
    "table_rows", metadata,
    sa.Column("run_id", sa.String(200), primary_key=True),
    sa.Column("table_name", sa.String(100), primary_key=True),
    sa.Column("row_index", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("data", sa.JSON, nullable=False),
    sa.ForeignKeyConstraint(["run_id", "table_name"], ["run_tables.run_id", "run_tables.table_name"]),
)

outcomes_t = sa.Table(
    "outcomes", metadata,
    sa.Column("run_id", sa.String(200), sa.ForeignKey("runs.run_id"), primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("table_name", sa.String(100), nullable=False),
    sa.Column("expectation_type", sa.String(200), nullable=False),
    sa.Column("column_name", sa.String(200), nullable=True),
    sa.Column("success", sa.Boolean, nullable=True),
    sa.Column("data", sa.JSON, nullable=False),
)

baseline_actions = sa.Table(
    "baseline_actions", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    *_key_columns(),
    sa.Column("action", sa.String(40), nullable=False),
    sa.Column("run_id", sa.String(200), sa.ForeignKey("runs.run_id"), nullable=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("at", sa.DateTime, nullable=False),
    sa.Index("ix_baseline_actions_key", "workload", "engine", "hardware", "model", "at"),
)


calibrations = sa.Table(
    "calibrations", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    *_key_columns(),
    sa.Column("at", sa.DateTime, nullable=False),
    sa.Column("servegate_version", sa.String(50), nullable=True),
    sa.Column("plan", sa.JSON, nullable=False),
    sa.Column("summary", sa.JSON, nullable=False),
    sa.Column("metrics", sa.JSON, nullable=False),  # one record per (metric, case, bound)
    sa.Index("ix_calibrations_key_at", "workload", "engine", "hardware", "model", "at"),
)


def _migration_1(conn: Connection) -> None:
    for table in (runs, run_tables, table_rows, outcomes_t, baseline_actions):
        table.create(conn, checkfirst=True)


MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "runs, run tables and raw rows, expectation outcomes, baseline actions", _migration_1),
    (2, "calibrations: A/A false-alarm rates and detectable regressions per gate key",
     lambda conn: calibrations.create(conn, checkfirst=True)),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


# ---- value conversion ---------------------------------------------------------------------
def _json_default(value: Any) -> Any:
    if isinstance(value, (pd.Timestamp, datetime)):
        return value.isoformat()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    raise TypeError(f"cannot store a {type(value).__name__} as JSON")


def _dumps(value: Any) -> str:
    # orjson writes NaN/inf as null: "no value" round-trips as None/NaN, never as a number.
    return orjson.dumps(value, default=_json_default,
                        option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS).decode()


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _naive_utc(value: Any) -> datetime:
    """A naive UTC datetime for the database (SQLite has no time zones)."""
    if value is None:
        return _utcnow().replace(tzinfo=None)
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if not isinstance(value, datetime):
        raise ConfigError(f"expected a datetime or ISO 8601 string, got {value!r}")
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def _as_dict(obj: Any) -> dict[str, Any]:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, Mapping):
        try:
            return orjson.loads(_dumps(dict(obj)))  # JSON-clean copy (numpy scalars, datetimes)
        except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
            raise ConfigError(f"cannot store the record with fields {list(obj)[:8]} as JSON: {exc}; "
                              f"give plain values, lists, "
                              f"dicts, numbers or pydantic models") from exc
    raise ConfigError(f"expected a mapping or a pydantic model, got {type(obj).__name__}")


def _frame_to_rows(name: str, df: pd.DataFrame) -> list[dict[str, Any]]:
    try:
        return orjson.loads(_dumps(df.to_dict(orient="records")))
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise ConfigError(f"table {name!r} has a value that cannot be stored: {exc}; give each column numbers, "
                          f"strings, booleans or lists of numbers") from exc


def _restore_dtypes(df: pd.DataFrame, columns: Sequence[Mapping[str, str]]) -> pd.DataFrame:
    """Give numeric and boolean columns back the dtype they were recorded with (JSON has only
    numbers and null: an int column with no nulls comes back int, a float column float)."""
    for col in columns:
        name, dtype = col["name"], col["dtype"]
        if name not in df.columns:
            continue
        series = df[name]
        try:
            if dtype.startswith("float"):
                df[name] = pd.to_numeric(series, errors="coerce").astype(dtype)
            elif dtype.startswith(("int", "uint")) and not series.isna().any():
                df[name] = series.astype(dtype)
            elif dtype == "bool" and not series.isna().any():
                df[name] = series.astype(bool)
            elif dtype.startswith("datetime64"):
                df[name] = pd.to_datetime(series, utc="UTC" in dtype)
        except (TypeError, ValueError):
            # A column that no longer fits its recorded dtype is returned as stored, not dropped.
            continue
    return df


def default_url() -> str:
    """``$SERVEGATE_DB`` if set, else a SQLite file under ``$SERVEGATE_HOME`` or ``~/.local/share/servegate``."""
    env = os.environ.get("SERVEGATE_DB")
    if env:
        return env
    home = os.environ.get("SERVEGATE_HOME")
    folder = Path(home) if home else Path.home() / ".local" / "share" / "servegate"
    return f"sqlite:///{folder / 'history.db'}"


def _create_engine(url: str, **kwargs: Any) -> Engine:
    engine = sa.create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        sa.event.listen(engine, "connect", _sqlite_on_connect)
        sa.event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # Python's sqlite3 opens a transaction only before an INSERT/UPDATE/DELETE, never before a SELECT
    # or CREATE: a read-then-write (the schema version, the next attempt number) would not be one
    # transaction, and its CREATE TABLEs would commit one by one. SQLAlchemy's documented recipe:
    # turn the driver's own BEGIN off and emit BEGIN in the "begin" event (_sqlite_on_begin).
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _sqlite_on_begin(conn: Connection) -> None:
    # IMMEDIATE takes the write lock at BEGIN (waiting up to the busy timeout for another writer);
    # a plain BEGIN would take it at the first write, after the transaction's reads.
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE_LOCK) else "BEGIN")


def _apply_migrations(conn: Connection, migrations: Sequence[tuple[int, str, Callable[[Connection], None]]]) -> None:
    schema_migrations.create(conn, checkfirst=True)
    for version, description, upgrade in migrations:
        upgrade(conn)
        conn.execute(sa.insert(schema_migrations).values(version=version, description=description,
                                                         applied_at=_naive_utc(None)))


def _applied_versions(conn: Connection) -> set[int] | None:
    """The migrations applied to the database; None when it has no servegate schema at all."""
    if not sa.inspect(conn).has_table(schema_migrations.name):
        return None
    return set(conn.execute(sa.select(schema_migrations.c.version)).scalars())


def _normalise_url(url: str) -> str:
    if "://" in url:
        return url
    return f"sqlite:///{Path(url).expanduser().resolve()}"


def _branch_of(manifest: Mapping[str, Any], config: Mapping[str, Any]) -> str | None:
    for source in (manifest, config):
        for name in ("git_branch", "branch"):
            value = source.get(name)
            if value:
                return str(value)
    return None


# ---- the store ----------------------------------------------------------------------------
class Store:
    """Gate history in a SQL database. Its schema is checked on first use: created, upgraded, or
    refused with the reason (see the module docstring, "Opening")."""

    def __init__(self, url: str | None = None, *, echo: bool = False) -> None:
        self._url = _normalise_url(url or default_url())
        self._sqlite_file: Path | None = None  # a history kept in a SQLite file (not :memory:, not a server)
        self._schema_ready = False
        kwargs: dict[str, Any] = {"echo": echo, "json_serializer": _dumps, "json_deserializer": orjson.loads,
                                  "future": True}
        if self._url.startswith("sqlite"):
            database = sa.engine.make_url(self._url).database
            if database and database != ":memory:":
                self._sqlite_file = Path(database)
                try:
                    self._sqlite_file.parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ConfigError(f"cannot create the folder of history database {database}: {exc}; "
                                      f"set SERVEGATE_DB to a writable path or SQLAlchemy URL") from exc
            kwargs["connect_args"] = {"timeout": _SQLITE_BUSY_TIMEOUT_S}
        try:
            self._engine = _create_engine(self._url, **kwargs)
        except (ArgumentError, ImportError) as exc:
            raise ConfigError(f"cannot open history database {redact_url(self._url)!r}: {exc}; give a SQLAlchemy URL such as "
                              f"sqlite:////path/history.db or postgresql+psycopg://user@host/db (driver installed)") \
                from exc

    # ---- plumbing -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for tools and tests that need raw SQL)."""
        return self._engine

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({redact_url(self._url)!r})"

    def _db_error(self, exc: SQLAlchemyError, doing: str) -> InfraError:
        code = getattr(getattr(exc, "orig", None), "sqlite_errorname", "")
        if code.startswith("SQLITE_BUSY"):
            hint = (f"another process held its write lock for over {_SQLITE_BUSY_TIMEOUT_S:g} s (a gate recording, "
                    f"an open sqlite3 shell?); let it finish, then retry")
        elif code in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
            hint = ("the file is not a SQLite database, or a damaged one: check that --db / SERVEGATE_DB names the "
                    "history file; if it does, restore it from a backup, or move it aside to start a new history")
        else:
            hint = "check that the database is reachable and writable, then retry"
        return InfraError(f"history database {redact_url(self._url)} failed while {doing}: {exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0]}; {hint}")

    @contextmanager
    def _reading(self, doing: str) -> Iterator[Connection]:
        """A connection to read the history (one snapshot), its failures mapped to InfraError."""
        self._prepare(create=False)
        try:
            with self._engine.connect() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise self._db_error(exc, doing) from exc

    @contextmanager
    def _writing(self, doing: str, *, create: bool = False) -> Iterator[Connection]:
        """A transaction holding the write lock (see :meth:`_locked`); ``create``: the write may start a
        history in an empty database (the gate's own records), else it needs one that exists."""
        self._prepare(create=create)
        try:
            with self._locked() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise self._db_error(exc, doing) from exc

    @contextmanager
    def _locked(self) -> Iterator[Connection]:
        """A transaction that holds the store-wide write lock from its first statement, so what it reads
        before writing (the schema version, whether a run exists, the next attempt number) is still
        true when it commits. SQLite: ``BEGIN IMMEDIATE`` (waits up to the busy timeout for another
        writer); PostgreSQL: a transaction-level advisory lock. Readers are not blocked by it."""
        with self._engine.connect().execution_options(**{_WRITE_LOCK: True}) as conn, conn.begin():
            if conn.dialect.name == "postgresql":
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_WRITE_LOCK_KEY)))
            yield conn

    # ---- schema ---------------------------------------------------------------------------
    def _prepare(self, *, create: bool) -> None:
        """Before this store's first use, make sure the database holds the current schema."""
        if self._schema_ready:
            return
        doing = "creating it"
        try:
            if self._sqlite_file is not None and not self._sqlite_file.exists() and not self._start_sqlite_file():
                create = True  # no hard links here: this process starts the new file in place, under the lock
            doing = "reading its schema version"
            with self._engine.connect() as conn:
                applied = _applied_versions(conn)
            if applied is None or self._pending(applied):
                doing = "creating or upgrading its schema"
                with self._locked() as conn:
                    # Again, now that the lock is held: another process may have created or upgraded
                    # the schema while this one waited for it.
                    applied = _applied_versions(conn)
                    if applied is None:
                        self._check_can_start_history(conn, create=create)
                    pending = self._pending(applied or set())
                    doing = "applying schema migrations " + ", ".join(f"{v} ({d})" for v, d, _ in pending)
                    _apply_migrations(conn, pending)
        except SQLAlchemyError as exc:
            raise self._db_error(exc, doing) from exc
        self._schema_ready = True

    def _pending(self, applied: set[int]) -> list[tuple[int, str, Callable[[Connection], None]]]:
        """The migrations still to apply; a database written by a newer servegate is refused."""
        newest = max(applied, default=0)
        if newest > SCHEMA_VERSION:
            raise InfraError(f"history database {redact_url(self._url)} has schema version {newest}, newer than this servegate "
                             f"understands ({SCHEMA_VERSION}); upgrade servegate to read it")
        return [m for m in MIGRATIONS if m[0] not in applied]

    def _start_sqlite_file(self) -> bool:
        """Start a new history at a SQLite path that does not exist yet: build it, schema and all, in
        a scratch file beside it, then hard-link it into place. The link fails when the path exists
        by then (another process won: its file is used), so no process ever sees a servegate file
        without its schema, and a file without one is never a history being made but a wrong
        ``--db``. False when the file system has no hard links: the caller makes the file in place."""
        assert self._sqlite_file is not None
        scratch = self._sqlite_file.with_name(f".{self._sqlite_file.name}.{uuid.uuid4().hex}.new")
        engine = _create_engine(f"sqlite:///{scratch}", future=True)
        try:
            with engine.begin() as conn:
                _apply_migrations(conn, MIGRATIONS)
            os.link(scratch, self._sqlite_file)
        except FileExistsError:
            pass  # another process started the history first: this one uses it
        except OSError:
            return False  # no hard links on this file system (FAT, some network mounts)
        finally:
            engine.dispose()
            scratch.unlink(missing_ok=True)
        return True

    def _check_can_start_history(self, conn: Connection, *, create: bool) -> None:
        """A database without the servegate schema gets it only when it is a history about to start:
        a server database (named for servegate; it may share it with other tables), or a SQLite file
        that holds nothing, written to by the gate (``create``). Reading an empty file, or anything in
        a SQLite file of another application, would show "no gate runs" for a wrong --db."""
        if self._sqlite_file is None:
            return
        tables = sa.inspect(conn).get_table_names()
        if tables:
            raise InfraError(f"{self._sqlite_file} is another application's SQLite database (tables "
                             f"{', '.join(sorted(tables)[:5])}), not a servegate history; check --db / SERVEGATE_DB")
        if not create:
            raise InfraError(f"{self._sqlite_file} is not a servegate history database (no schema: an empty file); "
                             f"check --db / SERVEGATE_DB, or remove the file to start a new history")

    def schema_version(self) -> int:
        with self._reading("reading its schema version") as conn:
            return int(conn.execute(sa.select(sa.func.max(schema_migrations.c.version))).scalar() or 0)

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
        manifest_d, config_d, verdict_d = _as_dict(manifest), _as_dict(config), _as_dict(verdict)
        outcome_ds = [_as_dict(o) for o in outcomes]
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
        prepared = {name: (_frame_to_rows(name, df), [{"name": str(c), "dtype": str(df[c].dtype)} for c in df.columns])
                    for name, df in tables.items()}
        started_at = _naive_utc(manifest_d.get("started_at"))
        with self._writing(f"recording run {run_id}", create=True) as conn:
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
            conn.execute(sa.insert(runs).values(
                run_id=run_id, attempt_of=root, attempt=attempt, workload=key.workload, engine=key.engine,
                hardware=key.hardware, model=key.model, status=status, started_at=started_at,
                recorded_at=_naive_utc(None), branch=_branch_of(manifest_d, config_d),
                git_revision=manifest_d.get("git_revision"), servegate_version=manifest_d.get("servegate_version"),
                run_dir=None if run_dir is None else str(run_dir), verdict=verdict_d, manifest=manifest_d,
                config=config_d))
            for name, (rows, columns) in prepared.items():
                conn.execute(sa.insert(run_tables).values(run_id=run_id, table_name=name, n_rows=len(rows),
                                                          columns=columns))
                if rows:
                    conn.execute(sa.insert(table_rows), [
                        {"run_id": run_id, "table_name": name, "row_index": i, "data": row}
                        for i, row in enumerate(rows)])
            if outcome_ds:
                conn.execute(sa.insert(outcomes_t), [
                    {"run_id": run_id, "idx": i, "table_name": str(o.get("table", "")),
                     "expectation_type": str(o.get("expectation_type", "")), "column_name": o.get("column"),
                     "success": o.get("success"), "data": o}
                    for i, o in enumerate(outcome_ds)])
        return run_id

    def record_baseline_action(self, key: GateKey, action: str, *, reason: str, actor: str | None = None,
                               run_id: str | None = None, at: datetime | None = None) -> int:
        """Record a release manager's baseline action (who, when, why); return its id.
        Use :mod:`servegate.baseline` (``pin``, ``unpin``, ``mark_distribution_change``) rather than this."""
        if action not in BASELINE_ACTIONS:
            raise ConfigError(f"unknown baseline action {action!r}; choose one of {list(BASELINE_ACTIONS)}")
        if not reason or not reason.strip():
            raise ConfigError(f"a baseline {action} needs a reason (--reason '...'): the record says why")
        actor = actor or os.environ.get("SERVEGATE_ACTOR") or os.environ.get("USER") or "unknown"
        with self._writing(f"recording baseline action {action}") as conn:
            result = conn.execute(sa.insert(baseline_actions).values(
                workload=key.workload, engine=key.engine, hardware=key.hardware, model=key.model, action=action,
                run_id=run_id, reason=reason.strip(), actor=actor, at=_naive_utc(at)))
            return int(result.inserted_primary_key[0])

    def record_calibration(self, key: GateKey, *, plan: Mapping[str, Any], summary: Mapping[str, Any],
                           metrics: Sequence[Mapping[str, Any]], at: datetime | None = None) -> int:
        """Record one ``servegate calibrate`` result for ``key`` (one transaction); return its id."""
        from servegate import __version__

        with self._writing("recording a calibration", create=True) as conn:
            result = conn.execute(sa.insert(calibrations).values(
                workload=key.workload, engine=key.engine, hardware=key.hardware, model=key.model,
                at=_naive_utc(at), servegate_version=__version__, plan=orjson.loads(_dumps(dict(plan))),
                summary=orjson.loads(_dumps(dict(summary))), metrics=orjson.loads(_dumps(list(metrics)))))
            return int(result.inserted_primary_key[0])

    def latest_calibration(self, key: GateKey) -> dict[str, Any] | None:
        """The newest calibration of ``key`` (``id, key, at, plan, summary, metrics``), or None."""
        where = _key_match(calibrations, key)
        with self._reading("reading calibrations") as conn:
            row = conn.execute(sa.select(calibrations).where(where)
                               .order_by(calibrations.c.at.desc(), calibrations.c.id.desc()).limit(1)).mappings().first()
        if row is None:
            return None
        return {"id": row["id"], "key": str(key), "at": _aware(row["at"]), "servegate_version": row["servegate_version"],
                "plan": row["plan"], "summary": row["summary"], "metrics": row["metrics"]}

    # ---- reading --------------------------------------------------------------------------
    def _records(self, where: Any = None, *, order_desc: bool = True) -> list[RunRecord]:
        query = sa.select(runs)
        if where is not None:
            query = query.where(where)
        order = (runs.c.started_at.desc(), runs.c.attempt.desc()) if order_desc else (runs.c.started_at,
                                                                                      runs.c.attempt)
        with self._reading("reading runs") as conn:
            rows = conn.execute(query.order_by(*order)).all()
        return [RunRecord(run_id=r.run_id, key=GateKey(r.workload, r.engine, r.hardware, r.model), attempt=r.attempt,
                          attempt_of=r.attempt_of, status=r.status, started_at=_aware(r.started_at),
                          recorded_at=_aware(r.recorded_at), branch=r.branch, git_revision=r.git_revision,
                          run_dir=r.run_dir, verdict=r.verdict, manifest=r.manifest, config=r.config) for r in rows]

    @staticmethod
    def _key_where(key: GateKey) -> Any:
        return _key_match(runs, key)

    def get_run(self, run_id: str) -> RunRecord:
        found = self._records(runs.c.run_id == run_id)
        if not found:
            raise ConfigError(f"run {run_id!r} is not in the history database {redact_url(self._url)}; "
                              f"list recorded runs with `servegate status`")
        return found[0]

    def keys(self) -> list[GateKey]:
        with self._reading("reading gate keys") as conn:
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
            clauses.append(runs.c.started_at >= _naive_utc(since))
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
        with self._reading(f"reading the table names of run {run_id}") as conn:
            return list(conn.execute(sa.select(run_tables.c.table_name).where(run_tables.c.run_id == run_id)
                                     .order_by(run_tables.c.table_name)).scalars())

    def tables(self, run_id: str, names: Iterable[str] | None = None) -> dict[str, pd.DataFrame]:
        """The recorded tables of one run (all, or those named that it has) as DataFrames."""
        query = sa.select(run_tables).where(run_tables.c.run_id == run_id)
        if names is not None:
            query = query.where(run_tables.c.table_name.in_(list(names)))
        with self._reading(f"reading the tables of run {run_id}") as conn:
            metas = conn.execute(query).all()
            out: dict[str, pd.DataFrame] = {}
            for meta in metas:
                data = conn.execute(sa.select(table_rows.c.data)
                                    .where(table_rows.c.run_id == run_id,
                                           table_rows.c.table_name == meta.table_name)
                                    .order_by(table_rows.c.row_index)).scalars().all()
                columns = [c["name"] for c in meta.columns]
                df = pd.DataFrame.from_records(list(data), columns=columns)
                out[meta.table_name] = _restore_dtypes(df, meta.columns)
        return out

    def table(self, run_id: str, name: str) -> pd.DataFrame:
        found = self.tables(run_id, [name])
        if name not in found:
            raise ConfigError(f"run {run_id} has no table {name!r}; it has {self.table_names(run_id)}")
        return found[name]

    def outcomes(self, run_id: str) -> list[dict[str, Any]]:
        with self._reading(f"reading the expectation outcomes of run {run_id}") as conn:
            return list(conn.execute(sa.select(outcomes_t.c.data).where(outcomes_t.c.run_id == run_id)
                                     .order_by(outcomes_t.c.idx)).scalars())

    def baseline_actions(self, key: GateKey) -> list[dict[str, Any]]:
        """Every baseline action recorded for ``key``, in the order they were recorded (a
        distribution change may carry an earlier effective ``at``; it still cancels earlier pins)."""
        where = _key_match(baseline_actions, key)
        with self._reading("reading baseline actions") as conn:
            rows = conn.execute(sa.select(baseline_actions).where(where)
                                .order_by(baseline_actions.c.id)).mappings().all()
        return [{**dict(r), "at": _aware(r["at"])} for r in rows]


def parse_since(text: str) -> datetime:
    """``7d``, ``12h``, ``30m`` (ago) or an ISO 8601 date/time (UTC when no zone is given)."""
    text = text.strip()
    units = {"d": "days", "h": "hours", "m": "minutes"}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        value = float(text[:-1])
        if not math.isfinite(value):
            raise ConfigError(f"--since {text!r}: give a finite duration like 7d, 12h, 30m")
        return _utcnow() - timedelta(**{units[text[-1]]: value})
    try:
        return _aware(datetime.fromisoformat(text.replace("Z", "+00:00")))
    except ValueError as exc:
        raise ConfigError(f"--since {text!r} is neither a duration (7d, 12h, 30m) nor an ISO date "
                          f"(2026-11-30 or 2026-11-30T08:00)") from exc

