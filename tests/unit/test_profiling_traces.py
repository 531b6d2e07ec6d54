"""servegate.profiling on traces a real torch.profiler run writes here, and on the edge cases
(overrunning children, gzip, operators on one side only, files that are no trace)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from servegate.errors import StageError
from servegate.profiling import (diff_operator_times, find_traces, operator_self_times, read_operator_times,
                                 trace_events)
from servegate.tables import PROFILE_OPS_COLUMNS


def _record(path: Path, silu_repeats: int, steps: int = 5) -> Path:
    """A trace of a small MLP's forward passes whose activation is computed ``silu_repeats`` times."""
    torch.manual_seed(0)
    up, down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
    x = torch.randn(256, 64)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            h = up(x)
            for _ in range(silu_repeats):
                a = torch.nn.functional.silu(h)
            x = down(a)
    prof.export_chrome_trace(str(path))
    return path


def test_self_times_of_a_real_trace_split_nested_operators_without_double_counting(tmp_path: Path):
    events = trace_events(_record(tmp_path / "a.pt.trace.json", silu_repeats=3))
    ops = operator_self_times(events).set_index("op")
    assert ops.loc["aten::silu", "calls"] == 15 and ops.loc["aten::linear", "calls"] == 10
    # aten::linear calls aten::addmm (via aten::t etc.): its self time is less than its duration.
    linear_total = sum(e["dur"] for e in events if e.get("ph") == "X" and e["name"] == "aten::linear") / 1000
    assert 0 <= ops.loc["aten::linear", "self_ms"] < linear_total
    # Self times add up to the time of the outermost operators, lane by lane: nothing counted twice.
    ops_events = [e for e in events if e.get("ph") == "X" and e.get("cat") != "Trace"]
    roots = 0.0
    for i, e in enumerate(ops_events):
        # inside another event of its lane; of two with the same start and duration, the first is the parent
        inside = any(j != i and o["pid"] == e["pid"] and o["tid"] == e["tid"] and o["ts"] <= e["ts"]
                     and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
                     and (o["dur"] > e["dur"] or o["ts"] < e["ts"] or j < i) for j, o in enumerate(ops_events))
        roots += 0.0 if inside else e["dur"]
    # Up to the trace's rounding: a child whose end, rounded to the nanosecond, overruns its parent's by
    # ~1 ns keeps its own duration while the parent is charged only to its end (CI saw 3 ns over ~100
    # events); 0.2 us in all is far below any operator's own duration counted twice.
    assert ops["self_ms"].sum() == pytest.approx(roots / 1000, abs=2e-4)
    assert "PyTorch Profiler (0)" not in ops.index  # the session span is no operator


def test_the_diff_of_two_real_traces_puts_the_slowed_operator_first(tmp_path: Path):
    a = read_operator_times([_record(tmp_path / "a.pt.trace.json", silu_repeats=1)])
    # 2000 activations against 5 (about 20 ms more): a busy machine that preempts one of the ten matrix
    # products for a scheduler tick (4 ms; 40 repeats lost to that once) cannot outweigh it. The ratio is
    # only checked against its definition: a CI lane once stalled A's five activations for 16.7 ms, and
    # B's 2000 read only x2.04 of them (the delta, 17.1 ms, still put them first).
    b_path = _record(tmp_path / "b.pt.trace.json.gz", silu_repeats=400)  # torch gzips a .gz path
    assert b_path.read_bytes()[:2] == b"\x1f\x8b"
    b = read_operator_times([b_path])
    diff = diff_operator_times(a, b)
    assert list(diff.columns) == PROFILE_OPS_COLUMNS
    top = diff.iloc[0]
    assert top["op"] == "aten::silu" and top["calls_a"] == 5 and top["calls_b"] == 2000
    assert top["delta_ms"] == pytest.approx(top["self_ms_b"] - top["self_ms_a"]) and top["delta_ms"] > 0
    assert top["ratio"] == pytest.approx(top["self_ms_b"] / top["self_ms_a"]) and top["ratio"] > 1
    assert list(diff["delta_ms"]) == sorted(diff["delta_ms"], reverse=True)
    assert find_traces(tmp_path) == sorted([tmp_path / "a.pt.trace.json", b_path], key=lambda p: p.stat().st_mtime)


def _x(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_a_child_overrunning_its_parent_is_charged_only_up_to_the_parents_end():
    ops = operator_self_times([_x("parent", 0, 100), _x("child", 60, 50), _x("other_thread", 0, 30, tid=2),
                               {"ph": "i", "name": "instant", "pid": 1, "tid": 1, "ts": 5}])
    got = dict(zip(ops["op"], ops["self_ms"]))
    assert got == {"parent": pytest.approx(0.060), "child": pytest.approx(0.050),
                   "other_thread": pytest.approx(0.030)}


def test_operators_of_one_side_only_and_traces_summed_over_files(tmp_path: Path):
    for name, events in (("r0.trace.json.gz", [_x("aten::mm", 0, 1000)]),
                         ("r1.trace.json", [_x("aten::mm", 0, 500), _x("aten::silu", 600, 100)])):
        raw = json.dumps({"traceEvents": events}).encode()
        (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    b = read_operator_times(find_traces(tmp_path)).set_index("op")
    assert b.loc["aten::mm", "calls"] == 2 and b.loc["aten::mm", "self_ms"] == pytest.approx(1.5)
    a = operator_self_times([_x("aten::mm", 0, 1500), _x("aten::gone", 2000, 10)])
    diff = diff_operator_times(a, b.reset_index()).set_index("op")
    assert diff.loc["aten::silu", "calls_a"] == 0 and math.isinf(diff.loc["aten::silu", "ratio"])
    assert diff.loc["aten::gone", "calls_b"] == 0 and diff.loc["aten::gone", "ratio"] == 0
    assert diff.index[0] == "aten::silu" and diff.index[-1] == "aten::gone"


def test_what_is_no_trace_is_a_stage_error_that_says_so(tmp_path: Path):
    broken = tmp_path / "cut.pt.trace.json.gz"
    broken.write_bytes(gzip.compress(b'{"traceEvents": [')[:-8])
    with pytest.raises(StageError, match="cannot read the profiler trace"):
        trace_events(broken)
    empty = tmp_path / "empty.pt.trace.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}]}))
    with pytest.raises(StageError, match="no complete event"):
        read_operator_times([empty])
    with pytest.raises(StageError, match="no profiler trace"):
        read_operator_times([])
