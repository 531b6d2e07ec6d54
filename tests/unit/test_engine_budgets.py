"""Engines own their facts: each engine's typed memory budget, its OOM knobs, launch vs attach.

The budget models live in config.py (the config validates them at load time); each engine class
names the one it launches with (``Engine.budget_model``). These tests tie the two together and
check that a field of another engine is an error that lists the engine's own fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest

from servegate.budgets import (BUDGET_MODELS, MEMORY_PROFILES, EmbeddedBudget, ExternalBudget, MemoryBudget,
                               SGLangBudget, VLLMBudget)
from servegate.config import EngineName, GateConfig, WorkerSpec, load_config
from servegate.engines import ENGINES, EmbeddedEngine, SGLangEngine, VLLMEngine, get_engine
from servegate.errors import ConfigError


def test_every_engine_names_its_budget_model() -> None:
    assert set(get_args(EngineName)) == set(ENGINES) == set(BUDGET_MODELS)
    for name, cls in ENGINES.items():
        assert cls.budget_model is BUDGET_MODELS[name]
        assert cls.budget_model().engine == name
        assert issubclass(cls.budget_model, MemoryBudget)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_spec_budget_is_the_engines_own_model(name: str) -> None:
    spec = WorkerSpec(engine=name, url="http://127.0.0.1:9")
    assert type(spec.budget()) is ENGINES[name].budget_model
    assert type(get_engine(name).budget(spec)) is ENGINES[name].budget_model


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_an_engine_that_attaches_needs_a_url_and_one_that_launches_does_not(name: str) -> None:
    """The url check lives in WorkerSpec (once); it must agree with the engine's ``launches``."""
    if ENGINES[name].launches:
        WorkerSpec(engine=name)
    else:
        with pytest.raises(ValueError, match="needs url"):
            WorkerSpec(engine=name)
        assert WorkerSpec(engine=name, url="http://127.0.0.1:9").url == "http://127.0.0.1:9"


def test_oom_knobs_are_the_budgets_sizes() -> None:
    """What launch tells the user to lower after a SIGKILL at start-up (a switch is not a size)."""
    assert SGLangEngine.oom_knobs() == ["mem_fraction_static", "max_total_tokens", "max_running_requests",
                                        "cuda_graph_max_bs"]
    assert VLLMEngine.oom_knobs() == ["gpu_memory_utilization", "max_model_len", "max_num_seqs",
                                      "cpu_kvcache_space_gib"]
    assert EmbeddedEngine.oom_knobs() == ["max_total_tokens", "max_running_requests"]
    assert get_engine("external").oom_knobs() == []


# The budgets `servegate run --profile X` launched with before budgets were per engine (the union
# model, each engine reading its own fields): the per-engine profiles must give the same.
BEFORE = {
    ("ci-gpu", "sglang"): {"mem_fraction_static": 0.6, "disable_prefill_cuda_graph": True, "cuda_graph_max_bs": 32},
    ("ci-gpu", "vllm"): {"gpu_memory_utilization": 0.6, "max_num_seqs": 64, "max_model_len": 4096},
    ("h100", "sglang"): {"mem_fraction_static": 0.85, "cuda_graph_max_bs": 256},
    ("h100", "vllm"): {"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_model_len": 8192},
    ("cpu-small", "sglang"): {"max_total_tokens": 16384, "max_running_requests": 16},
    ("cpu-small", "embedded"): {"max_total_tokens": 16384, "max_running_requests": 16},
    ("cpu-large", "sglang"): {"max_total_tokens": 65536, "max_running_requests": 32},
    ("cpu-large", "embedded"): {"max_total_tokens": 65536, "max_running_requests": 32},
    ("vllm-cpu", "vllm"): {"cpu_kvcache_space_gib": 2, "max_model_len": 2048, "max_num_seqs": 16},
}


@pytest.mark.parametrize("profile", sorted(MEMORY_PROFILES))
@pytest.mark.parametrize("engine", ["sglang", "vllm", "embedded"])
def test_named_profiles_give_each_engine_the_same_budget_as_before(profile: str, engine: str) -> None:
    budget = WorkerSpec(engine=engine, memory_profile=profile).budget()
    settings = {k: v for k, v in budget.settings().items() if v is not False}  # False: the switch is off
    assert settings == BEFORE.get((profile, engine), {})


def test_shipped_gate_profiles_keep_their_budgets() -> None:
    budgets = {name: load_config(profile=name).worker.budget() for name in ("smoke", "cpu-nightly", "vllm-cpu",
                                                                            "sglang-h100", "vllm-h100")}
    assert budgets["smoke"] == EmbeddedBudget(max_total_tokens=16384, max_running_requests=16)
    assert budgets["cpu-nightly"] == EmbeddedBudget(max_total_tokens=65536, max_running_requests=32)
    assert budgets["vllm-cpu"] == VLLMBudget(cpu_kvcache_space_gib=2, max_model_len=2048, max_num_seqs=16)
    assert budgets["sglang-h100"] == SGLangBudget(mem_fraction_static=0.85, cuda_graph_max_bs=256)
    assert budgets["vllm-h100"] == VLLMBudget(gpu_memory_utilization=0.9, max_model_len=8192, max_num_seqs=256)


