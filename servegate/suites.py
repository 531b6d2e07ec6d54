"""The suite file format, and reading and checking suite files; no Great Expectations here.

One JSON file per profile (``expectations/<profile>.json``) holds one suite per table::

    {"profile": "smoke", "description": "...",
     "suites": {"serving_summary": {"expectations": [
         {"type": "expect_column_values_to_be_between",
          "kwargs": {"column": "failed", "max_value": 0},
          "meta": {"source": "...", "measured": null, "noise": null, "hardware": "...", "date": "..."}}]}}}

``kwargs`` are GX's own (``row_condition`` in GX 1.x Condition form, e.g.
``{"type": "comparison", "column": {"name": "status"}, "operator": "==", "parameter": "skipped"}``).
Every expectation must name its ``meta.source``: a threshold is data with a provenance.

This module owns the format (``SuiteFile``), where suite files live, reading one
(``read_suite_file``), checking that the columns it names are ones its table has
(``check_suite_columns``), and saying in words what an expectation allows (``allowed_text``).
Running the suites on tables is ``servegate.validate``'s job.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servegate.errors import ValidationSetupError
from servegate.tables import KNOWN_TABLES, TABLES

__all__ = [
    "ExpectationSpec",
    "TableSuiteSpec",
    "SuiteFile",
    "resolve_expectations_dir",
    "read_suite_file",
    "check_suite_columns",
    "columns_needed",
    "allowed_text",
]

_COLUMN_KWARGS = ("column", "column_A", "column_B")


# ---- suite file format --------------------------------------------------------------------
class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExpectationSpec(_Spec):
    """One expectation as written in a suite file."""

    type: str = Field(description="GX expectation type, e.g. expect_column_values_to_be_between")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="GX kwargs (column, min_value, row_condition, ...)")
    meta: dict[str, Any] = Field(description="provenance: source (required), measured, noise, hardware, date")


class TableSuiteSpec(_Spec):
    """The expectations for one table."""

    expectations: list[ExpectationSpec] = Field(description="checked in this order")


class SuiteFile(_Spec):
    """``expectations/<profile>.json``."""

    profile: str = Field(description="must equal the file's stem")
    description: str | None = Field(None, description="what this profile gates and on which hardware")
    suites: dict[str, TableSuiteSpec] = Field(description="table name -> its suite")


# ---- reading and checking -----------------------------------------------------------------
def resolve_expectations_dir(expectations_dir: Path | str | None = None) -> Path:
    """Where suites live: the argument, else ``$SERVEGATE_EXPECTATIONS_DIR``, else the repo's expectations/."""
    if expectations_dir is not None:
        return Path(expectations_dir)
    env = os.environ.get("SERVEGATE_EXPECTATIONS_DIR")
    if env:
        return Path(env)
    import servegate

    return Path(servegate.__file__).resolve().parent.parent / "expectations"


