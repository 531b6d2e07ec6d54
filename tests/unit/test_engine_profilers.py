"""How each engine is launched with its profiler on, and which routes start and stop it: pure functions
checked against the exact command line and environment (SGLang and vLLM on GPUs cannot run here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servegate.config import WorkerSpec
from servegate.engines import get_engine
from servegate.engines.base import ProfilerRoutes
from servegate.errors import ConfigError


def test_vllm_gets_a_torch_profiler_config_with_an_absolute_trace_dir(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = get_engine("vllm")
    spec = WorkerSpec(engine="vllm", model="/models/m", extra_args=["--enforce-eager"])
    profiled = engine.with_profiler(spec, Path("runs/r/profiles/candidate"))
    cmd = engine.launch_command(profiled, 8000)
    assert cmd[-3:] == ["--enforce-eager", "--profiler-config", json.dumps(
        {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "runs/r/profiles/candidate"),
         "ignore_frontend": True, "torch_profiler_with_stack": False})]
    assert engine.launch_env(profiled) == engine.launch_env(spec)  # by flag, not by environment
    assert engine.profiler_routes == ProfilerRoutes("/start_profile", "/stop_profile")
    assert spec.extra_args == ["--enforce-eager"]  # the configured spec is left as it was
    with pytest.raises(ConfigError, match="already sets --profiler-config"):
        engine.with_profiler(spec.model_copy(update={"extra_args": ["--profiler-config", "{}"]}), tmp_path)


def test_sglang_gets_its_trace_dir_by_environment_and_the_same_command(tmp_path: Path):
    engine = get_engine("sglang")
    spec = WorkerSpec(engine="sglang", model="m", env={"HF_TOKEN_PATH": "/x"})
    profiled = engine.with_profiler(spec, tmp_path / "baseline")
    assert engine.launch_command(profiled, 30000) == engine.launch_command(spec, 30000)
    assert engine.launch_env(profiled) == {**engine.launch_env(spec),
                                           "SGLANG_TORCH_PROFILER_DIR": str(tmp_path / "baseline")}
    assert engine.launch_env(spec)["HF_TOKEN_PATH"] == "/x" and "SGLANG_TORCH_PROFILER_DIR" not in spec.env
    # sglang/srt/entrypoints/http_server.py: /start_profile and /stop_profile.
    assert engine.profiler_routes == ProfilerRoutes("/start_profile", "/stop_profile")


def test_the_embedded_worker_gets_profiler_dir(tmp_path: Path):
    engine = get_engine("embedded")
    spec = WorkerSpec(engine="embedded", model="tiny-random")
    cmd = engine.launch_command(engine.with_profiler(spec, tmp_path / "p"), 30001)
    assert cmd[-2:] == ["--profiler-dir", str(tmp_path / "p")]
    assert engine.profiler_routes == ProfilerRoutes("/start_profile", "/stop_profile")


@pytest.mark.parametrize("name", ["external", "transformers"])
def test_engines_without_a_profiler_say_so(name: str, tmp_path: Path):
    engine = get_engine(name)
    assert engine.profiler_routes is None
    with pytest.raises(ConfigError, match="no profiler endpoints"):
        engine.with_profiler(WorkerSpec(engine=name, model="m", url="http://127.0.0.1:1"), tmp_path)
