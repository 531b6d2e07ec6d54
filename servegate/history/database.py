"""The history database itself: connecting, the write lock, and making sure the schema is there.

**Writes are transactional and one at a time.** :meth:`Store.record_run` writes a run, its
tables, its expectation outcomes in one transaction: a run is either fully recorded or absent; a
killed writer leaves the database valid (SQLite rolls the hot journal back on the next open).
Every write transaction takes the store's write lock before it reads anything (SQLite
``BEGIN IMMEDIATE``, waiting up to a 30 s busy timeout; PostgreSQL ``pg_advisory_xact_lock``, waiting
up to a 30 s ``lock_timeout``), so gates recording at once cannot both take the same attempt number
or both create the schema; a writer that dies mid-transaction releases it (PostgreSQL ends the dead
client's transaction). Readers do not take it, and read one snapshot (SQLite: a read transaction;
PostgreSQL: ``REPEATABLE READ``), so a reader during writes sees a run whole or not at all.
SQLite keeps its default rollback journal, not WAL: switching a file to WAL fails at once (no busy
wait) while another connection writes, writes to the file (a reader would turn a user's empty file
into a database), and needs shared memory that network file systems lack; writers are serialised
by ``BEGIN IMMEDIATE`` either way.

**Opening.** ``Store(url)`` (through :class:`HistoryDatabase`) only connects on first use; then
the schema is checked once:

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

:class:`HistoryDatabase` does all of this for :class:`~servegate.history.store.Store`, which
holds one and only reads and writes records through :meth:`HistoryDatabase.reading` and
:meth:`HistoryDatabase.writing`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from servegate import jsonio
from servegate.config import redact_url
from servegate.errors import ConfigError, InfraError
from servegate.history import schema

__all__ = ["HistoryDatabase", "default_url", "normalise_url"]

_WRITE_LOCK_TIMEOUT_S = 30.0  # how long a writer waits for another one: SQLite busy timeout, PostgreSQL lock_timeout
_CONNECT_TIMEOUT_S = 10  # a PostgreSQL server that does not answer: an error, not a hang
# The execution option that makes a transaction take the write lock first (see HistoryDatabase._locked).
_WRITE_LOCK = "servegate_write_lock"
# PostgreSQL advisory lock id of the store's write lock ("servegat" as a 64-bit integer). One lock
# for the whole store: a gate run writes once, so writers queue only for the seconds a record takes.
_PG_WRITE_LOCK_KEY = int.from_bytes(b"servegat", "big")
_PG_LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE of a lock wait that ran past lock_timeout


def default_url() -> str:
    """``$SERVEGATE_DB`` if set, else a SQLite file under ``$SERVEGATE_HOME`` or ``~/.local/share/servegate``."""
    env = os.environ.get("SERVEGATE_DB")
    if env:
        return env
    home = os.environ.get("SERVEGATE_HOME")
    folder = Path(home) if home else Path.home() / ".local" / "share" / "servegate"
    return f"sqlite:///{folder / 'history.db'}"


def normalise_url(url: str) -> str:
    """A SQLAlchemy URL; a plain path is taken as a SQLite file."""
    if "://" in url:
        return url
    return f"sqlite:///{Path(url).expanduser().resolve()}"



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


class HistoryDatabase:
    """One history database: its engine, its write lock, its schema checked on first use
    (created, upgraded, or refused with the reason: see the module docstring, "Opening")."""

    def __init__(self, url: str | None = None, *, echo: bool = False) -> None:
        self._url = normalise_url(url or default_url())
        self._sqlite_file: Path | None = None  # a history kept in a SQLite file (not :memory:, not a server)
        self._schema_ready = False
        kwargs: dict[str, Any] = {"echo": echo, "json_serializer": jsonio.dumps, "json_deserializer": jsonio.loads,
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
            kwargs["connect_args"] = {"timeout": _WRITE_LOCK_TIMEOUT_S}
        elif self._url.startswith("postgresql"):
            # A long-lived Store (a Prefect worker) outlives server restarts: check a pooled connection before use.
            kwargs["pool_pre_ping"] = True
            kwargs["connect_args"] = {"connect_timeout": _CONNECT_TIMEOUT_S}
        try:
            self._engine = _create_engine(self._url, **kwargs)
        except (ArgumentError, ImportError) as exc:
            raise ConfigError(f"cannot open history database {redact_url(self._url)!r}: {exc}; give a SQLAlchemy "
                              f"URL such as sqlite:////path/history.db or postgresql+psycopg://user:password@host/db, "
                              f"its driver installed (PostgreSQL: pip install 'servegate[postgres]')") from exc

    @property
    def url(self) -> str:
        """The SQLAlchemy URL (a plain path given was made a ``sqlite:///`` URL)."""
        return self._url

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for tools and tests that need raw SQL)."""
        return self._engine

    def close(self) -> None:
        """Close the engine's connections."""
        self._engine.dispose()

    @property
    def display_url(self) -> str:
        """The URL with its password hidden, for messages."""
        return redact_url(self._url)

    def error(self, exc: SQLAlchemyError, doing: str) -> InfraError:
        """``exc``, raised while ``doing``, as the InfraError a user reads: what failed and what to do."""
        orig = getattr(exc, "orig", None)
        code = getattr(orig, "sqlite_errorname", "")
        if code.startswith("SQLITE_BUSY") or getattr(orig, "sqlstate", None) == _PG_LOCK_NOT_AVAILABLE:
            hint = (f"another process held its write lock for over {_WRITE_LOCK_TIMEOUT_S:g} s (a gate recording, "
                    f"an open sqlite3 or psql shell?); let it finish, then retry")
        elif code in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
            hint = ("the file is not a SQLite database, or a damaged one: check that --db / SERVEGATE_DB names the "
                    "history file; if it does, restore it from a backup, or move it aside to start a new history")
        else:
            hint = "check that the database is reachable and writable, then retry"
        return InfraError(f"history database {redact_url(self._url)} failed while {doing}: {exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0]}; {hint}")

    @contextmanager
    def reading(self, doing: str) -> Iterator[Connection]:
        """A connection to read the history (one snapshot), its failures mapped to InfraError."""
        self._prepare(create=False)
        try:
            with self._engine.connect() as conn:
                if conn.dialect.name == "postgresql":
                    # READ COMMITTED would give each statement its own snapshot: a run's tables read after
                    # its row could belong to a later state of the database.
                    conn.execution_options(isolation_level="REPEATABLE READ")
                yield conn
        except SQLAlchemyError as exc:
            raise self.error(exc, doing) from exc

    @contextmanager
    def writing(self, doing: str, *, create: bool = False) -> Iterator[Connection]:
        """A transaction holding the write lock (see :meth:`_locked`); ``create``: the write may start a
        history in an empty database (the gate's own records), else it needs one that exists."""
        self._prepare(create=create)
        try:
            with self._locked() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise self.error(exc, doing) from exc

    @contextmanager
    def _locked(self) -> Iterator[Connection]:
        """A transaction that holds the store-wide write lock from its first statement, so what it reads
        before writing (the schema version, whether a run exists, the next attempt number) is still
        true when it commits. SQLite: ``BEGIN IMMEDIATE`` (waits up to the busy timeout for another
        writer); PostgreSQL: a transaction-level advisory lock (waiting up to ``lock_timeout``), in READ
        COMMITTED, so that every statement after the lock sees what the writer before it committed.
        Readers are not blocked by it."""
        with self._engine.connect().execution_options(**{_WRITE_LOCK: True}) as conn, conn.begin():
            if conn.dialect.name == "postgresql":
                conn.execute(sa.select(sa.func.set_config("lock_timeout", f"{_WRITE_LOCK_TIMEOUT_S * 1000:.0f}ms",
                                                          True)))
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_WRITE_LOCK_KEY)))
            yield conn

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
                applied = schema.applied_versions(conn)
            if applied is None or self._pending(applied):
                doing = "creating or upgrading its schema"
                with self._locked() as conn:
                    # Again, now that the lock is held: another process may have created or upgraded
                    # the schema while this one waited for it.
                    applied = schema.applied_versions(conn)
                    if applied is None:
                        self._check_can_start_history(conn, create=create)
                    pending = self._pending(applied or set())
                    doing = "applying schema migrations " + ", ".join(f"{v} ({d})" for v, d, _ in pending)
                    schema.apply_migrations(conn, pending)
        except SQLAlchemyError as exc:
            raise self.error(exc, doing) from exc
        self._schema_ready = True

    def _pending(self, applied: set[int]) -> list[tuple[int, str, Callable[[Connection], None]]]:
        """The migrations still to apply; a database written by a newer servegate is refused."""
        newest = max(applied, default=0)
        if newest > schema.SCHEMA_VERSION:
            raise InfraError(f"history database {redact_url(self._url)} has schema version {newest}, newer than this "
                             f"servegate understands ({schema.SCHEMA_VERSION}); upgrade servegate to read it")
        return [m for m in schema.MIGRATIONS if m[0] not in applied]

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
                schema.apply_migrations(conn, schema.MIGRATIONS)
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
        """The newest migration applied to the database."""
        with self.reading("reading its schema version") as conn:
            return int(conn.execute(sa.select(sa.func.max(schema.schema_migrations.c.version))).scalar() or 0)
