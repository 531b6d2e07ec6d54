"""servegate.jsonio: one NaN policy and one set of conversions for every JSON servegate writes."""

from __future__ import annotations

import datetime as dt
import enum
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import BaseModel

from servegate import jsonio


class _Colour(enum.Enum):
    RED = "red"


class _Model(BaseModel):
    latency_s: float
    at: dt.datetime


def test_non_finite_numbers_are_null_wherever_they_are() -> None:
    doc = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "np": np.float64("nan"),
           "array": np.array([1.5, np.nan, np.inf]), "nested": [{"x": math.nan}]}
    assert json.loads(jsonio.dumps(doc)) == {"nan": None, "inf": None, "ninf": None, "np": None,
                                             "array": [1.5, None, None], "nested": [{"x": None}]}


def test_types_the_policy_covers() -> None:
    at = dt.datetime(2026, 11, 30, 8, 0, 1, 500, tzinfo=dt.timezone.utc)
    doc = {"ts": pd.Timestamp(at), "dt": at, "date": dt.date(2026, 11, 30), "nat": pd.NaT, "na": pd.NA,
           "i": np.int64(3), "b": np.bool_(True), "objects": np.array(["a", None], dtype=object),
           "zero_d": np.array(2.5), "path": Path("/tmp/x"), "set": {7}, "tuple": (1, 2), "enum": _Colour.RED,
           "model": _Model(latency_s=math.nan, at=at), 5: "int key", None: "none key"}
    assert json.loads(jsonio.dumps(doc)) == {
        "ts": "2026-11-30T08:00:01.000500+00:00", "dt": "2026-11-30T08:00:01.000500+00:00", "date": "2026-11-30",
        "nat": None, "na": None, "i": 3, "b": True, "objects": ["a", None], "zero_d": 2.5, "path": "/tmp/x",
        "set": [7], "tuple": [1, 2], "enum": "red", "model": {"latency_s": None, "at": "2026-11-30T08:00:01.000500Z"},
        "5": "int key", "null": "none key"}


def test_an_unknown_type_is_a_type_error_not_a_string() -> None:
    with pytest.raises(TypeError):
        jsonio.dumps({"x": object()})


def test_indent_and_ascii_only_output_is_the_same_json() -> None:
    doc = {"error": "bad \x9b[31m byte: é 😀", "rows": [1, {}]}
    text = jsonio.dumps(doc, indent=True, ascii_only=True)
    assert text.isascii() and "\n  " in text and "\\u009b" in text
    assert json.loads(text) == doc == jsonio.loads(text)


def test_loads_reads_older_documents_with_nan_tokens() -> None:
    old = json.dumps({"ratio": math.nan, "ok": 1})  # Python's json writes NaN tokens
    back = jsonio.loads(old)
    assert math.isnan(back["ratio"]) and back["ok"] == 1
    assert jsonio.loads(b'{"a": [1, null]}') == {"a": [1, None]}
    with pytest.raises(ValueError):
        jsonio.loads("{not json")


def test_to_jsonable_and_the_config_snapshot_form() -> None:
    assert jsonio.to_jsonable({"x": np.float32(0.5), "y": math.nan}) == {"x": 0.5, "y": None}
    snapshot = {"serving": {"request_rate": math.inf, "rates": [1.0, -math.inf]}, "seed": 1}
    assert jsonio.non_finite_as_strings(snapshot) == {"serving": {"request_rate": "inf", "rates": [1.0, "-inf"]},
                                                      "seed": 1}
