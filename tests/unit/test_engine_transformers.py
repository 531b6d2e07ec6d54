"""The ``transformers`` engine (``transformers serve --continuous-batching``): its exact argument list and
environment, its budget, its capabilities, and the Hugging Face cache view that makes ``/v1/models`` list
the served model. The real server runs in tests/slow/test_transformers_serve.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import requests

from servegate.budgets import MEMORY_PROFILES, TransformersBudget
from servegate.config import REDACTED, WorkerSpec, load_config
from servegate.engines import ENGINES, TransformersServeEngine, get_engine
from servegate.engines.transformers_serve import HUB_VIEW_DIR, ensure_hub_view, served_model
from servegate.errors import ConfigError
from servegate.models import MANIFEST
from servegate.stages import STAGES

ENGINE = TransformersServeEngine()
SERVE = [sys.executable, "-m", "transformers.cli.transformers", "serve"]


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """servegate's model cache in tmp_path, holding a (fake, complete) ``smollm2-135m``."""
    root = tmp_path / "cache"
    model = root / "smollm2-135m"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"weights")
    (model / MANIFEST).write_text("{}")
    monkeypatch.setenv("SERVEGATE_CACHE", str(root))
    return root


def test_registered_under_its_name() -> None:
    assert ENGINES["transformers"] is TransformersServeEngine
    assert isinstance(get_engine("transformers"), TransformersServeEngine)
    assert ENGINE.budget_model is TransformersBudget


