"""Occupancy scrape against the simulated server's /metrics while a long request runs."""

from __future__ import annotations

import math
import time

import pytest

from servegate.bench.occupancy import run_occupancy, scrape_metrics
from servegate.tables import SAMPLE_COLUMNS
from servegate.config import OccupancyConfig
from servegate.engines import SGLangEngine, VLLMEngine
from servegate.errors import InsufficientDataError, MetricsError, ServerUnreachableError, StageError

from servegate.http import make_session

from sim_server import SimServer, SimState, free_port

pytestmark = pytest.mark.timeout(60)

NAN = math.nan


def ranks(*values: float) -> list[tuple[dict[str, str], float]]:
    return [({"model_name": "sim", "tp_rank": str(i)}, v) for i, v in enumerate(values)]


def sglang_page(n: int) -> dict:
    """Scrape n: occupancy NaN on every rank at each window start (n % 4 == 0), rank 1 degraded
    to 40 on odd scrapes and NaN on rank 0 at n % 4 == 2."""
    if n % 4 == 0:
        occ = ranks(NAN, NAN)
    elif n % 4 == 2:
        occ = ranks(NAN, 80.0)
    else:
        occ = ranks(90.0, 40.0)
    return {
        "sglang:fwd_occupancy": occ,
        "sglang:token_usage": ranks(0.1 * (n % 3), 0.05),
        "sglang:num_running_reqs": ranks(1.0, 1.0),
        "sglang:num_queue_reqs": ranks(0.0, 2.0),
        "sglang:spec_accept_length": ranks(2.5, 1.5),
    }


@pytest.fixture
def sim():
    state = SimState(prefill_delay_s=0.01, per_token_delay_s=0.004, metrics=sglang_page)
    with SimServer(state) as server:
        yield server


def _cfg(**kw) -> OccupancyConfig:
    return OccupancyConfig(**{"max_new_tokens": 100, "scrape_interval_s": 0.02, "min_samples": 3, **kw})


@pytest.mark.parametrize("engine", [SGLangEngine()], ids=["native"])
def test_nan_dropped_min_across_ranks_median_over_scrapes(sim: SimServer, engine) -> None:
    res = run_occupancy(sim.base_url, engine, _cfg())
    samples, s = res.samples, res.summary.iloc[0]
    assert list(samples.columns) == SAMPLE_COLUMNS
    assert len(samples) >= 6  # a 0.4 s request scraped every 20 ms
    # One row per scrape, min over ranks with NaN ranks dropped: 40 (degraded rank), 80
    # (rank 0 NaN), or NaN (window start on every rank).
    occ = samples["fwd_occupancy"]
    assert set(occ.dropna().unique()) <= {40.0, 80.0} and 40.0 in set(occ)
    assert occ.isna().any()
    assert s["n_samples"] == occ.notna().sum() and s["n_scrapes"] == len(samples)
    assert s["fwd_occupancy_median"] == pytest.approx(occ.dropna().median())
    assert s["fwd_occupancy_min"] == 40.0 and bool(s["fwd_occupancy_applicable"]) is True
    assert s["spec_accept_length_median"] == 1.5  # the worse rank
    assert s["num_queue_reqs_max"] == 2.0 and s["num_running_reqs_max"] == 1.0
    assert s["token_usage_max"] == pytest.approx(0.2)
    (load,) = sim.state.bodies  # one long request, ignore_eos
    assert load["sampling_params"]["max_new_tokens"] == 100 and load["sampling_params"]["ignore_eos"] is True
    # Scraping stopped when the request finished: no scrape ran long after it.
    assert sim.state.scrapes <= len(samples) + 2


def test_missing_gauge_names_the_server_flags(sim: SimServer) -> None:
    sim.state.metrics = {"sglang:token_usage": ranks(0.1)}
    partial: dict = {}
    with pytest.raises(MetricsError) as info:
        run_occupancy(sim.base_url, SGLangEngine(), _cfg(), partial=partial)
    msg = str(info.value)
    assert "sglang:fwd_occupancy" in msg and SGLangEngine.metrics_hint in msg
    assert "SGLANG_ENABLE_METRICS_DEVICE_TIMER=1" in msg and "--enable-metrics" in msg
    assert len(partial["occupancy_samples"]) >= 1  # the scrapes taken are kept
    assert not hasattr(info.value, "partial")


def test_metrics_not_enabled_is_a_metrics_error(sim: SimServer) -> None:
    sim.state.metrics_status = 404
    with pytest.raises(MetricsError, match="404") as info:
        run_occupancy(sim.base_url, SGLangEngine(), _cfg())
    assert SGLangEngine.metrics_hint in str(info.value)
    assert sim.state.bodies == []  # failed before loading the server


def test_malformed_page_names_the_url(sim: SimServer) -> None:
    sim.state.metrics_malformed = True
    with pytest.raises(MetricsError, match=f"{sim.base_url}/metrics is not a valid Prometheus"):
        run_occupancy(sim.base_url, SGLangEngine(), _cfg())


def test_always_nan_gauge_is_insufficient_data(sim: SimServer) -> None:
    sim.state.metrics = {"sglang:fwd_occupancy": ranks(NAN, NAN)}
    partial: dict = {}
    with pytest.raises(InsufficientDataError, match="0 non-NaN fwd_occupancy samples"):
        run_occupancy(sim.base_url, SGLangEngine(), _cfg(), partial=partial)
    samples = partial["occupancy_samples"]
    assert len(samples) >= 1 and samples["fwd_occupancy"].isna().all()


