"""Values between Python and the history database: JSON-clean records and rows, table dtypes,
UTC datetimes (stored naive: SQLite has no time zones). JSON by :mod:`servegate.jsonio`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import pandas as pd

from servegate import jsonio
from servegate.errors import ConfigError

__all__ = ["utcnow", "naive_utc", "aware_utc", "json_record", "frame_to_rows", "restore_dtypes", "branch_of"]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def naive_utc(value: Any) -> datetime:
    """A naive UTC datetime for the database (SQLite has no time zones)."""
    if value is None:
        return utcnow().replace(tzinfo=None)
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if not isinstance(value, datetime):
        raise ConfigError(f"expected a datetime or ISO 8601 string, got {value!r}")
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


def aware_utc(value: datetime) -> datetime:
    """A datetime read from the database as UTC with its time zone."""
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def json_record(obj: Any) -> dict[str, Any]:
    """A record (pydantic model or mapping) as a JSON-clean dict for a JSON column."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, Mapping):
        try:
            return jsonio.to_jsonable(dict(obj))  # numpy scalars, datetimes, NaN -> None
        except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
            raise ConfigError(f"cannot store the record with fields {list(obj)[:8]} as JSON: {exc}; "
                              f"give plain values, lists, "
                              f"dicts, numbers or pydantic models") from exc
    raise ConfigError(f"expected a mapping or a pydantic model, got {type(obj).__name__}")


def frame_to_rows(name: str, df: pd.DataFrame) -> list[dict[str, Any]]:
    """A table as JSON-clean row dicts (NaN -> None), one per raw row."""
    try:
        return jsonio.to_jsonable(df.to_dict(orient="records"))
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise ConfigError(f"table {name!r} has a value that cannot be stored: {exc}; give each column numbers, "
                          f"strings, booleans or lists of numbers") from exc


def restore_dtypes(df: pd.DataFrame, columns: Sequence[Mapping[str, str]]) -> pd.DataFrame:
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


def branch_of(manifest: Mapping[str, Any], config: Mapping[str, Any]) -> str | None:
    """The branch a run was measured on: the manifest's ``git_branch``/``branch``, else the config's."""
    for source in (manifest, config):
        for name in ("git_branch", "branch"):
            value = source.get(name)
            if value:
                return str(value)
    return None
