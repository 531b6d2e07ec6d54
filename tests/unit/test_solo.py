"""The solo harness's batch shape: which of a block's prompts each scheduler turn admits, by name or as the
counts that benchmarks/duet_admissions.py reads off a real worker, and a real two-build measurement with it."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from servegate.paired.solo import DEFAULT_ARRIVALS, NAMED_ARRIVALS, admission_plan, run_solo
from servegate.paired.zoo import copy_package


def test_named_shapes_and_written_patterns() -> None:
    assert DEFAULT_ARRIVALS == "served" and set(NAMED_ARRIVALS) == {"served", "ragged", "aligned"}
    assert admission_plan("served", 4) == [1, 3]  # what 20 of 20 duet blocks did (solo.py's NAMED_ARRIVALS)
    assert admission_plan("served", 1) == [1]
    assert admission_plan("ragged", 4) == [1, 1, 1, 1]
    assert admission_plan("aligned", 4) == [4]
    assert admission_plan("1,0,3", 4) == [1, 0, 3]
    assert admission_plan("2,2", 4) == [2, 2]


@pytest.mark.parametrize("bad", ["1,2", "0,4", "1,-1,4", "one,three", "", "1,,3", "bursty"])
def test_a_pattern_that_does_not_admit_the_block_says_what_is_allowed(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        admission_plan(bad, 4)
    message = str(err.value)
    assert repr(bad) in message and "served or ragged or aligned" in message and "1,3" in message


def test_the_command_refuses_a_bad_pattern_before_loading_anything(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-P", "-m", "servegate.paired.solo", "--candidate-tree", str(tmp_path),
                           "--arrivals", "1,2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "adding up to the block's 4 requests" in proc.stderr


def test_one_build_against_its_copy_is_measured_on_the_plan(tmp_path: Path) -> None:
    # In fresh processes, as the calibration runs it: the harness swaps servegate's modules in sys.modules.
    # (The default, served, is what the calibration's own test measures: tests/e2e/test_calibrate_cli.py.)
    arrivals = "1,0,3"
    from servegate.models import ensure_model

    ensure_model("tiny-random")
    tree = copy_package(tmp_path / "copy")
    effect = run_solo(tree, model="tiny-random", requests_per_block=4, input_len=16, output_len=8, rounds=2,
                      processes=2, log_path=tmp_path / "solo.log", arrivals=arrivals)
    assert effect["arrivals"] == arrivals and effect["processes"] == 2 and effect["rounds"] == 4
    assert effect["baseline_build"] == effect["candidate_build"]  # the same source, copied
    assert all(math.isfinite(effect[k]) and effect[k] > 0 for k in ("ratio", "baseline_step_ms", "candidate_step_ms"))
    assert effect["ci_low"] <= effect["ratio"] <= effect["ci_high"]