def _available(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []


def read_suite_file(profile: str, expectations_dir: Path | str | None = None) -> tuple[Path, SuiteFile]:
    """Read and check ``<dir>/<profile>.json`` without building GX objects."""
    directory = resolve_expectations_dir(expectations_dir)
    path = directory / f"{profile}.json"
    if not path.is_file():
        raise ValidationSetupError(
            f"expectation suite {path} does not exist; choose a profile with a suite file "
            f"({_available(directory) or 'none found'}) or set SERVEGATE_EXPECTATIONS_DIR / validate.expectations_dir")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValidationSetupError(f"{path} is not valid JSON ({exc}); fix the file, see expectations/README.md") \
            from exc
    try:
        suite_file = SuiteFile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ValidationSetupError(
            f"{path} does not match the suite format ({problems}); valid top-level keys: profile, description, "
            f"suites; each expectation: type, kwargs, meta (see expectations/README.md)") from exc
    if suite_file.profile != profile:
        raise ValidationSetupError(f"{path} declares profile {suite_file.profile!r}; it must equal the file name "
                                   f"{profile!r}")
    for table, spec in suite_file.suites.items():
        if table not in KNOWN_TABLES:
            raise ValidationSetupError(f"{path}: unknown table {table!r}; valid tables: {list(KNOWN_TABLES)}")
        for i, exp in enumerate(spec.expectations):
            source = exp.meta.get("source")
            if not isinstance(source, str) or not source.strip():
                raise ValidationSetupError(
                    f"{path}: suites.{table}.expectations[{i}] ({exp.type}) has no meta.source; every threshold "
                    f"needs one (a measured value with hardware/date, a cited CI test, or 'provisional: ...')")
    return path, suite_file


def check_suite_columns(path: Path, suite_file: SuiteFile) -> None:
    """Raise ValidationSetupError when an expectation names a column (in its kwargs, its
    ``row_condition`` or ``meta.applies_when``) that its table never has (``servegate.tables``)."""
    for table, spec in suite_file.suites.items():
        known = TABLES[table].columns
        for i, exp in enumerate(spec.expectations):
            named = [*columns_needed(exp.kwargs), *([exp.meta["applies_when"]] if exp.meta.get("applies_when") else [])]
            unknown = [c for c in named if c not in known]
            if unknown:
                close = {c: difflib.get_close_matches(c, known, n=1) for c in unknown}
                hint = "; ".join(f"{c!r}: did you mean {m[0]!r}?" for c, m in close.items() if m)
                raise ValidationSetupError(
                    f"{path}: suites.{table}.expectations[{i}] ({exp.type}) names column(s) {unknown} that the "
                    f"{TABLES[table].stage} stage never writes to {table}{'; ' + hint if hint else ''}; its columns: "
                    f"{list(known)} (docs/contracts.md, servegate/tables.py)")


def columns_needed(kwargs: dict[str, Any]) -> list[str]:
    """Every column an expectation's kwargs name, its ``row_condition`` included."""
    cols = [str(kwargs[k]) for k in _COLUMN_KWARGS if k in kwargs]
    cols += [str(c) for c in kwargs.get("column_list", [])]

    def walk(cond: Any) -> None:
        if isinstance(cond, dict):
            if isinstance(cond.get("column"), dict) and "name" in cond["column"]:
                cols.append(str(cond["column"]["name"]))
            for sub in cond.get("conditions", []):
                walk(sub)

    walk(kwargs.get("row_condition"))
    return cols


# ---- in words -------------------------------------------------------------------------------
def _condition_text(cond: Any) -> str | None:
    if cond is None:
        return None
    if isinstance(cond, str):
        return cond
    if isinstance(cond, dict):
        kind = cond.get("type")
        if kind == "comparison":
            return f"{cond['column']['name']} {cond['operator']} {cond['parameter']!r}"
        if kind == "nullity":
            return f"{cond['column']['name']} is {'null' if cond.get('is_null', True) else 'not null'}"
        if kind in ("and", "or"):
            return f" {kind} ".join(filter(None, (_condition_text(c) for c in cond.get("conditions", []))))
        if kind == "pass_through":
            return str(cond.get("pass_through_filter"))
    return str(cond)


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def allowed_text(expectation_type: str, kwargs: dict[str, Any]) -> str:
    """What the expectation allows, for people: '>= 50', '> 95', 'in [measured, skipped]', 'not null'."""
    lo, hi = kwargs.get("min_value"), kwargs.get("max_value")
    if lo is not None or hi is not None:
        lo_op = ">" if kwargs.get("strict_min") else ">="
        hi_op = "<" if kwargs.get("strict_max") else "<="
        if lo is not None and hi is not None:
            text = f"{lo_op} {_num(lo)} and {hi_op} {_num(hi)}"
        elif lo is not None:
            text = f"{lo_op} {_num(lo)}"
        else:
            text = f"{hi_op} {_num(hi)}"
    elif "value_set" in kwargs:
        values = ", ".join(str(v) for v in kwargs["value_set"])
        if "not_be_in_set" in expectation_type:
            text = f"not in [{values}]"
        elif expectation_type.endswith("_to_contain_set"):
            text = f"contains [{values}]"
        elif expectation_type.endswith("_to_equal_set"):
            text = f"exactly [{values}]"
        else:
            text = f"in [{values}]"
    elif expectation_type.endswith("_not_be_null"):
        text = "not null"
    elif expectation_type.endswith("_to_be_null"):
        text = "null"
    elif expectation_type == "expect_column_pair_values_a_to_be_greater_than_b":
        op = ">=" if kwargs.get("or_equal") else ">"
        text = f"{kwargs.get('column_A')} {op} {kwargs.get('column_B')}"
    elif expectation_type == "expect_column_to_exist":
        text = "column exists"
    else:
        shown = {k: v for k, v in kwargs.items() if k not in ("column", "row_condition", "condition_parser", "meta")}
        text = ", ".join(f"{k}={v}" for k, v in shown.items()) or expectation_type
    mostly = kwargs.get("mostly")
    if mostly is not None and mostly < 1:
        text += f" for at least {mostly:.0%} of rows"
    cond = _condition_text(kwargs.get("row_condition"))
    if cond:
        text += f" where {cond}"
    return text
