"""servegate's one JSON codec: run-folder documents, the history database, ``--json`` output.

The policy, the same everywhere:

- **NaN, inf and -inf are written as null.** JSON has no such numbers, and "no value" must read
  back as no value, never as a number (a NaN latency is a missing measurement, not 0 ms).
  The one exception is the config snapshot: ``GateConfig`` accepts the strings ``"inf"``,
  ``"-inf"`` and ``"nan"`` for its unbounded fields (``serving.request_rate = inf``), so
  ``RunFolder.write_config`` passes the snapshot through :func:`non_finite_as_strings` first.
- numpy scalars and arrays as their Python values; ``datetime`` / pandas ``Timestamp`` /
  ``date`` / ``time`` as ISO 8601 strings; pandas ``NA`` and ``NaT`` as null; enums as their
  values; paths as strings; sets and tuples as lists; pydantic models as
  ``model_dump(mode="json")``; keys that are not strings (ints, None) as strings.
- Anything else is a ``TypeError`` naming the type (never a silent ``str(value)``).
- Reading is strict JSON, except that documents written by older servegate versions (or
  anything else) with Python's ``NaN`` / ``Infinity`` tokens still load: those become floats.

orjson does the work (the history database stores every raw request row through it); nothing
heavier is imported here, so the command line can use this module while it builds its parser.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
import math
import re
from os import PathLike
from typing import Any

import orjson

__all__ = ["dumps", "loads", "to_jsonable", "non_finite_as_strings"]

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
_NON_ASCII_RE = re.compile(r"[^\x00-\x7f]")


def _default(value: Any) -> Any:
    """What orjson does not serialise by itself (it calls this, then serialises the result)."""
    kind = type(value)
    if kind.__module__.startswith("pandas") and kind.__name__ in ("NAType", "NaTType"):
        return None  # before the datetime check: NaT is a datetime whose isoformat() is "NaT"
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()  # pandas Timestamp (a datetime subclass) included
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return list(value)
    if isinstance(value, PathLike):
        return str(value)
    if hasattr(value, "model_dump"):  # a pydantic model
        return value.model_dump(mode="json")
    if hasattr(value, "tolist"):  # numpy values orjson does not take natively (object arrays, 0-d arrays)
        return value.tolist()
    raise TypeError(f"cannot write a {kind.__name__} as JSON; give numbers, strings, booleans, lists, dicts, "
                    f"datetimes or pydantic models")


def _ascii_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code > 0xFFFF:  # outside the BMP: a UTF-16 surrogate pair, as JSON spells it
        code -= 0x10000
        return f"\\u{0xD800 | (code >> 10):04x}\\u{0xDC00 | (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def dumps(value: Any, *, indent: bool = False, ascii_only: bool = False) -> str:
    """``value`` as JSON text under this module's policy.

    ``indent``: two-space indentation (documents people read). ``ascii_only``: every non-ASCII
    character ``\\u``-escaped, for a terminal: a server's error text in a verdict may hold C1
    control characters that a terminal would take as escape sequences.
    Raises ``TypeError`` for a value of a type the policy does not cover.
    """
    options = _OPTIONS | orjson.OPT_INDENT_2 if indent else _OPTIONS
    text = orjson.dumps(value, default=_default, option=options).decode()
    return _NON_ASCII_RE.sub(_ascii_escape, text) if ascii_only else text


def loads(text: str | bytes | bytearray) -> Any:
    """Parse JSON text; Python's ``NaN`` / ``Infinity`` tokens (older documents) are accepted."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        # Not strict JSON: maybe an older document with NaN tokens. Python's parser accepts
        # those; anything else it rejects too, with its own (equally precise) message.
        return json.loads(text)


def to_jsonable(value: Any) -> Any:
    """A copy of ``value`` made only of JSON types (dict, list, str, int, float, bool, None) by
    this module's policy: what ``loads(dumps(value))`` gives."""
    return orjson.loads(dumps(value))


def non_finite_as_strings(value: Any) -> Any:
    """Non-finite floats as the strings ``"inf"``, ``"-inf"``, ``"nan"``, recursively through dicts
    and lists: the config snapshot's form (``GateConfig`` parses these strings back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: non_finite_as_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [non_finite_as_strings(v) for v in value]
    return value
