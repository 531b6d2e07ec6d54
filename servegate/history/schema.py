"""The history database's schema (SQLAlchemy Core, portable across SQLite and PostgreSQL) and
its migrations::

    schema_migrations  version, description, applied_at          one row per applied migration
    runs               run_id, attempt_of, attempt, gate key, provenance, verdict, manifest, config
    run_tables         run_id, table_name, n_rows, columns (name + dtype, to restore types)
    table_rows         run_id, table_name, row_index, data (one JSON object per raw row)
    outcomes           run_id, idx, table_name, expectation_type, column, success, data (JSON)
    baseline_actions   gate key, action (pin|unpin|distribution_change), run_id, reason, actor, at
    calibrations       gate key, at, plan, summary, metrics (``servegate calibrate`` results)

Raw per-request rows (``serving_requests`` with its ``itls_ms`` lists, ``occupancy_samples``)
are kept row by row, so every statistic can be recomputed later.

**Migrations are versioned** with a small ordered list (:data:`MIGRATIONS`) and a
``schema_migrations`` table rather than Alembic: the schema is a handful of tables, it must
upgrade itself on first use in any process (CLI, Prefect worker, test), and an Alembic script
folder would have to be shipped and located as package data. Add a migration by appending
``(version, description, function(connection))``; :mod:`servegate.history.database` applies
the pending ones in one transaction under the write lock and refuses a database written by a
newer servegate (higher version). Readers look :data:`MIGRATIONS` and :data:`SCHEMA_VERSION` up
on this module at the time of use (tests stand in an older list).

JSON columns hold what :mod:`servegate.jsonio` writes (NaN as null); every history written
since version 1 was written that way, so it reads back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from servegate.errors import ConfigError
from servegate.history.keys import GateKey
from servegate.history.rows import naive_utc

__all__ = ["metadata", "schema_migrations", "runs", "run_tables", "table_rows", "outcomes_t", "baseline_actions",
           "calibrations", "check_lengths", "key_match", "MIGRATIONS", "SCHEMA_VERSION", "apply_migrations",
           "applied_versions",
           "BASELINE_ACTIONS"]

BASELINE_ACTIONS = ("pin", "unpin", "distribution_change")


def _key_columns() -> list[sa.Column]:
    """The gate key's four columns, as every per-key table holds them."""
    return [sa.Column("workload", sa.String(200), nullable=False), sa.Column("engine", sa.String(100), nullable=False),
            sa.Column("hardware", sa.String(200), nullable=False), sa.Column("model", sa.String(500), nullable=False)]


def key_match(table: sa.Table, key: GateKey) -> Any:
    """The WHERE clause selecting ``key``'s rows of a per-key table."""
    return sa.and_(table.c.workload == key.workload, table.c.engine == key.engine,
                   table.c.hardware == key.hardware, table.c.model == key.model)


def check_lengths(table: sa.Table, rows: Sequence[dict[str, Any]]) -> None:
    """Refuse a value longer than its column (``String(n)``) before writing: PostgreSQL would refuse it
    mid-transaction as a database failure, SQLite would store it; both backends now say the same."""
    for row in rows:
        for name, value in row.items():
            limit = getattr(table.c[name].type, "length", None)
            if limit is not None and isinstance(value, str) and len(value) > limit:
                raise ConfigError(f"{table.name}.{name} is {len(value)} characters long, over the history database's "
                                  f"limit of {limit}: {value[:60]!r}...; shorten it (a gate name, model name or run "
                                  f"folder path)")


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


def apply_migrations(conn: Connection, migrations: Sequence[tuple[int, str, Callable[[Connection], None]]]) -> None:
    """Apply ``migrations`` in order and record each (inside the caller's transaction)."""
    schema_migrations.create(conn, checkfirst=True)
    for version, description, upgrade in migrations:
        upgrade(conn)
        conn.execute(sa.insert(schema_migrations).values(version=version, description=description,
                                                         applied_at=naive_utc(None)))


def applied_versions(conn: Connection) -> set[int] | None:
    """The migrations applied to the database; None when it has no servegate schema at all."""
    if not sa.inspect(conn).has_table(schema_migrations.name):
        return None
    return set(conn.execute(sa.select(schema_migrations.c.version)).scalars())
