"""Transitional: the gate history moved to :mod:`servegate.history` (keys, schema, database, store).

Kept only so that code outside the history's owners keeps importing ``servegate.store`` until it
imports ``servegate.history`` (tasks/compare.py, tasks/record.py, flows/calibrate.py,
servegate/rerun.py, tests/integration/test_rerun.py, tests/e2e/test_rerun_cli.py); then delete it.
"""

from servegate.history import (BASELINE_ACTIONS, MIGRATIONS, SCHEMA_VERSION, GateKey, RunRecord, Store,
                               default_url)

__all__ = ["GateKey", "RunRecord", "Store", "default_url", "MIGRATIONS", "SCHEMA_VERSION", "BASELINE_ACTIONS"]
