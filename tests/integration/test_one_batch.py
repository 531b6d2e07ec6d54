"""Server-mode one-batch against the simulated server (real sockets, real SSE streams)."""

from __future__ import annotations

import math
import time

import pytest
import requests

from servegate.bench.one_batch import run_one_batch
from servegate.tables import ONE_BATCH_COLUMNS
from servegate.config import OneBatchConfig
from servegate.engines import SGLangEngine, VLLMEngine
from servegate.engines.base import ServerCapacity
from servegate.errors import ServerUnreachableError, StageError

from sim_server import SimServer, SimState, free_port

pytestmark = pytest.mark.timeout(60)

ENGINES = [SGLangEngine(), VLLMEngine()]
CONTRACT_COLUMNS = ["run_name", "mode", "batch_size", "input_len", "output_len", "status", "skip_reason",
                    "latency", "last_ttft", "ttft_ms", "input_throughput", "output_throughput",
                    "overall_throughput", "prefill_latency", "median_decode_latency", "error"]


@pytest.fixture
def sim():
    with SimServer(SimState(prefill_delay_s=0.03, per_token_delay_s=0.01)) as server:
        yield server


def _cfg(**kw) -> OneBatchConfig:
    return OneBatchConfig(**{"batch_sizes": [2], "input_lens": [32], "output_lens": [11], **kw})


@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_one_batch_numbers_follow_the_servers_clock(sim: SimServer, engine) -> None:
    df = run_one_batch(sim.base_url, engine, _cfg())
    assert set(CONTRACT_COLUMNS) <= set(df.columns) and list(df.columns) == ONE_BATCH_COLUMNS
    (row,) = df.to_dict("records")
    assert row["status"] == "measured" and row["mode"] == "server" and row["error"] is None
    # One batched request: the server saw both prompts in one body, streamed with ignore_eos.
    (body,) = sim.state.bodies
    if engine.protocol == "native":
        assert len(body["input_ids"]) == 2 and all(len(p) == 32 for p in body["input_ids"])
        assert body["sampling_params"] == {"max_new_tokens": 11, "temperature": 0.0, "ignore_eos": True}
    else:
        assert len(body["prompt"]) == 2 and body["max_tokens"] == 11 and body["ignore_eos"] is True
    assert body["stream"] is True
    # The sim's clock: first token after 30 ms, then 10 decode steps of 10 ms. Sleeps never
    # end early, so these lower bounds are exact; the upper bounds only catch nonsense.
    assert 0.03 <= row["last_ttft"] < 2.0
    assert row["ttft_ms"] == pytest.approx(row["last_ttft"] * 1000)
    assert row["first_ttft_ms"] <= row["ttft_ms"]
    assert 0.03 + 10 * 0.01 <= row["latency"] < 3.0
    assert row["total_output_tokens"] == 22
    # SGLang's formulas.
    assert row["input_throughput"] == pytest.approx(2 * 32 / row["last_ttft"])
    assert row["output_throughput"] == pytest.approx(22 / (row["latency"] - row["last_ttft"]))
    assert row["overall_throughput"] == pytest.approx(2 * (32 + 11) / row["latency"])
    assert row["output_throughput"] <= 22 / (10 * 0.01)  # cannot beat the configured decode step
    assert math.isnan(row["prefill_latency"]) and math.isnan(row["median_decode_latency"])


def test_capacity_checks_skip_with_reasons(sim: SimServer) -> None:
    sim.state.token_capacity = 500  # per rank
    sim.state.dp_size = 2           # -> 1000 tokens, 2 * 4 = 8 running requests
    sim.state.max_running_requests = 4
    cfg = _cfg(batch_sizes=[4, 16, 9], input_lens=[100], output_lens=[2], )
    df = run_one_batch(sim.base_url, SGLangEngine(), cfg)
    rows = df.set_index("batch_size")
    assert rows.loc[4, "status"] == "measured"  # 4 * 102 = 408 <= 1000
    assert rows.loc[16, "status"] == "skipped"
    assert "max running requests 8" in rows.loc[16, "skip_reason"]
    assert rows.loc[9, "status"] == "skipped"
    assert "batch_size 9 > max running requests 8" in rows.loc[9, "skip_reason"]
    assert rows.loc[4, "token_capacity"] == 1000 and rows.loc[4, "max_running_requests"] == 8

    df = run_one_batch(sim.base_url, SGLangEngine(), _cfg(batch_sizes=[8], input_lens=[200], output_lens=[2]))
    (row,) = df.to_dict("records")
    assert row["status"] == "skipped"
    assert "= 1616 > token capacity 1000" in row["skip_reason"]
    assert "skip_token_capacity_check" in row["skip_reason"]
    assert math.isnan(row["latency"])


def test_opt_out_of_token_check_keeps_the_running_requests_check(sim: SimServer) -> None:
    sim.state.token_capacity = 100
    sim.state.max_running_requests = 4
    cfg = _cfg(batch_sizes=[2, 8], input_lens=[100], output_lens=[2], skip_token_capacity_check=True)
    df = run_one_batch(sim.base_url, SGLangEngine(), cfg).set_index("batch_size")
    assert df.loc[2, "status"] == "measured"  # 204 tokens > 100, but the check is off
    assert df.loc[8, "status"] == "skipped" and "max running requests 4" in df.loc[8, "skip_reason"]


def test_output_len_one_has_no_decode_throughput(sim: SimServer) -> None:
    (row,) = run_one_batch(sim.base_url, SGLangEngine(), _cfg(output_lens=[1])).to_dict("records")
    assert row["status"] == "measured" and math.isnan(row["output_throughput"])
    assert row["overall_throughput"] > 0


