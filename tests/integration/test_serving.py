"""The serving load generator against the simulated server (real sockets, real SSE streams)."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from servegate.bench.serving import arrival_schedule, run_serving, serve_until
from servegate.tables import REQUEST_COLUMNS, SERVING_SUMMARY_COLUMNS
from servegate.config import ServingConfig
from servegate.engines import SGLangEngine, VLLMEngine
from servegate.errors import InsufficientDataError, ServerUnreachableError, StageError

from sim_server import SimServer, SimState, free_port

pytestmark = pytest.mark.timeout(90)

ENGINES = [SGLangEngine(), VLLMEngine()]
SUMMARY_COLUMNS = ["completed", "failed", "duration_s", "request_throughput", "input_throughput",
                   "output_throughput", "total_input_tokens", "total_output_tokens", "goodput",
                   "dispatch_lag_p50_ms", "dispatch_lag_p99_ms", "client_fell_behind", "arrival_ks_pvalue"] + [
    f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p95", "p99")
    for m in ("ttft", "tpot", "itl", "e2e_latency")]


@pytest.fixture
def sim():
    with SimServer(SimState(prefill_delay_s=0.01, per_token_delay_s=0.004)) as server:
        yield server


def _cfg(**kw) -> ServingConfig:
    base = {"num_prompts": 12, "random_input_len": 32, "random_output_len": 6, "random_range_ratio": 0.5,
            "arrival": "all-at-once", "progress": False}
    return ServingConfig(**{**base, **kw})


@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_serving_rows_and_summary(sim: SimServer, engine) -> None:
    res = run_serving(sim.base_url, engine, _cfg(slo_ttft_ms=10_000.0))
    req, summary = res.requests, res.summary
    assert list(req.columns) == REQUEST_COLUMNS and len(req) == 12
    assert set(SUMMARY_COLUMNS) <= set(summary.columns) and len(summary) == 1
    assert list(summary.columns) == SERVING_SUMMARY_COLUMNS  # the contract the suites are checked against
    assert req["success"].all() and req["error"].isna().all()
    # Token counts come from the server and match the plan (token ids sent, ignore_eos).
    assert (req["input_tokens"] == req["planned_input_tokens"]).all()
    assert (req["output_tokens"] == req["planned_output_tokens"]).all()
    for _, r in req.iterrows():
        n_out = r["output_tokens"]
        # One ITL per token after the first read (events a busy client reads at once are one arrival,
        # their gap spread over their tokens): never a zero gap, and together they span at most the decode.
        itls = r["itls_ms"]
        assert len(itls) <= n_out - 1 and all(x > 0 for x in itls)
        assert sum(itls) <= r["e2e_latency_ms"] - r["ttft_ms"] + 1e-6
        assert r["tpot_ms"] == pytest.approx((r["e2e_latency_ms"] - r["ttft_ms"]) / (n_out - 1))
        assert r["ttft_ms"] >= 10.0  # the sim's prefill delay
    s = summary.iloc[0]
    assert s["completed"] == 12 and s["failed"] == 0 and s["connection_errors"] == 0
    assert s["total_output_tokens"] == req["output_tokens"].sum()
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # a 10 s TTFT SLO: every request is good
    assert s["mean_itl_ms"] >= 3.0  # the sim's 4 ms decode step (uvloop timers may fire up to ~1 ms early)
    assert math.isnan(s["arrival_ks_pvalue"])  # not Poisson
    assert res.meta["protocol"] == engine.protocol and res.meta["num_prompts"] == 12
    # One body per request, streamed, ignore_eos, token ids (no tokenizer on the client).
    body = sim.state.bodies[0]
    assert body["stream"] is True
    if engine.protocol == "native":
        assert isinstance(body["input_ids"][0], int) and body["sampling_params"]["ignore_eos"] is True
    else:
        assert isinstance(body["prompt"][0], int) and body["ignore_eos"] is True
        assert body["model"] == "sim-model"


def test_poisson_arrivals_follow_the_schedule(sim: SimServer) -> None:
    # Seed 4: its 29 planned gaps have mean 48.9 ms and KS p = 0.997 against Exponential(20),
    # so only a client that fails to keep the schedule can make the test below reject.
    rate = 20.0
    cfg = _cfg(num_prompts=30, random_output_len=2, arrival="poisson", request_rate=rate, seed=4)
    res = run_serving(sim.base_url, SGLangEngine(), cfg)
    req = res.requests
    np.testing.assert_array_equal(req["scheduled_send_s"], arrival_schedule(30, "poisson", rate, 4))
    assert (req["dispatched_s"] >= req["scheduled_send_s"] - 1e-3).all()
    gaps = np.diff(np.sort(req["dispatched_s"]))
    planned = np.diff(req["scheduled_send_s"])
    assert gaps.mean() == pytest.approx(planned.mean(), abs=0.005)
    assert planned.mean() == pytest.approx(1 / rate, rel=0.2)
    s = res.summary.iloc[0]
    assert s["arrival_ks_pvalue"] > 0.01  # the client produced Poisson arrivals at the target rate
    assert s["client_fell_behind"] == bool(s["dispatch_lag_p99_ms"] > cfg.max_dispatch_lag_p99_ms)
    # The server saw the same arrival process.
    arrivals = np.diff(np.array(sim.state.arrivals))
    assert arrivals.mean() == pytest.approx(planned.mean(), abs=0.015)


def test_constant_arrivals(sim: SimServer) -> None:
    res = run_serving(sim.base_url, VLLMEngine(), _cfg(num_prompts=8, arrival="constant", request_rate=40.0))
    req = res.requests
    np.testing.assert_allclose(req["scheduled_send_s"], np.arange(8) / 40.0)
    assert (req["dispatch_lag_ms"] > -1.0).all()
    assert math.isnan(res.summary.iloc[0]["arrival_ks_pvalue"])


@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_max_concurrency_is_respected(sim: SimServer, engine) -> None:
    res = run_serving(sim.base_url, engine, _cfg(num_prompts=12, max_concurrency=3, random_output_len=8))
    assert sim.state.peak_active == 3  # reached, never exceeded
    req = res.requests
    assert req["success"].all()
    assert (req["queue_wait_ms"] > 5.0).sum() >= 6  # later requests waited for a slot...
    assert (req["dispatch_lag_ms"] < 500.0).all()   # ...which is back-pressure, not dispatch lag


def test_without_a_cap_all_requests_are_in_flight_together(sim: SimServer) -> None:
    run_serving(sim.base_url, SGLangEngine(), _cfg(num_prompts=8, random_output_len=12, random_range_ratio=1.0))
    assert sim.state.peak_active == 8


def test_openai_without_continuous_usage_counts_chunks(sim: SimServer) -> None:
    sim.state.openai_continuous_usage = False
    res = run_serving(sim.base_url, VLLMEngine(), _cfg(num_prompts=4))
    req = res.requests
    assert (req["output_tokens"] == req["planned_output_tokens"]).all()  # from the final usage chunk
    for _, r in req.iterrows():
        assert len(r["itls_ms"]) <= r["output_tokens"] - 1 and all(x > 0 for x in r["itls_ms"])


@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_all_requests_rejected_is_insufficient_data_with_partial(sim: SimServer, engine) -> None:
    sim.state.generate_status = 503
    tables: dict = {}
    with pytest.raises(InsufficientDataError, match="all 12 requests failed"):
        run_serving(sim.base_url, engine, _cfg(), partial=tables)
    partial = tables["serving_requests"]
    assert len(partial) == 12 and not partial["success"].any()
    assert (partial["error_kind"] == "http").all() and partial["error"].str.contains("503").all()


def test_unreachable_server_raises_with_partial() -> None:
    tables: dict = {}
    with pytest.raises(ServerUnreachableError, match="failed to connect"):
        run_serving(f"http://127.0.0.1:{free_port()}", SGLangEngine(), _cfg(num_prompts=3), partial=tables)
    partial = tables["serving_requests"]
    assert len(partial) == 3 and (partial["error_kind"] == "connection").all()


def test_cut_streams_are_failed_requests(sim: SimServer) -> None:
    sim.state.cut_stream_after_tokens = 2
    tables: dict = {}
    with pytest.raises(InsufficientDataError):
        run_serving(sim.base_url, SGLangEngine(), _cfg(num_prompts=3, random_output_len=8,
                                                       random_range_ratio=1.0), partial=tables)
    partial = tables["serving_requests"]
    assert (partial["error_kind"] == "stream").all()
    assert partial["error"].str.contains("before \\[DONE\\] after 2 tokens").all()


def test_server_gone_mid_run_records_errors() -> None:
    sim = SimServer(SimState(prefill_delay_s=0.005, per_token_delay_s=0.002)).start()
    stopper = threading.Timer(0.35, sim.stop)
    try:
        stopper.start()
        res = run_serving(sim.base_url, SGLangEngine(),
                          _cfg(num_prompts=10, arrival="constant", request_rate=10.0, random_output_len=4))
    finally:
        stopper.join()
        sim.stop()
    req, s = res.requests, res.summary.iloc[0]
    assert req["success"].iloc[0] and not req["success"].iloc[-1]
    assert s["completed"] >= 2 and s["failed"] >= 4
    assert s["connection_errors"] == s["failed"]
    assert (req.loc[~req["success"], "error_kind"] == "connection").all()


def test_sharegpt_file_with_server_counted_prompts(sim: SimServer, tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": " ".join(["w"] * (3 + i))},
                                                   {"from": "gpt", "value": "answer"}]} for i in range(5)]))
    res = run_serving(sim.base_url, SGLangEngine(),
                      _cfg(dataset="sharegpt", dataset_path=str(path), num_prompts=5, random_output_len=3))
    req = res.requests
    assert req["planned_input_tokens"].isna().all()  # text prompts: the client does not tokenize
    # The sim counts one token per word; the table takes the server's count.
    assert sorted(req["input_tokens"].tolist()) == [3, 4, 5, 6, 7]
    assert isinstance(sim.state.bodies[0]["text"], str)
    assert (req["output_tokens"] == 3).all()


# --- issue 11: counts checked, whole-request deadline, API key --------------------------------

@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_lying_token_counts_fail_the_requests_instead_of_a_fast_tpot(sim: SimServer, engine) -> None:
    # The server streams 6 tokens per request but claims 15 times as many: trusted, that is a
    # TPOT 15 times too good (the fault campaign's 1.3 ms against an honest 20 ms, and a pass).
    sim.state.claim_factor = 15
    tables: dict = {}
    with pytest.raises(InsufficientDataError, match="all 12 requests failed"):
        run_serving(sim.base_url, engine, _cfg(random_range_ratio=1.0), partial=tables)
    partial = tables["serving_requests"]
    assert (partial["error_kind"] == "protocol").all()
    # Native: the count disagrees with the output ids streamed; OpenAI streams text only, so
    # the claim is caught against the 6 tokens the request asked for.
    expected = ("reported 90 completion tokens but its output ids add up to neither" if engine.protocol == "native"
                else "reported 90 completion tokens for a request of max tokens 6")
    assert partial["error"].str.contains(expected).all()
    assert partial["tpot_ms"].isna().all() and (partial["output_tokens"] == 0).all()


def test_native_count_ahead_of_the_streamed_ids_is_caught_even_under_the_limit(sim: SimServer) -> None:
    # 6 tokens streamed, 12 claimed, 40 asked for: under the limit, so only the ids show the lie.
    sim.state.claim_factor, sim.state.stop_after_tokens = 2, 6
    tables: dict = {}
    with pytest.raises(InsufficientDataError):
        run_serving(sim.base_url, SGLangEngine(), _cfg(num_prompts=3, random_output_len=40, random_range_ratio=1.0),
                    partial=tables)
    partial = tables["serving_requests"]
    assert (partial["error_kind"] == "protocol").all()
    assert partial["error"].str.contains("reported 12 completion tokens but its last chunk carries 6 output ids").all()


def test_dripping_server_fails_each_request_at_its_deadline(sim: SimServer) -> None:
    sim.state.drip_routes = {"/generate"}
    sim.state.drip_interval_s = 0.2
    started = time.monotonic()
    tables: dict = {}
    with pytest.raises(InsufficientDataError):
        run_serving(sim.base_url, SGLangEngine(), _cfg(num_prompts=2, request_timeout_s=1.0), partial=tables)
    assert time.monotonic() - started < 5.0
    partial = tables["serving_requests"]
    assert (partial["error_kind"] == "timeout").all()
    assert partial["error"].str.contains("deadline of 1 s").all()
    assert partial["error"].str.contains("raise serving.request_timeout_s").all()


@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_server_that_requires_an_api_key(sim: SimServer, engine) -> None:
    sim.state.api_key = "sekrit"
    res = run_serving(sim.base_url, engine, _cfg(num_prompts=4), api_key="sekrit")
    assert res.requests["success"].all()
    with pytest.raises((InsufficientDataError, StageError), match="401"):
        run_serving(sim.base_url, engine, _cfg(num_prompts=4))


class _StrictOpenAIEngine(VLLMEngine):
    """A server speaking OpenAI's schema strictly (transformers serve): the "openai-text" dialect."""

    protocol = "openai-text"  # type: ignore[assignment]


