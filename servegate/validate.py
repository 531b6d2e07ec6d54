"""Validate the stage tables with Great Expectations 1.x suites loaded from ``expectations/``.

The suite files (their format, reading and checking them) are ``servegate.suites``'s; this module
builds GX suites from them, runs them on the tables and turns GX's results into outcomes.

Outcomes, one per expectation (``ExpectationOutcome.success``):

- ``True`` / ``False``: GX evaluated it on the table;
- ``None`` with ``table_produced=False``: the table is not in ``tables`` (stage disabled,
  not applicable, or failed); the verdict decides what that means;
- ``None`` with ``table_produced=True``: the table is there but cannot be judged — it is
  empty, lacks a column the suite names, or GX raised; an infra problem, never a breach.

GX is imported lazily (it takes ~2.5 s) and one ephemeral context is built per process.
"""

from __future__ import annotations

import difflib
import math
import os
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from servegate.errors import ValidationSetupError
from servegate.suites import (
    ExpectationSpec,
    TableSuiteSpec,
    allowed_text,
    check_suite_columns,
    columns_needed,
    read_suite_file,
)

if TYPE_CHECKING:  # pragma: no cover
    import great_expectations as gx

__all__ = [
    "ExpectationOutcome",
    "load_suites",
    "validate_tables",
]

TABLE_NOT_PRODUCED = "table not produced"
_INDEX_KEY = "_servegate_index"  # matches GX results back to suite order (GX reorders them)


