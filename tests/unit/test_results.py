"""RunFolder and result records: round-trips, atomic writes, provenance."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from servegate.config import GateConfig
from servegate.errors import ConfigError, StageError
from servegate.provenance import collect_host_info, git_branch, git_revision
from servegate.results import SCHEMA_VERSION, RunFolder, RunManifest, StageRecord

SGLANG_ONE_BATCH_FIELDS = ["batch_size", "input_len", "output_len", "latency", "input_throughput",
                           "output_throughput", "overall_throughput", "last_ttft"]


@pytest.fixture()
def folder(tmp_path: Path) -> RunFolder:
    return RunFolder.create(tmp_path / "runs", "smoke gate")


def test_create_names_folder_and_writes_manifest(folder, tmp_path):
    name = folder.path.name
    assert re.fullmatch(r"\d{8}-\d{6}-smoke-gate-[0-9a-f]{8}", name), name
    assert folder.path.parent == tmp_path / "runs"
    manifest = json.loads((folder.path / "manifest.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["run_id"] == name
    assert manifest["host"]["cpu_count_logical"] >= 1 and manifest["host"]["memory_total_bytes"] > 0
    assert manifest["started_at"].endswith("Z") or "+00:00" in manifest["started_at"]


def test_write_config_snapshot_reloads(folder):
    cfg = GateConfig.model_validate({"name": "smoke", "worker": {"api_key": "s3cret", "env": {"HF_TOKEN": "x",
                                                                                            "OMP_NUM_THREADS": "2"}}})
    folder.write_config(cfg)
    snapshot = json.loads((folder.path / "config.json").read_text())
    assert "validate" in snapshot and "validate_" not in snapshot  # by_alias
    assert snapshot["serving"]["request_rate"] == "inf"  # JSON has no inf
    assert snapshot["worker"]["api_key"] == "<redacted>"
    assert snapshot["worker"]["env"] == {"HF_TOKEN": "<redacted>", "OMP_NUM_THREADS": "2"}
    reloaded = GateConfig.model_validate(snapshot)
    assert math.isinf(reloaded.serving.request_rate) and reloaded.one_batch == cfg.one_batch
    m = RunFolder.open(folder.path).manifest
    assert (m.engine, m.model, m.hardware, m.seeds) == ("embedded", "smollm2-135m", "cpu",
                                                      {"one_batch": 1, "serving": 1})


def test_table_roundtrip_with_list_column(folder):
    df = pd.DataFrame({"request_id": [0, 1, 2], "itls_ms": [[12.5, 13.0], [], [11.0]],
                       "ttft_ms": [100.0, math.nan, 90.0], "success": [True, False, True],
                       "error": [None, "timeout", None]})
    paths = folder.write_table("serving_requests", df)
    assert [p.name for p in paths] == ["serving_requests.parquet", "serving_requests.csv"]
    back = folder.read_table("serving_requests")
    assert back["itls_ms"].tolist() == [[12.5, 13.0], [], [11.0]]
    assert back["success"].tolist() == [True, False, True]
    assert back["request_id"].tolist() == [0, 1, 2] and math.isnan(back["ttft_ms"][1])
    csv = pd.read_csv(folder.path / "serving_requests.csv")
    assert [json.loads(x) for x in csv["itls_ms"]] == [[12.5, 13.0], [], [11.0]]


def test_atomic_write_leaves_no_temp_file_on_success_or_failure(folder):
    folder.write_table("one_batch", pd.DataFrame({"batch_size": [1]}))
    folder.write_json("server_info", {"a": 1})
    before = sorted(os.listdir(folder.path))
    assert not [n for n in before if n.endswith(".tmp")]
    # a column pyarrow cannot store: the write fails, the old file stays, no temp file is left
    bad = pd.DataFrame({"batch_size": [1, "x"], "obj": [object(), object()]})
    with pytest.raises(StageError, match="one_batch"):
        folder.write_table("one_batch", bad)
    assert sorted(os.listdir(folder.path)) == before
    assert folder.read_table("one_batch")["batch_size"].tolist() == [1]


def test_jsonl_keeps_sglang_field_names(folder):
    records = [{"run_name": "default", "batch_size": 1, "input_len": 64, "output_len": 16, "latency": 1.2,
                "input_throughput": 512.0, "output_throughput": 20.0, "overall_throughput": 60.0,
                "last_ttft": 0.12},
               {"run_name": "default", "batch_size": 8, "input_len": 64, "output_len": 16, "latency": math.nan,
                "input_throughput": None, "output_throughput": None, "overall_throughput": None,
                "last_ttft": None}]
    path = folder.write_jsonl("one_batch", records)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert set(SGLANG_ONE_BATCH_FIELDS) <= set(first) and first["latency"] == 1.2
    assert json.loads(lines[1])["latency"] is None  # NaN is not JSON
    assert folder.read_jsonl("one_batch") == [json.loads(x) for x in lines]


def test_jsonl_from_dataframe_records(folder):
    df = pd.DataFrame({"batch_size": pd.array([1, None], dtype="Int64"), "latency": [0.5, math.nan]})
    folder.write_jsonl("one_batch", df.to_dict(orient="records"))
    assert folder.read_jsonl("one_batch") == [{"batch_size": 1, "latency": 0.5},
                                              {"batch_size": None, "latency": None}]


def test_documents_follow_the_one_json_policy(folder):
    # NaN as null (a document never fails on a missing measurement), numpy and datetimes converted.
    folder.write_json("server_info", {"ratio": math.nan, "n": pd.Series([3]).iloc[0],
                                      "at": pd.Timestamp("2026-11-30T08:00:00Z")})
    assert folder.read_json("server_info") == {"ratio": None, "n": 3, "at": "2026-11-30T08:00:00+00:00"}
    stage = StageRecord(stage="serving", status="ok", duration_s=1.0)
    folder.write_json("stage", stage)
    assert StageRecord.model_validate(folder.read_json("stage")) == stage


def test_stage_records_are_persisted_immediately(folder):
    folder.record_stage(StageRecord(stage="one_batch", status="ok", duration_s=1.5,
                                    tables=["one_batch.parquet", "one_batch.csv"]))
    folder.record_stage(StageRecord(stage="serving", status="failed", error="WorkerDiedError: exit -9"))
    on_disk = RunManifest.model_validate_json((folder.path / "manifest.json").read_text())
    assert [(s.stage, s.status) for s in on_disk.stages] == [("one_batch", "ok"), ("serving", "failed")]
    # a re-run replaces that stage's record
    folder.record_stage(StageRecord(stage="serving", status="ok", duration_s=3.0))
    folder.finish()
    reopened = RunFolder.open(folder.path)
    assert [(s.stage, s.status) for s in reopened.manifest.stages] == [("one_batch", "ok"), ("serving", "ok")]
    assert reopened.manifest.finished_at is not None


def test_records_forbid_unknown_fields():
    with pytest.raises(ValueError):
        StageRecord(stage="x", status="ok", typo=1)
    with pytest.raises(ValueError):
        StageRecord(stage="x", status="maybe")


def test_bad_names_and_missing_table(folder, tmp_path):
    with pytest.raises(ConfigError, match="no path separators"):
        folder.write_json("../escape", {})
    with pytest.raises(StageError, match="not produced"):
        folder.read_table("occupancy_summary")
    with pytest.raises(ConfigError, match="not a run folder"):
        RunFolder.open(tmp_path)


def test_git_revision_inside_and_outside_a_repo(tmp_path):
    assert git_revision(tmp_path) == (None, None) and git_branch(tmp_path) is None
    subprocess.run(["git", "init", "-q", "-b", "nightly", str(tmp_path)], check=True, timeout=30)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    (tmp_path / "f").write_text("1")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f"], check=True, timeout=30)
    subprocess.run(["git", "-C", str(tmp_path), "commit", "-qm", "x"], check=True, timeout=30, env=env)
    rev, dirty = git_revision(tmp_path)
    assert rev is not None and len(rev) == 40 and dirty is False
    assert git_branch(tmp_path) == "nightly"
    (tmp_path / "f").write_text("2")
    assert git_revision(tmp_path)[1] is True


def test_host_info():
    host = collect_host_info()
    assert host.hostname and host.python.count(".") == 2 and isinstance(host.gpus, list)