def test_too_few_samples_is_insufficient_data(sim: SimServer) -> None:
    with pytest.raises(InsufficientDataError, match="min_samples=500") as info:
        run_occupancy(sim.base_url, SGLangEngine(), _cfg(min_samples=500, max_requests=2))
    assert "of 2 request(s) of 100 tokens" in str(info.value) and "occupancy.max_requests" in str(info.value)
    assert len(sim.state.bodies) == 2  # sent again once, then no more: max_requests bounds the load


def test_a_request_too_short_for_min_samples_is_sent_again(sim: SimServer) -> None:
    # One 0.4 s request scraped every 20 ms reads at most 20 scrapes (15 with a value): 25 need more.
    res = run_occupancy(sim.base_url, SGLangEngine(), _cfg(min_samples=25, max_requests=20))
    s = res.summary.iloc[0]
    assert s["n_samples"] >= 25 and s["n_scrapes"] == len(res.samples)
    assert 2 <= s["n_requests"] < 20 and len(sim.state.bodies) == s["n_requests"]
    assert all(body == sim.state.bodies[0] for body in sim.state.bodies)  # the same request each time
    assert res.samples["t_s"].is_monotonic_increasing  # one clock over all the requests


def test_enough_samples_from_one_request_sends_one(sim: SimServer) -> None:
    res = run_occupancy(sim.base_url, SGLangEngine(), _cfg(min_samples=3, max_requests=5))
    assert res.summary.iloc[0]["n_requests"] == 1 and len(sim.state.bodies) == 1


def test_engine_without_occupancy_gauge_reports_the_rest(sim: SimServer) -> None:
    sim.state.metrics = {"vllm:num_requests_running": ranks(1.0, 3.0),
                         "vllm:num_requests_waiting": ranks(0.0),
                         "vllm:kv_cache_usage_perc": ranks(0.25, 0.5)}
    res = run_occupancy(sim.base_url, VLLMEngine(), _cfg())
    s = res.summary.iloc[0]
    assert bool(s["fwd_occupancy_applicable"]) is False and math.isnan(s["fwd_occupancy_median"])
    assert s["num_running_reqs_max"] == 3.0 and s["kv_cache_usage_max"] == 0.5
    assert s["n_samples"] == len(res.samples) >= 3
    (load,) = sim.state.bodies
    assert load["max_tokens"] == 100 and load["model"] == "sim-model"


def test_vllm_accept_length_from_its_spec_decode_counters(sim: SimServer) -> None:
    """vLLM has no accept-length gauge: each scrape interval's accept length is 1 + d(accepted) / d(drafts),
    summed over engines; an interval without drafts is NaN, never 1."""
    def page(n: int) -> dict:
        step = (n + 1) // 2  # the counters move on odd scrapes only (idle between)
        return {"vllm:num_requests_running": ranks(1.0),
                "vllm:spec_decode_num_drafts_total": ranks(10.0 * step, 10.0 * step),
                "vllm:spec_decode_num_draft_tokens_total": ranks(30.0 * step, 30.0 * step),
                "vllm:spec_decode_num_accepted_tokens_total": ranks(25.0 * step, 15.0 * step)}

    sim.state.metrics = page
    res = run_occupancy(sim.base_url, VLLMEngine(), _cfg())
    accept = res.samples["spec_accept_length"]
    assert len(accept) >= 4
    assert set(accept.dropna()) == {3.0}  # 1 + (25 + 15) / (10 + 10)
    assert accept.isna().any()  # the idle intervals
    assert res.summary.iloc[0]["spec_accept_length_median"] == 3.0


def test_failed_load_request_is_a_stage_error(sim: SimServer) -> None:
    sim.state.generate_status = 500
    with pytest.raises(StageError, match="answered HTTP 500"):
        run_occupancy(sim.base_url, SGLangEngine(), _cfg())


def test_unreachable_server() -> None:
    with pytest.raises(ServerUnreachableError):
        run_occupancy(f"http://127.0.0.1:{free_port()}", SGLangEngine(), _cfg())


# --- issue 11: whole-request deadlines, API key ---------------------------------------------

@pytest.mark.timeout(30)
def test_dripping_long_request_fails_at_its_deadline(sim: SimServer) -> None:
    sim.state.drip_routes = {"/generate"}
    sim.state.drip_interval_s = 0.2  # never idle long enough for a per-read timeout
    started = time.monotonic()
    with pytest.raises(StageError, match=r"the occupancy load request \(POST .*\) did not complete within its "
                                         r"deadline of 1 s .*raise occupancy.request_timeout_s"):
        run_occupancy(sim.base_url, SGLangEngine(), _cfg(request_timeout_s=1.0))
    assert time.monotonic() - started < 5.0


@pytest.mark.timeout(30)
def test_dripping_metrics_page_fails_the_scrape_at_its_deadline(sim: SimServer) -> None:
    sim.state.drip_routes = {"/metrics"}
    sim.state.drip_interval_s = 0.2
    started = time.monotonic()
    with pytest.raises(StageError, match=r"metrics scrape GET .*/metrics did not complete within its deadline "
                                         r"of 1 s .*this limit is fixed"):
        scrape_metrics(make_session(), sim.base_url, SGLangEngine(), timeout_s=1.0)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("engine", [SGLangEngine(), VLLMEngine()], ids=["native", "openai"])
def test_server_that_requires_an_api_key(sim: SimServer, engine) -> None:
    sim.state.api_key = "sekrit"
    if engine.protocol == "openai":
        sim.state.metrics = {"vllm:num_requests_running": [({}, 1.0)]}
    res = run_occupancy(sim.base_url, engine, _cfg(), api_key="sekrit")
    assert res.summary.iloc[0]["n_scrapes"] >= 3
    with pytest.raises(StageError, match="401"):
        run_occupancy(sim.base_url, engine, _cfg())
