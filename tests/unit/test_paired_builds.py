"""The paired stage's check that the two sides run the builds their configs name (issue 37: a candidate
tree on PYTHONPATH once ran the baseline's code, and a real +9 % kernel read x1.002)."""

from __future__ import annotations

import pytest

from servegate.config import WorkerSpec
from servegate.engines import get_engine
from servegate.errors import ConfigError
from servegate.paired.rounds import _check_distinct_builds

BASE = WorkerSpec()
TREE = WorkerSpec(env={"PYTHONPATH": "/tmp/candidate"})
OTHER_PYTHON = WorkerSpec(python="/opt/next/bin/python")


@pytest.mark.parametrize("candidate", [TREE, OTHER_PYTHON])
def test_two_specs_naming_other_code_but_reporting_one_build_are_refused(candidate: WorkerSpec) -> None:
    with pytest.raises(ConfigError, match=r"name different builds .* both workers report the same one: "
                                          r"servegate source abc.*interpreter or PYTHONPATH holds its own code"):
        _check_distinct_builds(BASE, candidate, "servegate source abc", "servegate source abc")


@pytest.mark.parametrize(("candidate", "a", "b"), [
    (TREE, "servegate source abc", "servegate source def"),  # the tree's own code ran
    (BASE, "servegate source abc", "servegate source abc"),  # an A/A: one build on purpose
    (TREE, None, None),  # the engine does not say
])
def test_builds_that_differ_or_an_aa_or_an_engine_that_does_not_say_pass(candidate, a, b) -> None:
    _check_distinct_builds(BASE, candidate, a, b)


def test_only_a_source_digest_counts_as_proof_of_one_build() -> None:
    # A version string is not: a patched vLLM or SGLang build can keep its version.
    assert get_engine("embedded").build_identity_is_digest
    assert not get_engine("vllm").build_identity_is_digest and not get_engine("sglang").build_identity_is_digest


def test_equal_versions_of_an_engine_that_reports_no_digest_are_recorded_not_refused() -> None:
    _check_distinct_builds(WorkerSpec(engine="vllm"), WorkerSpec(engine="vllm", python="/opt/next/bin/python"),
                           "vllm 0.31.0", "vllm 0.31.0")
