"""Planning a re-run attempt against real run folders and a real SQLite history (no worker).

The end-to-end path (a real worker crashing in serving, then ``servegate rerun``) is in
``tests/e2e/test_rerun_cli.py``; here every refusal and the bookkeeping of an attempt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from servegate.config import load_config
from servegate.errors import ConfigError, WorkerDiedError
from servegate.runstate import DEVICE_SLOT_ENV, GateRun, hold_device_slot
from servegate.rerun import open_attempt, plan_rerun, resolve_run_dir
from servegate.history import Store

pytestmark = pytest.mark.timeout(120)

STAGES = ("one_batch", "serving", "occupancy")
ONE_BATCH = pd.DataFrame({"batch_size": [1], "status": ["measured"], "latency": [0.5]})
REQUESTS = pd.DataFrame({"request_id": [0, 1], "success": [True, False], "itls_ms": [[1.0, 2.0], []]})


def _config(tmp_path: Path, *overrides: str):
    return load_config(profile="smoke", overrides=[f"output_dir={tmp_path / 'runs'}",
                                                   f"store.url={tmp_path / 'history.db'}", *overrides])


def _crashed_run(tmp_path: Path, *overrides: str, occupancy: str = "blocked") -> GateRun:
    """A recorded run like a worker crash in serving leaves: one_batch ok, serving failed."""
    run = GateRun.open(_config(tmp_path, *overrides))
    with run.stage("one_batch") as measured:
        measured.tables["one_batch"] = ONE_BATCH
    with run.stage("serving") as crashed:
        crashed.tables["serving_requests"] = REQUESTS
        raise WorkerDiedError("the worker exited (code 1) during serving")
    assert crashed.status == "failed" and (run.path / "serving_requests.partial.parquet").is_file()
    if occupancy == "blocked":
        run.skipped("occupancy", "skipped", "the worker exited (code 1)")
    else:
        run.skipped("occupancy", "skipped", "disabled in config")
    with Store(run.config.store.url) as store:
        store.record_run(run.folder.manifest, run.config_snapshot(), measured.tables, [],
                         {"status": "inconclusive", "infra_errors": [f"serving: {crashed.error}"]}, run_dir=run.path)
    return run


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_unknown_or_disabled_stage_is_refused_with_the_choices(tmp_path: Path):
    run = _crashed_run(tmp_path, "occupancy.enabled=false", occupancy="disabled")
    with pytest.raises(ConfigError, match=r"one of \['one_batch', 'serving', 'occupancy'\]"):
        plan_rerun(run.path, ["servin"], rerunnable=STAGES)
    with pytest.raises(ConfigError, match="name the stage"):
        plan_rerun(run.path, [], rerunnable=STAGES)


def test_a_stage_blocked_by_the_crash_must_be_rerun_too(tmp_path: Path):
    run = _crashed_run(tmp_path)
    with pytest.raises(ConfigError) as err:
        plan_rerun(run.path, ["serving"], rerunnable=STAGES)
    assert "occupancy (skipped: the worker exited" in str(err.value)
    assert "--task serving --task occupancy" in str(err.value)
    plan = plan_rerun(run.path, ["occupancy", "serving"], rerunnable=STAGES)
    assert plan.stages == ["serving", "occupancy"]  # gate order, whatever the command-line order
    assert list(plan.carried) == ["one_batch"]


def test_overrides_cannot_change_the_gate_key_or_a_carried_stage(tmp_path: Path):
    run = _crashed_run(tmp_path, "occupancy.enabled=false", occupancy="disabled")
    for item, why in (("worker.model=tiny-random", "part of the gate key"), ("name=other", "part of the gate key"),
                      ("one_batch.batch_sizes=[2]", "carried from the original run")):
        with pytest.raises(ConfigError, match=why):
            plan_rerun(run.path, ["serving"], [item], rerunnable=STAGES)
    plan = plan_rerun(run.path, ["serving"], ["worker.extra_args=[]", "serving.num_prompts=3"], rerunnable=STAGES)
    assert plan.config.worker.extra_args == [] and plan.config.serving.num_prompts == 3
    assert set(plan.carried) == {"one_batch", "occupancy"} and plan.carried["occupancy"].status == "skipped"


def test_secrets_are_not_in_the_folder_and_must_be_given_back(tmp_path: Path):
    run = _crashed_run(tmp_path, "occupancy.enabled=false", "worker.api_key=s3cret", occupancy="disabled")
    assert "s3cret" not in (run.path / "config.json").read_text()
    with pytest.raises(ConfigError, match="--set worker.api_key=KEY"):
        plan_rerun(run.path, ["serving"], rerunnable=STAGES)
    plan = plan_rerun(run.path, ["serving"], ["worker.api_key=s3cret"], rerunnable=STAGES)
    assert plan.config.worker.api_key_value() == "s3cret"


def test_run_is_found_by_folder_or_recorded_id(tmp_path: Path):
    run = _crashed_run(tmp_path, "occupancy.enabled=false", occupancy="disabled")
    db = str(tmp_path / "history.db")
    assert resolve_run_dir(str(run.path), db) == run.path
    assert resolve_run_dir(run.folder.manifest.run_id, db) == run.path
    with pytest.raises(ConfigError, match="servegate status"):
        resolve_run_dir("20990101-000000-nope-00000000.attempt-2", db)
    with pytest.raises(ConfigError, match="is not a folder"):
        resolve_run_dir(str(tmp_path / "no" / "such-run"), db)


def test_unrecorded_run_cannot_get_an_attempt_unless_the_store_is_off(tmp_path: Path):
    run = _crashed_run(tmp_path, "occupancy.enabled=false", occupancy="disabled")
    other_db = tmp_path / "other.db"
    with pytest.raises(ConfigError, match="not in the history database"):
        plan_rerun(run.path, ["serving"], [f"store.url={other_db}"], rerunnable=STAGES)
    plan = plan_rerun(run.path, ["serving"], ["store.enabled=false"], rerunnable=STAGES)
    assert plan.attempt_of == run.folder.manifest.run_id


def test_attempt_gets_its_own_folder_and_the_original_never_changes(tmp_path: Path):
    from servegate.tasks.rerun import carry

    run = _crashed_run(tmp_path, "occupancy.enabled=false", occupancy="disabled")
    before = _snapshot(run.path)
    plan = plan_rerun(run.path, ["serving"], ["worker.extra_args=[]"], rerunnable=STAGES)
    attempt = open_attempt(plan)
    try:
        carried = [carry.fn(attempt, str(plan.source.path), record) for record in plan.carried.values()]
    finally:
        attempt.close()
    tables = {name: df for r in carried if r.ok for name, df in r.tables.items()}
    assert attempt.path.parent == run.path / "attempts"
    assert attempt.attempt_of == run.folder.manifest.run_id
    pd.testing.assert_frame_equal(tables["one_batch"], ONE_BATCH)
    pd.testing.assert_frame_equal(attempt.folder.read_table("one_batch"), ONE_BATCH)
    stages = json.loads((attempt.path / "stages.json").read_text())
    assert stages["one_batch"]["status"] == "ok" and stages["occupancy"]["status"] == "skipped"
    assert "serving" not in stages  # only measured by the attempt's own flow
    doc = json.loads((attempt.path / "rerun.json").read_text())
    assert doc["rerun_stages"] == ["serving"] and doc["root_dir"] == str(run.path)
    assert _snapshot(run.path) == before

    # An attempt of the attempt still files under the original's attempts/ folder.
    with Store(str(tmp_path / "history.db")) as store:
        recorded = store.record_run(attempt.folder.manifest, attempt.config_snapshot(), tables, [],
                                    {"status": "inconclusive"}, attempt_of=attempt.attempt_of, run_dir=attempt.path)
    again = plan_rerun(attempt.path, ["serving"], rerunnable=STAGES)
    assert again.root_dir == run.path and again.attempt_of == run.folder.manifest.run_id
    assert recorded != again.attempt_of


def test_device_slot_is_off_when_unset_and_missing_limit_is_an_error(monkeypatch, prefect_server):
    monkeypatch.delenv(DEVICE_SLOT_ENV, raising=False)
    with hold_device_slot() as held:  # no server call at all
        assert held is not None
    monkeypatch.setenv(DEVICE_SLOT_ENV, "gpu-test-0")
    with pytest.raises(ConfigError, match="prefect gcl create device-gpu-test-0 --limit 1"):
        hold_device_slot()


def test_a_run_without_a_baseline_carries_its_skipped_paired_stage(tmp_path: Path):
    from servegate.stages import RERUNNABLE

    run = _crashed_run(tmp_path, "occupancy.enabled=false", occupancy="disabled")
    run.skipped("paired", "skipped", "no baseline worker configured (set [baseline] to measure the worker against it)")
    plan = plan_rerun(run.path, ["serving"], rerunnable=RERUNNABLE)
    assert plan.stages == ["serving"] and sorted(plan.carried) == ["occupancy", "one_batch", "paired"]
    with pytest.raises(ConfigError, match=r"\['paired'\] needs a baseline worker"):
        plan_rerun(run.path, ["paired"], rerunnable=RERUNNABLE)
