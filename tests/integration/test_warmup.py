"""Warmup against real local HTTP servers speaking SGLang-native and OpenAI protocols."""

from __future__ import annotations

import pytest

from servegate.bench.warmup import run_warmup
from servegate.config import WarmupConfig
from servegate.engines import EmbeddedEngine, ExternalEngine, SGLangEngine, VLLMEngine
from servegate.errors import ServerUnreachableError, StageError
from servegate.launch import free_port

from fake_servers import FakeServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def srv():
    with FakeServer() as server:
        yield server


@pytest.mark.parametrize("engine", [SGLangEngine(), EmbeddedEngine()], ids=["sglang", "embedded"])
def test_native_warmup(srv: FakeServer, engine) -> None:
    cfg = WarmupConfig(num_requests=3, max_new_tokens=64, prompt="Hello")
    assert run_warmup(srv.url, engine, cfg, api_key="k") == 3
    reqs = srv.requests_to("/generate")
    assert len(reqs) == 3
    assert reqs[0].body == {"text": "Hello", "sampling_params": {"max_new_tokens": 64, "temperature": 0}}
    assert reqs[0].headers["Authorization"] == "Bearer k"


@pytest.mark.parametrize("engine", [VLLMEngine(), ExternalEngine()], ids=["vllm", "external"])
def test_openai_warmup_names_the_served_model(srv: FakeServer, engine) -> None:
    srv.state.models = ["served/model-a", "other"]
    assert run_warmup(srv.url, engine, WarmupConfig(num_requests=2, max_new_tokens=8, prompt="Hi")) == 2
    reqs = srv.requests_to("/v1/completions")
    assert len(reqs) == 2
    assert reqs[0].body == {"model": "served/model-a", "prompt": "Hi", "max_tokens": 8, "temperature": 0}


def test_openai_warmup_with_explicit_model(srv: FakeServer) -> None:
    run_warmup(srv.url, VLLMEngine(), WarmupConfig(num_requests=1), model="given")
    assert srv.requests_to("/v1/models") == []
    assert srv.requests_to("/v1/completions")[0].body["model"] == "given"


@pytest.mark.parametrize("engine", [SGLangEngine(), VLLMEngine()], ids=["native", "openai"])
def test_server_error_fails_the_stage(srv: FakeServer, engine) -> None:
    srv.state.generate_status = 500
    srv.state.generate_body = {"error": "CUDA error: device-side assert"}
    with pytest.raises(StageError, match=r"warmup failed: request 1/3 .* 500: .*device-side assert"):
        run_warmup(srv.url, engine, WarmupConfig(num_requests=3))


@pytest.mark.parametrize("engine,body", [
    (SGLangEngine(), {"text": "", "output_ids": [], "meta_info": {"completion_tokens": 0}}),
    (VLLMEngine(), {"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}),
], ids=["native", "openai"])
def test_empty_output_fails_the_stage(srv: FakeServer, engine, body: dict) -> None:
    srv.state.generate_body = body
    with pytest.raises(StageError, match="no generated output"):
        run_warmup(srv.url, engine, WarmupConfig(num_requests=1))


def test_non_json_answer_fails_the_stage(srv: FakeServer) -> None:
    srv.state.generate_body = b"<html>proxy error</html>"
    with pytest.raises(StageError, match="not JSON"):
        run_warmup(srv.url, SGLangEngine(), WarmupConfig(num_requests=1))


def test_openai_server_without_models_route(srv: FakeServer) -> None:
    srv.state.routes_missing = {"/v1/models"}
    with pytest.raises(StageError, match="pass the model name explicitly"):
        run_warmup(srv.url, ExternalEngine(), WarmupConfig(num_requests=1))


def test_unreachable_server() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachableError, match="warmup request 1/1"):
        run_warmup(url, SGLangEngine(), WarmupConfig(num_requests=1))
