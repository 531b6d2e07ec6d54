"""Flush (and server info) against real local HTTP servers that behave like each engine."""

from __future__ import annotations

import logging
import math
import time

import pytest

from servegate.bench.flush import flush_until_idle
from servegate.config import FlushConfig
from servegate.engines import EmbeddedEngine, ExternalEngine, SGLangEngine, VLLMEngine
from servegate.errors import FlushError, RequestDeadlineError, ServerUnreachableError, StageError
from servegate.http import make_session
from servegate.launch import free_port

from fake_servers import FakeServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def srv():
    with FakeServer() as server:
        yield server


@pytest.mark.parametrize("engine", [SGLangEngine(), EmbeddedEngine()], ids=["sglang", "embedded"])
def test_sglang_flush_waits_for_idle(srv: FakeServer, engine) -> None:
    # SGLang's own test pattern: busy for ~1 s, flush with timeout 5 -> 200 once idle.
    srv.state.busy_until = time.monotonic() + 1.0
    waited = flush_until_idle(srv.url, engine, FlushConfig(timeout_s=5))
    assert waited >= 0.9  # the server held the request until idle
    (req,) = srv.requests_to("/flush_cache")
    assert req.method == "POST" and req.query == {"timeout": ["5"]}


def test_sglang_flush_still_busy_is_a_flush_error(srv: FakeServer) -> None:
    srv.state.busy_until = time.monotonic() + 30
    with pytest.raises(FlushError, match=r"still busy after 0.5 s.*400.*raise flush.timeout_s"):
        flush_until_idle(srv.url, SGLangEngine(), FlushConfig(timeout_s=0.5))
    assert srv.requests_to("/flush_cache")[0].query == {"timeout": ["0.5"]}


def test_flush_http_timeout_is_a_request_deadline(srv: FakeServer) -> None:
    srv.state.busy_until = time.monotonic() + 30
    with pytest.raises(RequestDeadlineError, match="flush.request_timeout_s"):
        flush_until_idle(srv.url, SGLangEngine(), FlushConfig(timeout_s=5, request_timeout_s=0.3))


def test_flush_sends_bearer_token(srv: FakeServer) -> None:
    flush_until_idle(srv.url, SGLangEngine(), FlushConfig(timeout_s=1), api_key="sekret")
    assert srv.requests_to("/flush_cache")[0].headers["Authorization"] == "Bearer sekret"


def test_vllm_flush_success(srv: FakeServer) -> None:
    flush_until_idle(srv.url, VLLMEngine(), FlushConfig(timeout_s=2))
    assert [r.method for r in srv.requests_to("/reset_prefix_cache")] == ["POST"]


def test_vllm_success_false_is_retried_until_idle(srv: FakeServer) -> None:
    srv.state.vllm_refuse_until = time.monotonic() + 0.8
    flush_until_idle(srv.url, VLLMEngine(), FlushConfig(timeout_s=5))
    assert len(srv.requests_to("/reset_prefix_cache")) >= 2


def test_vllm_success_false_past_timeout_is_a_flush_error(srv: FakeServer) -> None:
    srv.state.vllm_refuse_until = time.monotonic() + 60
    with pytest.raises(FlushError, match=r"refused to reset its prefix cache for 1 s.*success.*false"):
        flush_until_idle(srv.url, VLLMEngine(), FlushConfig(timeout_s=1))


def test_vllm_without_dev_mode_is_a_flush_error_with_hint(srv: FakeServer) -> None:
    srv.state.routes_missing = {"/reset_prefix_cache"}
    with pytest.raises(FlushError, match="VLLM_SERVER_DEV_MODE=1"):
        flush_until_idle(srv.url, VLLMEngine(), FlushConfig(timeout_s=1))


def test_external_flush_without_endpoint_warns_and_goes_on(srv: FakeServer,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    srv.state.routes_missing = {"/flush_cache"}
    with caplog.at_level(logging.WARNING, logger="servegate.bench.flush"):
        flush_until_idle(srv.url, ExternalEngine(), FlushConfig(timeout_s=1))
    assert "no flush endpoint" in caplog.text
    assert srv.requests_to("/flush_cache")[0].query == {}  # no parameters for other backends


def test_external_flush_refused_is_a_flush_error(srv: FakeServer) -> None:
    srv.state.busy_until = time.monotonic() + 30  # the fake answers 400 when busy
    with pytest.raises(FlushError, match="refused to flush"):
        flush_until_idle(srv.url, ExternalEngine(), FlushConfig(timeout_s=1))


def test_external_flush_result(srv: FakeServer) -> None:
    assert ExternalEngine().flush(make_session(), srv.url, 1) is True
    srv.state.routes_missing = {"/flush_cache"}
    assert ExternalEngine().flush(make_session(), srv.url, 1) is False


def test_flush_against_closed_port_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachableError, match="could not reach"):
        flush_until_idle(url, SGLangEngine(), FlushConfig(timeout_s=1))


# Server info: the other control endpoint the engines read.

SERVER_INFO = {"dp_size": 2, "max_total_num_tokens": 1, "internal_states": [
    {"memory_usage": {"token_capacity": 1000}, "effective_max_running_requests_per_dp": 8},
    {"memory_usage": {"token_capacity": 1500}, "effective_max_running_requests_per_dp": 8}]}


def test_server_info_prefers_new_route(srv: FakeServer) -> None:
    srv.state.server_info = SERVER_INFO
    cap = SGLangEngine().server_capacity(make_session(), srv.url)
    assert (cap.token_capacity, cap.max_running_requests) == (2500, 16)
    assert [r.path for r in srv.state.requests] == ["/server_info"]


def test_server_info_falls_back_to_get_server_info(srv: FakeServer) -> None:
    srv.state.server_info = SERVER_INFO
    srv.state.routes_missing = {"/server_info"}
    cap = EmbeddedEngine().server_capacity(make_session(), srv.url)
    assert cap.token_capacity == 2500
    assert [r.path for r in srv.state.requests] == ["/server_info", "/get_server_info"]


def test_server_info_missing(srv: FakeServer) -> None:
    with pytest.raises(StageError, match="neither /server_info nor /get_server_info"):
        SGLangEngine().server_capacity(make_session(), srv.url)
    cap = ExternalEngine().server_capacity(make_session(), srv.url)
    assert math.isinf(cap.token_capacity) and math.isinf(cap.max_running_requests)
    assert math.isinf(VLLMEngine().server_capacity(make_session(), srv.url).token_capacity)