class _WordTokenizer:
    """Decodes each id to one word, so that the sim's word count is the planned length; records calls."""

    def __init__(self) -> None:
        self.decoded: list[list[int]] = []

    def decode(self, ids: list[int]) -> str:
        self.decoded.append(list(ids))
        return " ".join(f"w{i}" for i in ids)


def test_openai_text_decodes_id_prompts_before_the_clock(sim: SimServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import servegate.bench.serving as serving

    tokenizer = _WordTokenizer()
    decoded_when_load_began: list[int] = []
    run_load = serving._run_load

    async def timed_load(*args, **kwargs):
        # _run_load holds the clock (t0, the dispatcher, every request's send time): all decoding is done.
        decoded_when_load_began.append(len(tokenizer.decoded))
        return await run_load(*args, **kwargs)

    monkeypatch.setattr(serving, "_run_load", timed_load)
    res = run_serving(sim.base_url, _StrictOpenAIEngine(), _cfg(), tokenizer=tokenizer)
    req = res.requests
    assert decoded_when_load_began == [12] and len(tokenizer.decoded) == 12  # once per prompt, none after
    assert req["success"].all() and res.summary.iloc[0]["protocol"] == "openai-text"
    assert (req["input_tokens"] == req["planned_input_tokens"]).all()
    assert (req["output_tokens"] <= req["planned_output_tokens"]).all()
    bodies = sim.state.bodies
    assert len(bodies) == 12 and all(isinstance(b["prompt"], str) and "ignore_eos" not in b for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)


def test_openai_text_without_a_tokenizer_refuses_id_prompts(sim: SimServer) -> None:
    from servegate.errors import ConfigError

    with pytest.raises(ConfigError, match="text prompts only.*tokenizer"):
        run_serving(sim.base_url, _StrictOpenAIEngine(), _cfg())
    assert sim.state.bodies == []  # refused before any request


def test_openai_text_outputs_shorter_than_asked_are_measured_longer_ones_failed(sim: SimServer) -> None:
    # No ignore_eos: an EOS may end an output early (a measurement); a count above max_tokens is a lie.
    sim.state.stop_after_tokens = 2
    res = run_serving(sim.base_url, _StrictOpenAIEngine(), _cfg(random_output_len=6), tokenizer=_WordTokenizer())
    assert res.requests["success"].all() and (res.requests["output_tokens"] == 2).all()
    sim.state.stop_after_tokens, sim.state.claim_factor = None, 3
    tables: dict = {}
    with pytest.raises(InsufficientDataError, match="all 12 requests failed"):
        run_serving(sim.base_url, _StrictOpenAIEngine(), _cfg(random_range_ratio=1.0), tokenizer=_WordTokenizer(),
                    partial=tables)
    partial = tables["serving_requests"]
    assert (partial["error_kind"] == "protocol").all()
    assert partial["error"].str.contains("reported 18 completion tokens for a request of max tokens 6").all()


# --- issue 16: the worker's prefix-cache counters around the load -------------------------------

def _vllm_counters(n: int) -> dict:
    """vLLM v1's token counters, on two engine cores; each scrape after the first adds 600 queried
    prompt tokens of which 150 hit the prefix cache."""
    def cores(total: float) -> list:
        return [({"engine": "0"}, total / 2), ({"engine": "1"}, total / 2)]
    return {"vllm:prompt_tokens_total": cores(1000 + 600 * n), "vllm:prefix_cache_queries_total": cores(1000 + 600 * n),
            "vllm:prefix_cache_hits_total": cores(400 + 150 * n), "vllm:num_requests_running": cores(0)}


def test_vllm_prefix_cache_counters_are_scraped_around_the_load(sim: SimServer) -> None:
    sim.state.metrics = _vllm_counters
    res = run_serving(sim.base_url, VLLMEngine(), _cfg(num_prompts=4))
    s = res.summary.iloc[0]
    assert sim.state.scrapes == 2  # once before, once after the load
    assert s["prompt_tokens_scraped"] == 600 and s["cached_tokens"] == 150  # summed over the engine cores
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert res.meta["notes"] == []


def test_prefix_cache_counters_are_nan_with_a_note_where_the_worker_has_none(sim: SimServer) -> None:
    sim.state.metrics_status = 404  # metrics not enabled: the load still runs
    res = run_serving(sim.base_url, SGLangEngine(), _cfg(num_prompts=4))
    s = res.summary.iloc[0]
    assert res.requests["success"].all()
    assert math.isnan(s["prompt_tokens_scraped"]) and math.isnan(s["cached_tokens"])
    assert math.isnan(s["prefix_cache_hit_rate"])
    assert any("prefix-cache counters not scraped before the load" in n and "404" in n for n in res.meta["notes"])
    sim.state.metrics_status, sim.state.metrics = 200, {"sglang:num_running_reqs": [({}, 0.0)]}
    res = run_serving(sim.base_url, SGLangEngine(), _cfg(num_prompts=4))
    assert math.isnan(res.summary.iloc[0]["cached_tokens"])
    assert any("not on" in n and "sglang:cached_tokens_total" in n for n in res.meta["notes"])
    # A counter that went down (the worker restarted between the scrapes) gives no figure either.
    sim.state.metrics = lambda n: {"sglang:prompt_tokens_total": [({}, 500.0 - 100 * n)],
                                   "sglang:cached_tokens_total": [({}, 0.0)]}
    res = run_serving(sim.base_url, SGLangEngine(), _cfg(num_prompts=4))
    assert math.isnan(res.summary.iloc[0]["prefix_cache_hit_rate"])
    assert any("went down" in n for n in res.meta["notes"])


def test_serve_until_keeps_the_server_busy_with_fresh_prompts_and_drops_what_is_in_flight_when_told(
        sim: SimServer) -> None:
    # The paired duet's keep-busy load: the side whose block ended first serves on until the other's ends.
    sim.state.per_token_delay_s = 0.01  # a 30-token request: about 0.3 s
    until, served = threading.Event(), []
    cfg = _cfg(num_prompts=3, random_output_len=30, random_range_ratio=1.0)
    thread = threading.Thread(target=lambda: served.append(serve_until(sim.base_url, SGLangEngine(), cfg, until)))
    thread.start()
    deadline = time.monotonic() + 30
    while len(sim.state.bodies) < 9 and time.monotonic() < deadline:  # three loads of 3, one after the other
        time.sleep(0.01)
    assert len(sim.state.bodies) >= 9 and sim.state.peak_active == 3  # all at once, never more
    sent = len(sim.state.bodies)
    while len(sim.state.bodies) == sent and time.monotonic() < deadline:  # the next load has just begun
        time.sleep(0.001)
    time.sleep(0.05)
    until.set()  # with about 0.25 s of that load still to stream
    thread.join(10)
    assert not thread.is_alive() and served and served[0] >= 9
    # The 3 requests in flight were dropped, not run out (the others all completed).
    assert len(sim.state.bodies) == served[0] + 3
    while sim.state.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sim.state.active == 0
    prompts = [tuple(b["input_ids"]) for b in sim.state.bodies]
    assert len(set(prompts)) == len(prompts)  # fresh prompts each time


def test_serve_until_fails_when_the_server_stops_serving(sim: SimServer) -> None:
    sim.state.generate_status = 503
    with pytest.raises(StageError, match="a request keeping .* busy failed: HTTP 503"):
        serve_until(sim.base_url, SGLangEngine(), _cfg(num_prompts=2), threading.Event())
