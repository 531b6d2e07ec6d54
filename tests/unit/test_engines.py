"""Engine launch commands, env, and server-info parsing.

GPU engines cannot run here, so their exact argument lists and env are asserted instead.
"""

from __future__ import annotations

import math
import sys

import pytest

from servegate.budgets import MEMORY_PROFILES, SGLangBudget
from servegate.config import REDACTED, WorkerSpec
from servegate.engines import (EmbeddedEngine, ExternalEngine, SGLangEngine, TransformersServeEngine, VLLMEngine,
                               get_engine)
from servegate.engines.sglang import parse_server_info
from servegate.errors import ConfigError

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SGLANG_BASE = ["python3", "-m", "sglang.launch_server", "--model-path", MODEL, "--host", "127.0.0.1",
               "--port", "30000"]

SGLANG_BUDGET_ARGS = {
    "ci-gpu": ["--mem-fraction-static", "0.6", "--cuda-graph-backend-prefill", "disabled",
               "--cuda-graph-max-bs", "32"],
    "h100": ["--mem-fraction-static", "0.85", "--cuda-graph-max-bs", "256"],
    "cpu-small": ["--max-total-tokens", "16384", "--max-running-requests", "16"],
    "cpu-large": ["--max-total-tokens", "65536", "--max-running-requests", "32"],
    "vllm-cpu": [],
}
EMBEDDED_BUDGET_ARGS = {
    "ci-gpu": [],
    "h100": [],
    "cpu-small": ["--max-total-tokens", "16384", "--max-running-requests", "16"],
    "cpu-large": ["--max-total-tokens", "65536", "--max-running-requests", "32"],
    "vllm-cpu": [],
}
VLLM_BUDGET_ARGS = {
    "ci-gpu": ["--gpu-memory-utilization", "0.6", "--max-model-len", "4096", "--max-num-seqs", "64"],
    "h100": ["--gpu-memory-utilization", "0.9", "--max-model-len", "8192", "--max-num-seqs", "256"],
    "cpu-small": [],
    "cpu-large": [],
    "vllm-cpu": ["--max-model-len", "2048", "--max-num-seqs", "16"],
}


def test_every_profile_has_an_expected_command() -> None:
    assert set(SGLANG_BUDGET_ARGS) == set(MEMORY_PROFILES) == set(VLLM_BUDGET_ARGS) == set(EMBEDDED_BUDGET_ARGS)


@pytest.mark.parametrize("name,cls", [("embedded", EmbeddedEngine), ("sglang", SGLangEngine),
                                      ("vllm", VLLMEngine), ("external", ExternalEngine)])
def test_get_engine(name: str, cls: type) -> None:
    engine = get_engine(name)
    assert isinstance(engine, cls) and engine.name == name


def test_unknown_engine_lists_choices() -> None:
    with pytest.raises(ConfigError,
                       match=r"unknown engine 'tgi'.*\['embedded', 'external', 'sglang', 'transformers', 'vllm'\]"):
        get_engine("tgi")


@pytest.mark.parametrize("profile", sorted(MEMORY_PROFILES))
def test_sglang_command_per_profile(profile: str) -> None:
    spec = WorkerSpec(engine="sglang", model=MODEL, port=30000, memory_profile=profile)
    cmd = SGLangEngine().launch_command(spec, 30000)
    assert cmd == [*SGLANG_BASE, *SGLANG_BUDGET_ARGS[profile], "--enable-metrics"]
    assert SGLangEngine().launch_env(spec) == {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}


