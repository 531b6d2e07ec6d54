"""Gate history: every gate run, its provenance, its raw tables and its verdict, in a database.

::

    keys.py      GateKey (what a baseline is per), RunRecord (one recorded attempt)
    schema.py    the tables and their versioned migrations
    rows.py      values between Python and the database (JSON-clean rows, dtypes, UTC times)
    database.py  connecting, the write lock, the schema checked (created, upgraded, refused) on first use
    store.py     Store: record a run, a baseline action, a calibration; read them back

``Store(url)`` is the entry point; see :mod:`servegate.history.store`.
"""

from __future__ import annotations

from servegate.history.database import default_url
from servegate.history.keys import GateKey, RunRecord
from servegate.history.schema import BASELINE_ACTIONS, MIGRATIONS, SCHEMA_VERSION
from servegate.history.store import Store

__all__ = ["GateKey", "RunRecord", "Store", "default_url", "MIGRATIONS", "SCHEMA_VERSION", "BASELINE_ACTIONS"]
