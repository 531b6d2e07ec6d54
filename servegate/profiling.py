"""Operator profiles of a confirmed regression: read two Chrome traces, say which operators' time changed.

A trace is what torch.profiler writes (Kineto's Chrome trace format: ``{"traceEvents": [...]}``, JSON
or gzipped JSON): the embedded worker's ``/stop_profile``, vLLM's ``torch_profiler_dir``, SGLang's
``SGLANG_TORCH_PROFILER_DIR``. Only complete events (``"ph": "X"``) count, but for the profiler's own
session spans (category ``Trace``), which cover the whole recording and measure nothing.

An operator's time is its *self* time: its duration less that of the events nested directly in it on
the same (pid, tid), so that ``aten::linear`` does not count the ``aten::addmm`` inside it again and
the sum over operators is the time the thread spent in them. :func:`diff_operator_times` puts two
such sums side by side (A the baseline, B the candidate): the ``profile_ops`` table
(:data:`servegate.tables.PROFILE_OPS_COLUMNS`), largest slow-down first.

Pure functions over files and frames; the paired stage (:mod:`servegate.paired.rounds`) records
the traces and calls them.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from servegate.errors import StageError
from servegate.tables import PROFILE_OPS_COLUMNS

__all__ = ["TRACE_PATTERNS", "trace_events", "operator_self_times", "read_operator_times", "diff_operator_times",
           "find_traces"]

TRACE_PATTERNS = ("*.trace.json", "*.trace.json.gz")
"""The trace files of a profiler directory: torch.profiler's ``*.pt.trace.json[.gz]`` (the worker,
vLLM) and SGLang's ``<id>-TP-<rank>.trace.json.gz``."""

_SESSION_CATEGORIES = frozenset({"Trace"})
"""Categories of the profiler's own spans (``PyTorch Profiler (0)``: the whole session), not work."""

OPERATOR_COLUMNS = ["op", "calls", "self_ms"]


def find_traces(directory: Path) -> list[Path]:
    """The trace files in ``directory`` (not recursive), oldest first."""
    found = {p for pattern in TRACE_PATTERNS for p in Path(directory).glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name))


def trace_events(path: Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of one Chrome trace file (``.json`` or ``.json.gz``); ``StageError`` when
    the file is not one."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        doc = json.loads(raw)
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile, ValueError) as exc:
        raise StageError(f"cannot read the profiler trace {path}: {exc}; is it a complete Chrome trace "
                         f"(torch.profiler's export_chrome_trace)?") from exc
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise StageError(f"{path} has no traceEvents list: not a Chrome trace")
    return [e for e in events if isinstance(e, dict)]


def _complete(events: Iterable[dict[str, Any]]) -> dict[tuple[Any, Any], list[tuple[float, float, str]]]:
    """Complete events per (pid, tid): (start µs, duration µs, name)."""
    lanes: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") in _SESSION_CATEGORIES:
            continue
        try:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue  # an event without a time cannot be placed; Kineto always writes one
        if math.isfinite(ts) and math.isfinite(dur) and dur >= 0:
            lanes.setdefault((e.get("pid"), e.get("tid")), []).append((ts, dur, str(e.get("name", "?"))))
    return lanes


def operator_self_times(events: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Per operator name: ``calls`` and ``self_ms`` (duration less its directly nested events'), summed
    over every (pid, tid). Columns :data:`OPERATOR_COLUMNS`, largest self time first.

    Events nest when one lies within another on the same lane; a child that overruns its parent's
    end (rounding) is charged to the parent only up to that end.
    """
    calls: dict[str, int] = {}
    self_us: dict[str, float] = {}
    for lane in _complete(events).values():
        lane.sort(key=lambda x: (x[0], -x[1]))  # a parent before the children that start with it
        stack: list[list[Any]] = []  # [end, name, self_us]

        def close(until: float) -> None:
            while stack and stack[-1][0] <= until:
                _, name, own = stack.pop()
                self_us[name] = self_us.get(name, 0.0) + max(own, 0.0)

        for ts, dur, name in lane:
            close(ts)
            end = ts + dur
            if stack:
                parent = stack[-1]
                parent[2] -= min(end, parent[0]) - ts
            stack.append([end, name, dur])
            calls[name] = calls.get(name, 0) + 1
        close(math.inf)
    rows = [{"op": name, "calls": calls[name], "self_ms": self_us.get(name, 0.0) / 1000.0} for name in calls]
    df = pd.DataFrame(rows, columns=OPERATOR_COLUMNS)
    return df.sort_values(["self_ms", "op"], ascending=[False, True], ignore_index=True)


def read_operator_times(paths: Sequence[Path]) -> pd.DataFrame:
    """:func:`operator_self_times` summed over trace files (one per rank or worker process of a side);
    ``StageError`` when there is none or they hold no complete event."""
    if not paths:
        raise StageError("no profiler trace to read: the engine wrote none into its profiler directory")
    frames = [operator_self_times(trace_events(p)) for p in paths]
    df = pd.concat(frames, ignore_index=True).groupby("op", as_index=False)[["calls", "self_ms"]].sum()
    if df.empty:
        raise StageError(f"the profiler traces {[str(p) for p in paths]} hold no complete event (\"ph\": \"X\"): "
                         f"the profile recorded no operator; send requests between start and stop")
    return df.sort_values(["self_ms", "op"], ascending=[False, True], ignore_index=True)


def diff_operator_times(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """The ``profile_ops`` table: every operator of either side (A the baseline, B the candidate),
    its calls and self time on each (0 where absent), ``delta_ms`` = B - A and ``ratio`` = B / A
    (inf for an operator only B ran), sorted by ``delta_ms`` descending: the largest slow-down first."""
    merged = pd.merge(a[OPERATOR_COLUMNS], b[OPERATOR_COLUMNS], on="op", how="outer", suffixes=("_a", "_b"))
    for column in ("calls_a", "calls_b"):
        merged[column] = merged[column].fillna(0).astype("int64")
    for column in ("self_ms_a", "self_ms_b"):
        merged[column] = merged[column].fillna(0.0).astype(float)
    merged["delta_ms"] = merged["self_ms_b"] - merged["self_ms_a"]
    merged["ratio"] = [b_ms / a_ms if a_ms > 0 else (math.inf if b_ms > 0 else math.nan)
                       for a_ms, b_ms in zip(merged["self_ms_a"], merged["self_ms_b"])]
    merged = merged.sort_values(["delta_ms", "op"], ascending=[False, True], ignore_index=True)
    return merged[PROFILE_OPS_COLUMNS]