def test_sglang_command_with_every_option() -> None:
    spec = WorkerSpec(engine="sglang", model=MODEL, memory_profile="ci-gpu", python="/venvs/sgl/bin/python",
                      memory=SGLangBudget(max_total_tokens=20480, max_running_requests=8),
                      speculative_num_draft_tokens=4, api_key="k", extra_args=["--tp", "2"],
                      env={"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "0", "X": "1"})
    assert SGLangEngine().launch_command(spec, 31000) == [
        "/venvs/sgl/bin/python", "-m", "sglang.launch_server", "--model-path", MODEL, "--host", "127.0.0.1",
        "--port", "31000", "--mem-fraction-static", "0.6", "--cuda-graph-backend-prefill", "disabled",
        "--max-total-tokens", "20480", "--max-running-requests", "8", "--cuda-graph-max-bs", "32",
        "--enable-metrics", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
        "--api-key", "k", "--tp", "2"]
    # the user's env wins over the engine's
    assert SGLangEngine().launch_env(spec) == {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "0", "X": "1"}


def test_sglang_without_metrics() -> None:
    spec = WorkerSpec(engine="sglang", model=MODEL, memory_profile="h100", enable_metrics=False)
    assert "--enable-metrics" not in SGLangEngine().launch_command(spec, 30000)
    assert SGLangEngine().launch_env(spec) == {}


@pytest.mark.parametrize("profile", sorted(MEMORY_PROFILES))
def test_vllm_command_per_profile(profile: str) -> None:
    spec = WorkerSpec(engine="vllm", model=MODEL, memory_profile=profile)
    assert VLLMEngine().launch_command(spec, 8000) == [
        "vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", "8000", *VLLM_BUDGET_ARGS[profile]]
    env = VLLMEngine().launch_env(spec)
    # VLLM_API_KEY "" when no key is set: one inherited from the gate's environment is not used.
    expected_env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": ""}
    if profile == "vllm-cpu":
        expected_env["VLLM_CPU_KVCACHE_SPACE"] = "2"
    assert env == expected_env


def test_vllm_command_with_python_and_options() -> None:
    spec = WorkerSpec(engine="vllm", model=MODEL, memory_profile="ci-gpu", python="/venvs/vllm/bin/python",
                      speculative_num_draft_tokens=3, api_key="k", extra_args=["--enforce-eager"])
    # The key goes by environment ($VLLM_API_KEY), never on the command line (visible in `ps`).
    assert VLLMEngine().launch_command(spec, 8000) == [
        "/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL,
        "--host", "127.0.0.1", "--port", "8000", "--gpu-memory-utilization", "0.6", "--max-model-len", "4096",
        "--max-num-seqs", "64", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--enforce-eager"]
    assert VLLMEngine().launch_env(spec) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "k"}


@pytest.mark.parametrize("profile", sorted(MEMORY_PROFILES))
def test_embedded_command_per_profile(profile: str) -> None:
    spec = WorkerSpec(engine="embedded", model="tiny-random", memory_profile=profile, enable_metrics=False)
    assert EmbeddedEngine().launch_command(spec, 30001) == [
        sys.executable, "-P", "-m", "servegate", "worker", "--model", "tiny-random", "--host", "127.0.0.1",
        "--port", "30001", *EMBEDDED_BUDGET_ARGS[profile]]


def test_embedded_command() -> None:
    spec = WorkerSpec(engine="embedded", model="tiny-random", memory_profile="cpu-small",
                      speculative_num_draft_tokens=4, api_key="secret", extra_args=["--dtype", "float32"])
    assert EmbeddedEngine().launch_command(spec, 30001) == [
        sys.executable, "-P", "-m", "servegate", "worker", "--model", "tiny-random", "--host", "127.0.0.1",
        "--port", "30001", "--max-total-tokens", "16384", "--max-running-requests", "16", "--enable-metrics",
        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4", "--dtype", "float32"]
    assert EmbeddedEngine().launch_env(spec) == {"SERVEGATE_API_KEY": "secret"}
    assert EmbeddedEngine().launch_env(WorkerSpec(engine="embedded")) == {"SERVEGATE_API_KEY": ""}


@pytest.mark.parametrize("engine", [EmbeddedEngine(), VLLMEngine()])
def test_api_key_env_reaches_the_engine_by_environment_only(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATE_KEY", "from-env")
    spec = WorkerSpec(engine=engine.name, model=MODEL, memory_profile="ci-gpu", api_key_env="GATE_KEY")
    assert "from-env" not in engine.launch_command(spec, 8000)
    assert engine.launch_env(spec)[engine.api_key_env_var] == "from-env"
    monkeypatch.delenv("GATE_KEY")
    with pytest.raises(ConfigError, match=r"\$GATE_KEY, which is not set"):
        engine.launch_env(spec)  # resolved at launch: a missing variable stops the launch


def test_sglang_takes_the_key_only_as_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang reads no environment variable for its key (ServerArgs.api_key is a flag only)."""
    monkeypatch.setenv("GATE_KEY", "from-env")
    spec = WorkerSpec(engine="sglang", model=MODEL, memory_profile="h100", api_key_env="GATE_KEY")
    assert SGLangEngine().launch_command(spec, 30000)[-2:] == ["--api-key", "from-env"]
    assert SGLangEngine.api_key_env_var is None
    assert SGLangEngine().launch_env(spec) == {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}


@pytest.mark.parametrize("engine", [EmbeddedEngine(), SGLangEngine(), VLLMEngine()])
def test_a_snapshot_placeholder_is_never_launched(engine) -> None:
    """A config reloaded from config.json holds "<redacted>" where its secrets were."""
    spec = WorkerSpec(engine=engine.name, model=MODEL, api_key=REDACTED)
    with pytest.raises(ConfigError, match="--set worker.api_key=KEY"):
        engine.launch_command(spec, 1)  # the flag (SGLang) ...
        engine.launch_env(spec)  # ... or the environment (vLLM, embedded)
    spec = WorkerSpec(engine=engine.name, model=MODEL, env={"HF_TOKEN": REDACTED, "A": "1"})
    with pytest.raises(ConfigError, match="--set worker.env.HF_TOKEN=VALUE"):
        engine.launch_env(spec)


def test_external_launches_nothing() -> None:
    spec = WorkerSpec(engine="external", url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="attaches to worker.url"):
        ExternalEngine().launch_command(spec, 1)


def test_engine_protocols_and_metric_names() -> None:
    assert (SGLangEngine.protocol, EmbeddedEngine.protocol) == ("native", "native")
    assert (VLLMEngine.protocol, ExternalEngine.protocol) == ("openai", "openai")
    assert SGLangEngine.readiness_path == EmbeddedEngine.readiness_path == "/health_generate"
    assert VLLMEngine.readiness_path == "/health"
    assert SGLangEngine.metric_names["fwd_occupancy"] == "sglang:fwd_occupancy"
    assert "fwd_occupancy" not in VLLMEngine.metric_names
    assert VLLMEngine.metric_names["kv_cache_usage"] == "vllm:kv_cache_usage_perc"
    assert VLLMEngine.metric_names["num_running_reqs"] == "vllm:num_requests_running"
    assert VLLMEngine.metric_names["num_queue_reqs"] == "vllm:num_requests_waiting"
    assert "SGLANG_ENABLE_METRICS_DEVICE_TIMER=1" in SGLangEngine.metrics_hint


CAPABILITIES = ("launches", "can_flush", "has_metrics", "has_occupancy_gauge", "reports_capacity", "has_logprobs",
                "takes_prompt_batches")


@pytest.mark.parametrize("cls,expected", [
    (SGLangEngine, (True, True, True, True, True, True, True)),
    (EmbeddedEngine, (True, True, True, True, True, True, True)),
    # vLLM: no fwd_occupancy gauge, no token capacity over HTTP.
    (VLLMEngine, (True, True, True, False, False, True, True)),
    # external: attaches; flush, server info best effort; metric names unknown; echo logprobs not guaranteed;
    # a list of prompts assumed (as vLLM and SGLang take it; a refusal is a failed one-batch row).
    (ExternalEngine, (False, False, False, False, False, False, True)),
    # transformers serve: none of it (tests/unit/test_engine_transformers.py).
    (TransformersServeEngine, (True, False, False, False, False, False, False)),
])
def test_engine_capabilities(cls: type, expected: tuple[bool, ...]) -> None:
    assert tuple(getattr(cls, name) for name in CAPABILITIES) == expected
    assert cls.has_metrics == bool(cls.metric_names)
    assert cls.has_occupancy_gauge == ("fwd_occupancy" in cls.metric_names)


def _state(token_capacity: int | None, per_dp: int | None = 128) -> dict:
    state: dict = {"last_gen_throughput": 100.0}
    if token_capacity is not None:
        state["memory_usage"] = {"weight": 1.0, "kvcache": 0.23, "token_capacity": token_capacity, "graph": 0}
    if per_dp is not None:
        state["effective_max_running_requests_per_dp"] = per_dp
    return state


def test_server_info_single_rank_as_sglang_reports_it() -> None:
    cap = parse_server_info({"max_total_num_tokens": 99999, "max_running_requests": None, "dp_size": 1,
                             "internal_states": [_state(20480)], "version": "0.5.0"})
    assert (cap.token_capacity, cap.max_running_requests) == (20480, 128)
    assert cap.raw["version"] == "0.5.0"


def test_server_info_sums_token_capacity_over_dp_ranks() -> None:
    cap = parse_server_info({"dp_size": 2, "internal_states": [_state(20000, 64), _state(21000, 64)]})
    assert cap.token_capacity == 41000
    assert cap.max_running_requests == 128  # 64 per DP rank * dp_size 2


def test_server_info_fallbacks() -> None:
    cap = parse_server_info({"max_total_num_tokens": 5000, "max_running_requests": 48,
                             "internal_states": [_state(None, None)]})
    assert (cap.token_capacity, cap.max_running_requests) == (5000, 48)
    # one rank without memory_usage: the sum would be wrong, so fall back
    cap = parse_server_info({"max_total_num_tokens": 7000, "internal_states": [_state(3000), _state(None)]})
    assert cap.token_capacity == 7000


def test_server_info_without_capacity_is_inf() -> None:
    cap = parse_server_info({"version": "x"})
    assert math.isinf(cap.token_capacity) and math.isinf(cap.max_running_requests)
    cap = parse_server_info({"max_running_requests": None, "internal_states": "garbage"})
    assert math.isinf(cap.token_capacity) and math.isinf(cap.max_running_requests)


# ---- speculative decoding: the flags each engine's speculative mode takes (docs/speculation.md) ----
EAGLE3_DRAFT = "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B"


def test_sglang_eagle3_from_extra_args_keeps_each_flag_once() -> None:
    extra = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE3_DRAFT,
             "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
    spec = WorkerSpec(engine="sglang", model=MODEL, memory_profile="h100", speculative_num_draft_tokens=4,
                      extra_args=extra)
    assert SGLangEngine().launch_command(spec, 30000) == [
        *SGLANG_BASE, *SGLANG_BUDGET_ARGS["h100"], "--enable-metrics", "--speculative-num-draft-tokens", "4",
        *extra]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_sglang_draft_model_algorithm_without_draft_model_is_refused(algorithm: str) -> None:
    spec = WorkerSpec(engine="sglang", model=MODEL, memory_profile="h100", speculative_num_draft_tokens=4,
                      extra_args=["--speculative-algorithm", algorithm, "--speculative-num-steps", "3"])
    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):
        SGLangEngine().launch_command(spec, 30000)


@pytest.mark.parametrize("extra, match", [
    (["--speculative-algorithm", "MEDUSA2"], "choose one of"),
    (["--speculative-num-draft-tokens", "8"], "keep one"),
])
def test_sglang_speculative_extra_args_that_contradict_the_config(extra: list[str], match: str) -> None:
    spec = WorkerSpec(engine="sglang", model=MODEL, memory_profile="h100", speculative_num_draft_tokens=4,
                      extra_args=extra)
    with pytest.raises(ConfigError, match=match):
        SGLangEngine().launch_command(spec, 30000)


@pytest.mark.parametrize("engine, extra", [
    (SGLangEngine(), ["--speculative-algorithm=NGRAM"]),
    (EmbeddedEngine(), ["--speculative-algorithm", "NGRAM"]),
    (VLLMEngine(), ["--speculative-config", '{"method": "ngram"}']),
])
def test_speculation_in_extra_args_needs_the_config_field(engine, extra: list[str]) -> None:
    """Otherwise the run speculates while the gate believes it does not (its accept length unjudged)."""
    spec = WorkerSpec(engine=engine.name, model=MODEL if engine.name != "embedded" else "tiny-random",
                      memory_profile="h100" if engine.name != "embedded" else "cpu-small", extra_args=extra)
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens is unset"):
        engine.launch_command(spec, 30000)


def test_vllm_ngram_prompt_lookup_and_eagle3_configs() -> None:
    lookup = WorkerSpec(engine="vllm", model=MODEL, memory_profile="h100", speculative_num_draft_tokens=4,
                        extra_args=["--speculative-config", '{"prompt_lookup_max": 4, "prompt_lookup_min": 2}',
                                    "--enforce-eager"])
    cmd = VLLMEngine().launch_command(lookup, 8000)
    assert cmd[cmd.index("--speculative-config") + 1] == \
        '{"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2, "num_speculative_tokens": 4}'
    assert cmd.count("--speculative-config") == 1 and cmd[-1] == "--enforce-eager"
    eagle = WorkerSpec(engine="vllm", model=MODEL, memory_profile="h100", speculative_num_draft_tokens=3,
                       extra_args=[f'--speculative-config={{"method": "eagle3", "model": "{EAGLE3_DRAFT}"}}'])
    assert VLLMEngine().launch_command(eagle, 8000) == [
        "vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", "8000", *VLLM_BUDGET_ARGS["h100"],
        "--speculative-config", f'{{"method": "eagle3", "model": "{EAGLE3_DRAFT}", "num_speculative_tokens": 3}}']


@pytest.mark.parametrize("config, match", [
    ('{"method": "eagle"}', "needs a draft model"),
    ('{"method": "medusa-ish"}', "choose one of"),
    ('{"num_speculative_tokens": 7}', "keep one"),
    ("{method: ngram}", "is not JSON"),
    ("[1, 2]", "JSON object"),
])
def test_vllm_bad_speculative_config_is_refused(config: str, match: str) -> None:
    spec = WorkerSpec(engine="vllm", model=MODEL, memory_profile="h100", speculative_num_draft_tokens=3,
                      extra_args=["--speculative-config", config])
    with pytest.raises(ConfigError, match=match):
        VLLMEngine().launch_command(spec, 8000)


def test_vllm_declares_its_spec_decode_counters() -> None:
    assert VLLMEngine.spec_decode_counters == {
        "accepted": "vllm:spec_decode_num_accepted_tokens_total",
        "drafts": "vllm:spec_decode_num_drafts_total",
        "draft_tokens": "vllm:spec_decode_num_draft_tokens_total"}
    assert "spec_accept_length" not in VLLMEngine.metric_names  # no gauge: derived from the counters