# ---- outcome ------------------------------------------------------------------------------
class ExpectationOutcome(BaseModel):
    """The result of one expectation on one table."""

    model_config = ConfigDict(extra="forbid")

    table: str = Field(description="table the expectation is about")
    expectation_type: str = Field(description="GX expectation type")
    column: str | None = Field(None, description="column checked (column_A,column_B for pair checks; None for table checks)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="the expectation's kwargs as written in the suite")
    success: bool | None = Field(description="True/False when evaluated; None when it could not be (see reason)")
    table_produced: bool = Field(description="False when the table was absent from the tables given")
    reason: str | None = Field(None, description="why success is None")
    observed: Any = Field(None, description="observed value, or {unexpected_count, element_count, unexpected_values}, "
                                            "or {missing_values} for *_to_contain_set")
    allowed: str = Field(description="human-readable allowed range, e.g. '>= 50' or 'in [measured, skipped]'")
    meta: dict[str, Any] = Field(default_factory=dict, description="provenance from the suite file (source, measured, ...)")
    applicable: bool = Field(True, description=(
        "False when the suite's meta.applies_when column is false in every row: the engine cannot provide "
        "what the expectation checks (e.g. no forward-occupancy gauge); never a breach, never evaluated"))


# ---- GX context (one per process) -----------------------------------------------------------
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _gx() -> Any:
    """Import GX once, quietly (no analytics, no deprecation noise from its imports)."""
    if "gx" not in _state:
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import great_expectations as gx

        _state["gx"] = gx
    return _state["gx"]


def _context() -> Any:
    """The process-wide ephemeral GX context with one pandas data source, progress bars off."""
    with _lock:
        if "context" not in _state:
            gx = _gx()
            from great_expectations.data_context.types.base import ProgressBarsConfig

            ctx = gx.get_context(mode="ephemeral")
            ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
            _state["context"] = ctx
            _state["datasource"] = ctx.data_sources.add_pandas("servegate")
            _state["batch_definitions"] = {}
        return _state["context"]


def _batch_definition(table: str) -> Any:
    _context()
    with _lock:
        bds: dict[str, Any] = _state["batch_definitions"]
        if table not in bds:
            asset = _state["datasource"].add_dataframe_asset(table)
            bds[table] = asset.add_batch_definition_whole_dataframe(f"{table}-whole")
        return bds[table]


# ---- building suites ------------------------------------------------------------------------
def _build_suite(path: Path, profile: str, table: str, spec: TableSuiteSpec, *, with_index: bool) -> Any:
    gx = _gx()
    from great_expectations.exceptions import GreatExpectationsError
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration
    from great_expectations.expectations.registry import list_registered_expectation_implementations

    _context()  # GX objects expect a context to exist
    suite = gx.ExpectationSuite(name=f"{profile}.{table}")
    for i, exp in enumerate(spec.expectations):
        meta = dict(exp.meta)
        if with_index:
            meta[_INDEX_KEY] = i
        where = f"{path}: suites.{table}.expectations[{i}] ({exp.type})"
        try:
            # match_type "runtime": an entry replaces another only when every kwarg is the same. GX's
            # default ("domain": type, column, row_condition) silently dropped the first of two checks
            # of one column on the same rows (decision not insufficient_data / not inconclusive).
            suite.add_expectation_configuration(ExpectationConfiguration(type=exp.type, kwargs=dict(exp.kwargs),
                                                                         meta=meta), match_type="runtime")
        except GreatExpectationsError as exc:
            known = list_registered_expectation_implementations()
            close = difflib.get_close_matches(exp.type, known, n=3)
            hint = f"did you mean {close}?" if close else f"valid types include {sorted(known)[:12]} ..."
            raise ValidationSetupError(f"{where}: {exc}; {hint}") from exc
        except (ValueError, TypeError) as exc:  # GX's pydantic v1 ValidationError is a ValueError
            raise ValidationSetupError(f"{where}: invalid kwargs {exp.kwargs}: {exc}") from exc
    return suite


def load_suites(profile: str, expectations_dir: Path | None = None) -> dict[str, "gx.ExpectationSuite"]:
    """Load ``expectations/<profile>.json`` as one GX ExpectationSuite per table.

    Raises ValidationSetupError when the file is missing, is not JSON, does not follow the
    format, names an unknown table or expectation type, has invalid kwargs, or names a column
    its table never has (``servegate.tables``).
    """
    path, suite_file = read_suite_file(profile, expectations_dir)
    suites = {table: _build_suite(path, profile, table, spec, with_index=False)
              for table, spec in suite_file.suites.items()}
    check_suite_columns(path, suite_file)
    return suites


# ---- outcome extraction ---------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """JSON-friendly python value: numpy scalars unwrapped, NaN -> None, tuples -> lists."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if value is pd.NaT or value is pd.NA:
        return None
    return value


def _column_label(kwargs: dict[str, Any]) -> str | None:
    if "column" in kwargs:
        return str(kwargs["column"])
    if "column_A" in kwargs or "column_B" in kwargs:
        return f"{kwargs.get('column_A')},{kwargs.get('column_B')}"
    if "column_list" in kwargs:
        return ",".join(str(c) for c in kwargs["column_list"])
    return None


def _observed(result: dict[str, Any], df: pd.DataFrame, kwargs: dict[str, Any]) -> Any:
    if "observed_value" in result:
        if result["observed_value"] is None and result.get("partial_missing_list"):
            # expect_column_distinct_values_to_contain_set reports what is missing, not what is there
            return {"missing_values": _plain(result["partial_missing_list"])}
        return _plain(result["observed_value"])
    # One-row tables (the summaries): the value itself says more than counts do.
    column = kwargs.get("column")
    if len(df) == 1 and column is not None and "row_condition" not in kwargs and column in df.columns:
        return _plain(df[column].iloc[0])
    if "unexpected_count" in result:
        return {"unexpected_count": _plain(result.get("unexpected_count")),
                "element_count": _plain(result.get("element_count")),
                "unexpected_values": _plain(result.get("partial_unexpected_list", []))}
    return _plain(result) or None


def _outcome(table: str, spec: ExpectationSpec, *, success: bool | None, produced: bool,
             reason: str | None = None, observed: Any = None) -> ExpectationOutcome:
    return ExpectationOutcome(table=table, expectation_type=spec.type, column=_column_label(spec.kwargs),
                              kwargs=spec.kwargs, success=success, table_produced=produced, reason=reason,
                              observed=observed, allowed=allowed_text(spec.type, spec.kwargs), meta=spec.meta)


def _not_applicable(exp: ExpectationSpec, df: pd.DataFrame) -> str | None:
    """Why ``exp`` does not apply to this table, or None when it does.

    ``meta.applies_when`` names a boolean column the stage writes from the engine's capabilities
    (``fwd_occupancy_applicable``): false in every row means the engine cannot expose what the
    expectation checks, so a breach of it would blame the engine for a missing feature.
    """
    flag = exp.meta.get("applies_when")
    if not flag or flag not in df.columns:
        return None
    values = df[flag]
    if values.isna().any() or values.astype(bool).any():
        return None
    return f"not applicable: {flag} is false (the engine does not provide it)"


def _validate_table(path: Path, profile: str, table: str, spec: TableSuiteSpec,
                    df: pd.DataFrame) -> list[ExpectationOutcome]:
    if len(df) == 0:
        reason = f"table {table!r} is empty (0 rows): insufficient data to judge; check why the stage measured nothing"
        return [_outcome(table, e, success=None, produced=True, reason=reason) for e in spec.expectations]

    outcomes: dict[int, ExpectationOutcome] = {}
    runnable: list[int] = []
    for i, exp in enumerate(spec.expectations):
        missing = [c for c in columns_needed(exp.kwargs) if c not in df.columns]
        if (why := _not_applicable(exp, df)) is not None:
            outcomes[i] = _outcome(table, exp, success=None, produced=True, reason=why).model_copy(
                update={"applicable": False})
        elif missing:
            outcomes[i] = _outcome(table, exp, success=None, produced=True,
                                   reason=f"column(s) {missing} missing from table {table!r}; the stage's output "
                                          f"does not match docs/contracts.md (or the suite names a wrong column)")
        else:
            runnable.append(i)

    if runnable:
        subset = TableSuiteSpec(expectations=[spec.expectations[i] for i in runnable])
        suite = _build_suite(path, profile, table, subset, with_index=True)
        batch = _batch_definition(table).get_batch(batch_parameters={"dataframe": df})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            result = batch.validate(suite, result_format="SUMMARY")
        for r in result.results:
            original = runnable[r.expectation_config.meta[_INDEX_KEY]]
            exp = spec.expectations[original]
            info = r.exception_info or {}
            if info.get("raised_exception"):
                outcomes[original] = _outcome(table, exp, success=None, produced=True,
                                              reason=f"GX could not evaluate it: {info.get('exception_message')}")
                continue
            outcomes[original] = _outcome(table, exp, success=bool(r.success), produced=True,
                                          observed=_observed(dict(r.result or {}), df, exp.kwargs))
    return [outcomes[i] for i in range(len(spec.expectations))]


def validate_tables(tables: dict[str, pd.DataFrame], profile: str,
                    expectations_dir: Path | None = None) -> list[ExpectationOutcome]:
    """Validate each table against its suite in ``expectations/<profile>.json``.

    Returns one outcome per expectation, in suite-file order. A suite whose table is not in
    ``tables`` yields outcomes with ``success=None, table_produced=False,
    reason="table not produced"``; a present but empty table yields ``success=None`` with an
    "insufficient data" reason. Tables without a suite are not validated. Raises
    ValidationSetupError for a missing or malformed suite file.
    """
    path, suite_file = read_suite_file(profile, expectations_dir)
    outcomes: list[ExpectationOutcome] = []
    for table, spec in suite_file.suites.items():
        df = tables.get(table)
        if df is None:
            outcomes += [_outcome(table, e, success=None, produced=False, reason=TABLE_NOT_PRODUCED)
                         for e in spec.expectations]
            continue
        outcomes += _validate_table(path, profile, table, spec, df)
    return outcomes