@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_http_error_is_a_failed_row(sim: SimServer, engine) -> None:
    sim.state.generate_status = 500
    df = run_one_batch(sim.base_url, engine, _cfg(batch_sizes=[1, 2]))
    assert df["status"].tolist() == ["failed", "failed"]
    assert "HTTP 500" in df["error"].iloc[0] and "simulated failure" in df["error"].iloc[0]
    assert df["latency"].isna().all()


def test_cut_stream_is_a_failed_row(sim: SimServer) -> None:
    sim.state.cut_stream_after_tokens = 3
    (row,) = run_one_batch(sim.base_url, SGLangEngine(), _cfg()).to_dict("records")
    assert row["status"] == "failed" and "stream ended before [DONE]" in row["error"]


@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_server_that_requires_an_api_key(sim: SimServer, engine) -> None:
    # Like SGLang and the embedded worker, the sim guards every route but health and metrics,
    # server info included: the key must be on every request one_batch makes (issue 11 #14).
    sim.state.api_key = "sekrit"
    (row,) = run_one_batch(sim.base_url, engine, _cfg(), api_key="sekrit").to_dict("records")
    assert row["status"] == "measured"
    with pytest.raises(StageError, match="401"):
        run_one_batch(sim.base_url, engine, _cfg(), api_key="wrong")


def test_unreachable_server_raises_with_empty_partial() -> None:
    partial: dict = {}
    with pytest.raises(ServerUnreachableError) as info:
        run_one_batch(f"http://127.0.0.1:{free_port()}", SGLangEngine(), _cfg(), partial=partial)
    assert not hasattr(info.value, "partial")  # partial results travel in the caller's dict, not on exceptions
    assert partial["one_batch"].empty and list(partial["one_batch"].columns) == ONE_BATCH_COLUMNS


class DyingSGLang(SGLangEngine):
    """Reports capacity, then takes the server down before the second case is sent."""

    def __init__(self, sim: SimServer) -> None:
        self.sim, self.calls = sim, 0

    def server_capacity(self, session: requests.Session, base_url: str) -> ServerCapacity:
        cap = super().server_capacity(session, base_url)
        self.calls += 1
        if self.calls == 2:
            session.close()  # drop the kept-alive connection along with the server
            self.sim.stop()
        return cap


def test_worker_gone_mid_grid_keeps_the_rows_measured() -> None:
    sim = SimServer(SimState(prefill_delay_s=0.01, per_token_delay_s=0.002)).start()
    tables: dict = {}
    try:
        with pytest.raises(ServerUnreachableError, match="worker is gone"):
            run_one_batch(sim.base_url, DyingSGLang(sim), _cfg(batch_sizes=[1, 2, 4]), partial=tables)
    finally:
        sim.stop()
    partial = tables["one_batch"]
    assert partial["batch_size"].tolist() == [1] and partial["status"].tolist() == ["measured"]


def test_repeats_measure_each_case_again_with_fresh_prompts(sim: SimServer) -> None:
    sim.state.max_running_requests = 4
    df = run_one_batch(sim.base_url, SGLangEngine(), _cfg(batch_sizes=[1, 16], output_lens=[3], repeats=3))
    measured = df[df["status"] == "measured"]
    assert list(measured["repeat"]) == [0, 1, 2] and (measured["batch_size"] == 1).all()
    skipped = df[df["status"] == "skipped"]
    assert len(skipped) == 1 and skipped["repeat"].tolist() == [0]  # a case that cannot run: one row
    prompts = [tuple(b["input_ids"][0]) for b in sim.state.bodies]
    assert len(prompts) == 3 and len(set(prompts)) == 3  # no repeat is served from the prefix cache
    # Repeat 0 sends what a single measurement of the case sends (a re-run of one case matches).
    single = run_one_batch(sim.base_url, SGLangEngine(), _cfg(batch_sizes=[1], output_lens=[3]))
    assert tuple(sim.state.bodies[-1]["input_ids"][0]) == prompts[0] and single["repeat"].tolist() == [0]


@pytest.mark.parametrize("engine", ENGINES, ids=["native", "openai"])
def test_lying_token_counts_are_a_failed_row(sim: SimServer, engine) -> None:
    sim.state.claim_factor = 3
    (row,) = run_one_batch(sim.base_url, engine, _cfg()).to_dict("records")
    assert row["status"] == "failed" and math.isnan(row["output_throughput"])
    if engine.protocol == "native":  # 11 ids streamed per prompt, 33 claimed
        assert "reported 33 completion tokens but its last chunk carries 11 output ids" in row["error"]
    else:  # a batch of 2 x 11 tokens claimed as 66
        assert "reported 66 completion tokens for the batch batch_size=2 input_len=32 output_len=11" in row["error"]


@pytest.mark.timeout(30)
def test_dripping_server_fails_the_case_at_its_deadline(sim: SimServer) -> None:
    sim.state.drip_routes = {"/generate"}
    sim.state.drip_interval_s = 0.2  # a byte well inside every read timeout, forever
    started = time.monotonic()
    (row,) = run_one_batch(sim.base_url, SGLangEngine(), _cfg(request_timeout_s=1.0)).to_dict("records")
    assert time.monotonic() - started < 5.0
    assert row["status"] == "failed"
    assert "one_batch case batch_size=2 input_len=32 output_len=11" in row["error"]
    assert "deadline of 1 s" in row["error"] and "raise one_batch.request_timeout_s" in row["error"]