def test_a_field_of_another_engine_lists_the_engines_own_fields() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(profile="vllm-cpu", overrides=["worker.memory.mem_fraction_static=0.5"])
    text = str(err.value)
    assert "worker.memory" in text and "engine 'vllm' has no memory budget field 'mem_fraction_static'" in text
    assert str(VLLMBudget.field_names()) in text
    assert VLLMBudget.field_names() == ["gpu_memory_utilization", "max_model_len", "max_num_seqs",
                                        "cpu_kvcache_space_gib"]
    with pytest.raises(ConfigError, match=r"has no memory budget field 'max_total_token'.*max_total_tokens"):
        load_config(profile="smoke", overrides=["worker.memory.max_total_token=1"])  # a typo


def test_external_has_no_budget_fields() -> None:
    assert ExternalBudget.field_names() == []
    with pytest.raises(ValueError, match="launches nothing.*remove worker.memory"):
        WorkerSpec(engine="external", url="http://127.0.0.1:9", memory={"max_total_tokens": 1})


def test_memory_from_toml_lays_fields_over_the_profile(tmp_path: Path) -> None:
    path = tmp_path / "gate.toml"
    path.write_text('[worker]\nengine = "sglang"\nmemory_profile = "ci-gpu"\n'
                    '[worker.memory]\nmax_total_tokens = 20480\nmem_fraction_static = 0.5\n')
    budget = load_config(path=path).worker.budget()
    assert budget == SGLangBudget(mem_fraction_static=0.5, disable_prefill_cuda_graph=True, max_total_tokens=20480,
                                  cuda_graph_max_bs=32)


def test_a_budget_for_another_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="budget for engine 'sglang', but worker.engine is 'vllm'"):
        WorkerSpec(engine="vllm", memory=SGLangBudget(max_total_tokens=1))
    with pytest.raises(ValueError, match="budget for engine 'sglang', but worker.engine is 'vllm'"):
        WorkerSpec(engine="vllm", memory={"engine": "sglang"})
    spec = WorkerSpec(engine="sglang", memory={"max_total_tokens": 1})
    with pytest.raises(ValueError, match=r"worker.engine is 'vllm'; give vllm's fields: \['gpu_memory_utilization'"):
        spec.engine = "vllm"  # validate_assignment: the budget no longer fits the engine
    with pytest.raises(ConfigError, match="set worker.engine = 'vllm'"):
        VLLMEngine().budget(WorkerSpec(engine="sglang"))


def test_snapshot_reload_keeps_the_profile_under_the_given_fields() -> None:
    """config.json holds only the memory fields given, so a rerun lays the same fields over the profile
    (not None over every field the profile sets)."""
    cfg = GateConfig.model_validate({"worker": {"engine": "sglang", "memory_profile": "ci-gpu",
                                                "memory": {"max_total_tokens": 20480}}})
    snapshot = json.loads(json.dumps(cfg.model_dump(mode="json", by_alias=True)))
    assert snapshot["worker"]["memory"] == {"engine": "sglang", "max_total_tokens": 20480}
    for data in (snapshot, cfg.model_dump(by_alias=True)):
        assert GateConfig.model_validate(data).worker.budget() == cfg.worker.budget()
    assert cfg.worker.budget().mem_fraction_static == 0.6


def test_a_snapshot_from_before_per_engine_budgets_still_loads() -> None:
    """Old config.json files hold every engine's field, unset (None, False) where it did not apply."""
    old = {"mem_fraction_static": None, "disable_prefill_cuda_graph": False, "cuda_graph_max_bs": None,
           "max_total_tokens": 999, "max_running_requests": None, "gpu_memory_utilization": None,
           "max_model_len": None, "max_num_seqs": None, "cpu_kvcache_space_gib": None}
    budget = WorkerSpec(engine="embedded", memory=old).budget()
    assert budget == EmbeddedBudget(max_total_tokens=999, max_running_requests=None)
    with pytest.raises(ValueError, match="engine 'embedded' has no memory budget field 'max_num_seqs'"):
        WorkerSpec(engine="embedded", memory={**old, "max_num_seqs": 8})  # set: a real mistake


def test_named_profiles_are_not_changed_by_a_spec() -> None:
    budget = WorkerSpec(memory_profile="cpu-small").budget()
    budget.max_total_tokens = 1
    assert WorkerSpec(memory_profile="cpu-small").budget().max_total_tokens == 16384
    with pytest.raises(ValueError):
        MEMORY_PROFILES["cpu-small"].budgets = {}  # frozen: one constant set per hardware profile


@pytest.mark.parametrize("engine,capacity", [("embedded", 16384), ("sglang", 16384), ("vllm", None), ("external", None)])
def test_token_capacity_where_the_budget_sets_one(engine: str, capacity: int | None) -> None:
    """Offline one-batch sizes its in-process runner from it; an engine without one sizes itself."""
    assert WorkerSpec(engine=engine, url="http://127.0.0.1:9", memory_profile="cpu-small").budget().token_capacity \
        == capacity
