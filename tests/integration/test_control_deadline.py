"""Control calls (readiness, flush, server info) end within their deadline against a dripping server.

A server that answers 200 and then one byte a second never trips a per-read timeout; each of these
calls used to wait on it for as long as it dripped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servegate.config import WorkerSpec
from servegate.engines import ExternalEngine, SGLangEngine, VLLMEngine
from servegate.engines import sglang as sglang_engine
from servegate.errors import RequestDeadlineError, WorkerLaunchError
from servegate.http import make_session
from servegate.launch import launch_worker

from sim_server import SimServer, SimState

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimState(drip_interval_s=0.2)) as server:
        yield server


@pytest.mark.parametrize(("engine", "route"), [(SGLangEngine(), "/flush_cache"), (VLLMEngine(), "/reset_prefix_cache"),
                                               (ExternalEngine(), "/flush_cache")], ids=["sglang", "vllm", "external"])
def test_flush_against_a_dripping_server_ends_at_its_deadline(sim: SimServer, engine, route: str) -> None:
    sim.state.drip_routes = {route}
    started = time.monotonic()
    with make_session() as session, pytest.raises(RequestDeadlineError, match="flush.request_timeout_s"):
        engine.flush(session, sim.base_url, timeout_s=1, request_timeout_s=1.5)
    assert time.monotonic() - started < 5


def test_server_info_against_a_dripping_server_ends_at_its_deadline(sim: SimServer, monkeypatch) -> None:
    # The limit is fixed (30 s: a healthy server answers in milliseconds); 3 s here, so the test waits 3 s.
    monkeypatch.setattr(sglang_engine, "SERVER_INFO_TIMEOUT_S", 3.0)
    sim.state.drip_routes = {"/server_info", "/get_server_info"}
    started = time.monotonic()
    with make_session() as session, pytest.raises(RequestDeadlineError, match="server info"):
        SGLangEngine().server_capacity(session, sim.base_url)
    assert 3 <= time.monotonic() - started < 13


def test_readiness_against_a_dripping_health_route_times_out(sim: SimServer, tmp_path: Path) -> None:
    sim.state.drip_routes = {"/health", "/v1/models"}
    started = time.monotonic()
    with pytest.raises(WorkerLaunchError, match="not ready after 3 s"):
        launch_worker(WorkerSpec(engine="external", url=sim.base_url), tmp_path / "w.log", ready_timeout_s=3)
    assert time.monotonic() - started < 10