def test_profile_command_and_env(cache: Path) -> None:
    """``servegate run --profile transformers-cpu`` launches exactly this."""
    spec = load_config(profile="transformers-cpu").worker
    assert ENGINE.launch_command(spec, 8000) == [
        *SERVE, "servegate/smollm2-135m", "--continuous-batching", "--host", "127.0.0.1", "--port", "8000",
        "--cb-num-blocks", "64", "--cb-max-batch-tokens", "1024", "--device", "cpu", "--dtype", "bfloat16"]
    assert ENGINE.launch_env(spec) == {"HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_HUB_CACHE": str(cache / HUB_VIEW_DIR),
                                       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_every_budget_field_is_a_flag_and_the_user_env_wins(cache: Path) -> None:
    spec = WorkerSpec(engine="transformers", model="smollm2-135m", host="0.0.0.0", memory_profile="ci-gpu",
                      memory={"cb_num_blocks": 8, "cb_block_size": 32, "cb_max_batch_tokens": 256,
                              "cb_max_memory_percent": 0.5},
                      extra_args=["--compile"], env={"HF_HUB_OFFLINE": "0", "OMP_NUM_THREADS": "1"})
    assert ENGINE.launch_command(spec, 1234) == [
        *SERVE, "servegate/smollm2-135m", "--continuous-batching", "--host", "0.0.0.0", "--port", "1234",
        "--cb-num-blocks", "8", "--cb-block-size", "32", "--cb-max-batch-tokens", "256",
        "--cb-max-memory-percent", "0.5", "--compile"]
    env = ENGINE.launch_env(spec)
    assert env["HF_HUB_OFFLINE"] == "0" and env["OMP_NUM_THREADS"] == "1"


def test_a_profile_without_a_transformers_budget_passes_no_flags(cache: Path) -> None:
    """An unbounded cache is the user's choice (transformers then takes 60 % of free RAM on CPU)."""
    assert "transformers" not in MEMORY_PROFILES["h100"].budgets
    spec = WorkerSpec(engine="transformers", model="smollm2-135m", memory_profile="h100")
    assert not any(arg.startswith("--cb-") for arg in ENGINE.launch_command(spec, 1))


def test_worker_python_is_the_interpreter(cache: Path) -> None:
    spec = WorkerSpec(engine="transformers", model="smollm2-135m", python="/opt/tf/bin/python")
    assert ENGINE.launch_command(spec, 1)[:4] == ["/opt/tf/bin/python", "-m", "transformers.cli.transformers", "serve"]


def test_a_hub_id_passes_through_with_the_machines_hub_cache(cache: Path) -> None:
    spec = WorkerSpec(engine="transformers", model="HuggingFaceTB/SmolLM2-135M-Instruct", memory_profile="h100")
    assert ENGINE.launch_command(spec, 1)[4] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ENGINE.launch_env(spec) == {"HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    assert not (cache / HUB_VIEW_DIR).exists()


def test_a_local_directory_is_served_under_a_stable_id(cache: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "a" / "model", tmp_path / "b" / "model"
    for d in (one, two):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    (id_one, root), (id_two, _) = served_model(str(one)), served_model(str(two))
    assert id_one.startswith("local/model-") and id_two.startswith("local/model-") and id_one != id_two
    assert served_model(str(one)) == (id_one, root) and root == cache / HUB_VIEW_DIR
    spec = WorkerSpec(engine="transformers", model=str(one))
    assert ENGINE.launch_command(spec, 1)[4] == id_one
    assert (root / ("models--" + id_one.replace("/", "--")) / "refs" / "main").is_file()


def test_hub_view_is_the_hugging_face_cache_layout(cache: Path) -> None:
    """What transformers' /v1/models lists (huggingface_hub.scan_cache_dir) and what from_pretrained
    loads offline: refs/main names a snapshot whose files link to the model's."""
    from huggingface_hub import scan_cache_dir

    model, root = cache / "smollm2-135m", cache / HUB_VIEW_DIR
    snapshot = ensure_hub_view("servegate/smollm2-135m", model, root)
    repo = root / "models--servegate--smollm2-135m"
    assert (repo / "refs" / "main").read_text() == snapshot.name and snapshot.parent == repo / "snapshots"
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in model.iterdir())
    assert (snapshot / "config.json").resolve() == (model / "config.json").resolve()
    repos = scan_cache_dir(root).repos
    assert [(r.repo_id, r.repo_type, sorted(r.refs)) for r in repos] == [("servegate/smollm2-135m", "model", ["main"])]
    assert ensure_hub_view("servegate/smollm2-135m", model, root) == snapshot  # idempotent


def test_hub_view_follows_a_changed_model(cache: Path) -> None:
    model, root = cache / "smollm2-135m", cache / HUB_VIEW_DIR
    first = ensure_hub_view("servegate/smollm2-135m", model, root)
    (model / "tokenizer.json").write_text("{}")
    second = ensure_hub_view("servegate/smollm2-135m", model, root)
    assert second != first and (second / "tokenizer.json").is_symlink()
    assert (root / "models--servegate--smollm2-135m" / "refs" / "main").read_text() == second.name


def test_an_empty_model_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no files"):
        ensure_hub_view("local/empty", tmp_path / "empty", tmp_path / "view")


def test_an_api_key_is_refused_because_the_server_checks_none(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="checks no API key"):
        ENGINE.launch_command(WorkerSpec(engine="transformers", api_key="secret"), 1)
    monkeypatch.setenv("GATE_KEY", "from-env")
    with pytest.raises(ConfigError, match="checks no API key"):
        ENGINE.launch_command(WorkerSpec(engine="transformers", api_key_env="GATE_KEY"), 1)
    with pytest.raises(ConfigError, match="--set worker.api_key=KEY"):  # a snapshot's placeholder
        ENGINE.launch_command(WorkerSpec(engine="transformers", api_key=REDACTED), 1)
    with pytest.raises(ConfigError, match="--set worker.env.HF_TOKEN=VALUE"):
        ENGINE.launch_env(WorkerSpec(engine="transformers", env={"HF_TOKEN": REDACTED}))


def test_speculative_decoding_is_refused(cache: Path) -> None:
    with pytest.raises(ConfigError, match="no speculative decoding"):
        ENGINE.launch_command(WorkerSpec(engine="transformers", speculative_num_draft_tokens=4), 1)


def test_a_budget_of_another_engine_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"engine 'transformers' has no memory budget field 'max_total_tokens'"):
        load_config(profile="transformers-cpu", overrides=["worker.memory.max_total_tokens=1"])


def test_budget_sizes_and_token_capacity() -> None:
    assert TransformersServeEngine.oom_knobs() == ["cb_num_blocks", "cb_block_size", "cb_max_batch_tokens",
                                                   "cb_max_memory_percent"]
    assert TransformersBudget().token_capacity is None  # transformers sizes the cache itself
    assert TransformersBudget(cb_num_blocks=64).token_capacity == 64 * 256  # its default block
    assert TransformersBudget(cb_num_blocks=8, cb_block_size=32).token_capacity == 256
    # The CPU memory profiles hold the same KV token capacity for every engine that takes one.
    for name in ("cpu-small", "cpu-large"):
        profile = MEMORY_PROFILES[name]
        assert profile.for_engine("transformers").token_capacity == profile.for_engine("embedded").token_capacity


def test_capabilities_make_one_batch_occupancy_and_quality_not_applicable() -> None:
    # transformers serve follows OpenAI's schema strictly: text prompts, no ignore_eos, no [DONE].
    assert ENGINE.launches and ENGINE.protocol == "openai-text" and ENGINE.readiness_path == "/health"
    assert (ENGINE.can_flush, ENGINE.has_metrics, ENGINE.has_occupancy_gauge, ENGINE.reports_capacity,
            ENGINE.has_logprobs, ENGINE.takes_prompt_batches) == (False, False, False, False, False, False)
    assert ENGINE.metric_names == {} and "no /metrics" in ENGINE.metrics_hint
    assert [name for name, stage in STAGES.items() if stage.needs and not getattr(ENGINE, stage.needs)] == \
        ["one_batch", "occupancy", "quality"]
    assert STAGES["one_batch"].needs_why == "takes no list of prompts in one request, which one-batch sends as its batch"


def test_flush_and_capacity_ask_the_server_nothing() -> None:
    class NoRequests(requests.Session):
        def request(self, *args, **kwargs):  # type: ignore[override]
            raise AssertionError("the transformers engine has no flush or server-info route to call")

    with NoRequests() as session:
        assert ENGINE.flush(session, "http://127.0.0.1:9", 60.0) is False
        capacity = ENGINE.server_capacity(session, "http://127.0.0.1:9")
    assert math.isinf(capacity.token_capacity) and math.isinf(capacity.max_running_requests)


@pytest.mark.parametrize("engine,loads", [("transformers", True), ("vllm", False)])
def test_the_serving_stage_gives_a_text_protocol_the_models_tokenizer_once(
        engine: str, loads: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import pandas as pd

    import servegate.bench.datasets as datasets
    import servegate.bench.serving as serving
    from servegate.bench.serving import ServingResult
    from servegate.stages import StageResult

    loaded: list[str] = []
    handed: list[object] = []
    tokenizer = object()

    def fake_load(model: str) -> object:
        loaded.append(model)
        return tokenizer

    def fake_run_serving(base_url, eng, cfg, api_key=None, *, tokenizer=None, session=None, partial=None):
        handed.append(tokenizer)
        return ServingResult(requests=pd.DataFrame(), summary=pd.DataFrame([{"client_valid": True}]))

    monkeypatch.setattr(datasets, "load_prompt_tokenizer", fake_load)
    monkeypatch.setattr(serving, "run_serving", fake_run_serving)
    config = load_config(profile="transformers-cpu")
    run = types.SimpleNamespace(base_url="http://127.0.0.1:9", engine=get_engine(engine), config=config, api_key=None,
                                folder=types.SimpleNamespace(write_jsonl=lambda *a, **k: None))
    STAGES["serving"].run(run, StageResult("serving"))  # type: ignore[arg-type]
    assert loaded == (["smollm2-135m"] if loads else [])
    assert handed == [tokenizer if loads else None]


def test_random_prompts_decode_to_text_with_smollm2s_tokenizer() -> None:
    from servegate.bench.datasets import as_text_prompts, load_prompt_tokenizer, sample_random_requests
    from servegate.errors import ModelUnavailableError
    from servegate.models import ensure_model

    try:
        ensure_model("smollm2-135m", allow_fetch=False)
    except ModelUnavailableError:
        pytest.skip("SmolLM2 is not cached; run `servegate model fetch --model smollm2-135m`")
    rows = sample_random_requests(3, 32, 8, 0.5, seed=1)
    text = as_text_prompts(rows, load_prompt_tokenizer("smollm2-135m"))
    assert all(isinstance(r.prompt, str) and r.prompt for r in text)
    assert [(r.prompt_len, r.output_len) for r in text] == [(r.prompt_len, r.output_len) for r in rows]
