"""Parsing of /metrics pages and SSE lines: NaN samples, several ranks, malformed input."""

from __future__ import annotations

import math

import pytest

from servegate.bench import protocol as proto
from servegate.bench.occupancy import accept_length_between, aggregate_scrape, counter_totals, parse_metrics_page
from servegate.engines.sglang import SGLANG_METRIC_NAMES
from servegate.engines.vllm import VLLM_METRIC_NAMES, VLLM_SPEC_DECODE_COUNTERS
from servegate.errors import MetricsError, StageError

PAGE = """\
# HELP sglang:fwd_occupancy Percent of wall time in forward passes.
# TYPE sglang:fwd_occupancy gauge
sglang:fwd_occupancy{model_name="m",tp_rank="0"} 91.5
sglang:fwd_occupancy{model_name="m",tp_rank="1"} NaN
sglang:fwd_occupancy{model_name="m",tp_rank="2"} 42.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.25
sglang:token_usage{model_name="m",tp_rank="1"} 0.5
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="m",tp_rank="0"} NaN
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m",tp_rank="0"} 1234.0
"""


def test_parse_keeps_every_label_set_and_nan() -> None:
    values = parse_metrics_page(PAGE, "http://x/metrics")
    occ = values["sglang:fwd_occupancy"]
    assert len(occ) == 3 and occ[0] == 91.5 and math.isnan(occ[1]) and occ[2] == 42.0
    assert values["sglang:prompt_tokens_total"] == [1234.0]


def test_aggregate_min_occupancy_max_usage_and_nan_for_absent() -> None:
    agg = aggregate_scrape(parse_metrics_page(PAGE, "u"), SGLANG_METRIC_NAMES)
    assert agg["fwd_occupancy"] == 42.0  # the degraded rank shows; the NaN rank is dropped
    assert agg["token_usage"] == 0.5
    assert agg["num_running_reqs"] == 3.0
    assert math.isnan(agg["spec_accept_length"])  # present but NaN on every rank
    assert math.isnan(agg["num_queue_reqs"])  # absent
    assert math.isnan(agg["kv_cache_usage"])  # not an SGLang metric


def test_aggregate_for_an_engine_without_occupancy() -> None:
    page = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 5\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.125\n')
    agg = aggregate_scrape(parse_metrics_page(page, "u"), VLLM_METRIC_NAMES)
    assert math.isnan(agg["fwd_occupancy"])
    assert agg["num_running_reqs"] == 5.0 and agg["kv_cache_usage"] == 0.125


@pytest.mark.parametrize("page", ['sglang:fwd_occupancy{tp_rank="0" 12 oops\n', "<html>hi</html>\n",
                                  "a b c d\n"])
def test_malformed_page_names_the_url(page: str) -> None:
    with pytest.raises(MetricsError, match="http://host:1/metrics is not a valid Prometheus"):
        parse_metrics_page(page, "http://host:1/metrics")


def test_sse_lines() -> None:
    assert proto.parse_sse_line(b"") is None
    assert proto.parse_sse_line(b": keep-alive") is None
    assert proto.parse_sse_line(b"data: [DONE]\n") is proto.SSE_DONE
    assert proto.parse_sse_line(b'data: {"a": 1}\r\n') == {"a": 1}
    assert proto.parse_sse_line(b'data:{"a":2}') == {"a": 2}
    with pytest.raises(StageError, match="not JSON"):
        proto.parse_sse_line(b"data: {broken")
    with pytest.raises(StageError, match="not a JSON object"):
        proto.parse_sse_line(b"data: [1, 2]")


def test_stream_chunks_to_events() -> None:
    ev = proto.native_event({"text": "x", "index": 3, "meta_info": {"completion_tokens": 7, "prompt_tokens": 9,
                                                                   "finish_reason": None}})
    assert (ev.index, ev.completion_tokens, ev.prompt_tokens, ev.finished) == (3, 7, 9, False)
    with pytest.raises(StageError, match="server reported an error"):
        proto.native_event({"error": {"message": "out of memory"}})
    evs = proto.openai_events({"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "",
                                                                        "finish_reason": "length"}]})
    assert [e.index for e in evs] == [0]  # a finish-only choice carries no token
    assert proto.openai_usage({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 8}}) == (4, 8)
    with pytest.raises(StageError):
        proto.native_event({"meta_info": {"completion_tokens": "many"}})


def test_request_bodies() -> None:
    body = proto.native_generate_body([[1, 2], [3, 4]], 5, stream=True)
    assert body == {"input_ids": [[1, 2], [3, 4]], "stream": True,
                    "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    assert "text" in proto.native_generate_body("hello", 5, stream=False)
    body = proto.openai_completions_body("m", [1, 2, 3], 4, stream=True)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4 and body["ignore_eos"] is True
    assert body["stream_options"]["include_usage"] is True
    assert "stream_options" not in proto.openai_completions_body("m", "hi", 4, stream=False)


def _vllm_spec_page(drafts: tuple[int, int], draft_tokens: tuple[int, int], accepted: tuple[int, int]) -> str:
    """A /metrics page as vLLM writes it: prometheus_client counters (vllm/v1/spec_decode/metrics.py,
    SpecDecodingProm) per engine, exposed with their `_total` and `_created` samples."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    for name, values in (("vllm:spec_decode_num_drafts", drafts), ("vllm:spec_decode_num_draft_tokens", draft_tokens),
                         ("vllm:spec_decode_num_accepted_tokens", accepted)):
        counter = Counter(name, "doc", labelnames=["model_name", "engine"], registry=registry)
        for engine, value in enumerate(values):
            counter.labels("m", str(engine)).inc(value)
    return generate_latest(registry).decode()


def test_vllm_accept_length_from_counter_increments() -> None:
    before = counter_totals(parse_metrics_page(_vllm_spec_page((10, 0), (40, 0), (20, 0)), "u"),
                            VLLM_SPEC_DECODE_COUNTERS)
    assert before == {"drafts": 10.0, "draft_tokens": 40.0, "accepted": 20.0}  # summed over engines
    after = counter_totals(parse_metrics_page(_vllm_spec_page((30, 20), (120, 80), (50, 60)), "u"),
                           VLLM_SPEC_DECODE_COUNTERS)
    # 1 + (110 - 20) / (50 - 10): vLLM's mean acceptance length, bonus token included
    assert accept_length_between(before, after) == pytest.approx(1 + 90 / 40)


def test_vllm_accept_length_without_drafts_is_nan_not_one() -> None:
    page = counter_totals(parse_metrics_page(_vllm_spec_page((10, 0), (40, 0), (20, 0)), "u"),
                          VLLM_SPEC_DECODE_COUNTERS)
    assert math.isnan(accept_length_between(page, page))  # no draft verified in between
    restarted = {"drafts": 1.0, "draft_tokens": 4.0, "accepted": 0.0}
    assert math.isnan(accept_length_between(page, restarted))  # counters went back: a restart
    absent = counter_totals(parse_metrics_page("vllm:num_requests_running 1\n", "u"), VLLM_SPEC_DECODE_COUNTERS)
    assert all(math.isnan(v) for v in absent.values())  # speculation off: no counters at all
    assert math.isnan(accept_length_between(absent, absent))
