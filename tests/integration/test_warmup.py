"""Warmup against real local HTTP servers speaking SGLang-native and OpenAI protocols."""

from __future__ import annotations

import time

import pytest

from servegate.bench.warmup import run_warmup
from servegate.config import WarmupConfig
from servegate.engines import EmbeddedEngine, ExternalEngine, SGLangEngine, VLLMEngine
from servegate.errors import ServerUnreachableError, StageError
from servegate.launch import free_port

from fake_servers import FakeServer
from sim_server import SimServer, SimState

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


# --- issue 11: whole-request deadline, believable counts, API key (against the sim server) ----

@pytest.fixture
def sim():
    with SimServer(SimState(prefill_delay_s=0.005, per_token_delay_s=0.001)) as server:
        yield server


@pytest.mark.timeout(30)
@pytest.mark.parametrize("engine", [SGLangEngine(), VLLMEngine()], ids=["native", "openai"])
def test_dripping_server_fails_warmup_at_its_deadline(sim: SimServer, engine) -> None:
    # One byte every 0.2 s never trips a 1 s per-read timeout: before the fix this ran forever.
    sim.state.drip_routes = {"/generate", "/v1/completions"}
    sim.state.drip_interval_s = 0.2
    started = time.monotonic()
    with pytest.raises(StageError, match=r"warmup request 1/2 \(POST .*\) did not complete within its deadline "
                                         r"of 1 s .*raise warmup.request_timeout_s"):
        run_warmup(sim.base_url, engine, WarmupConfig(num_requests=2, request_timeout_s=1.0))
    assert time.monotonic() - started < 5.0
    assert sim.state.drips == 1


@pytest.mark.timeout(30)
def test_dripping_model_list_fails_at_its_deadline(sim: SimServer) -> None:
    sim.state.drip_routes = {"/v1/models"}
    sim.state.drip_interval_s = 0.2
    with pytest.raises(StageError, match=r"GET .*/v1/models did not complete within its deadline of 1 s"):
        run_warmup(sim.base_url, VLLMEngine(), WarmupConfig(num_requests=1, request_timeout_s=1.0))


@pytest.mark.parametrize("engine", [SGLangEngine(), VLLMEngine()], ids=["native", "openai"])
def test_lying_token_counts_fail_warmup(sim: SimServer, engine) -> None:
    sim.state.claim_factor = 3
    match = ("reported 24 completion tokens for warmup request 1/1 .* but returned 8 output ids"
             if engine.protocol == "native" else "reported 24 completion tokens for warmup request 1/1 .* at most 8")
    with pytest.raises(StageError, match=match):
        run_warmup(sim.base_url, engine, WarmupConfig(num_requests=1, max_new_tokens=8))


@pytest.mark.parametrize("engine", [SGLangEngine(), VLLMEngine()], ids=["native", "openai"])
def test_server_that_requires_an_api_key(sim: SimServer, engine) -> None:
    sim.state.api_key = "sekrit"
    assert run_warmup(sim.base_url, engine, WarmupConfig(num_requests=1, max_new_tokens=4), api_key="sekrit") == 1
    with pytest.raises(StageError, match="401"):
        run_warmup(sim.base_url, engine, WarmupConfig(num_requests=1, max_new_tokens=4))
