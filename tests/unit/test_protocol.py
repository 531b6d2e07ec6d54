"""The wire protocol objects: request bodies, streamed chunks -> events and counts, checked
token counts, log-probability requests and answers, for SGLang-native, OpenAI (vLLM) and its
strict-schema dialect "openai-text" (transformers serve)."""

from __future__ import annotations

import math

import orjson
import pytest

from servegate.bench.protocol import (
    NATIVE,
    OPENAI,
    OPENAI_TEXT,
    PROTOCOLS,
    NativeProtocol,
    OpenAIProtocol,
    OpenAITextProtocol,
    WireProtocol,
    protocol_for,
    protocol_named,
)
from servegate.engines import EmbeddedEngine, ExternalEngine, SGLangEngine, TransformersServeEngine, VLLMEngine
from servegate.errors import ConfigError, StageError

pytestmark = pytest.mark.timeout(30)


# --- which protocol ------------------------------------------------------------------------

@pytest.mark.parametrize("engine,expected", [(SGLangEngine(), NATIVE), (EmbeddedEngine(), NATIVE),
                                             (VLLMEngine(), OPENAI), (ExternalEngine(), OPENAI),
                                             (TransformersServeEngine(), OPENAI_TEXT)],
                         ids=["sglang", "embedded", "vllm", "external", "transformers"])
def test_protocol_for_each_engine(engine, expected: WireProtocol) -> None:
    assert protocol_for(engine) is expected
    assert protocol_for(engine).name == engine.protocol  # the engine keeps its name attribute


def test_override_and_unknown_names() -> None:
    assert protocol_for(SGLangEngine(), "openai") is OPENAI  # serving.protocol: OpenAI routes on SGLang
    assert set(PROTOCOLS) == {"native", "openai", "openai-text"}
    with pytest.raises(ConfigError,
                       match=r"unknown protocol 'grpc'; choose one of \['native', 'openai', 'openai-text'\]"):
        protocol_named("grpc")


def test_urls_and_model_names() -> None:
    assert NATIVE.url("http://h:1/") == "http://h:1/generate"
    assert OPENAI.url("http://h:1") == "http://h:1/v1/completions"
    assert not NATIVE.needs_model and OPENAI.needs_model
    # The native protocol names no model, so it asks the server nothing (no session needed).
    assert NATIVE.served_model(None, "http://h:1", limit_s=1.0, setting=None) is None  # type: ignore[arg-type]


# --- request bodies --------------------------------------------------------------------------

def test_native_bodies() -> None:
    assert NATIVE.body([[1, 2], [3, 4]], 5, stream=True) == {
        "input_ids": [[1, 2], [3, 4]], "stream": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    assert NATIVE.body("hello", 7, stream=False, model="ignored")["text"] == "hello"
    # None leaves a field to the server's default (warmup's plain request).
    assert NATIVE.body("hi", 3, stream=None, ignore_eos=None) == {
        "text": "hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}


def test_openai_bodies() -> None:
    body = OPENAI.body([[1, 2, 3]], 4, model="m", stream=True)
    assert body["model"] == "m" and body["prompt"] == [[1, 2, 3]] and body["max_tokens"] == 4
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert OPENAI.body("hi", 8, model="m", stream=None, ignore_eos=None) == {
        "model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0.0}
    plain = OPENAI.body("hi", 8, model="m", stream=False)
    assert plain["stream"] is False and "stream_options" not in plain
    with pytest.raises(ConfigError, match="needs the served model's name"):
        OPENAI.body("hi", 8, stream=True)


# --- whole answers (warmup) -----------------------------------------------------------------------

def test_native_answers() -> None:
    assert NATIVE.has_output({"text": "x", "meta_info": {}})
    assert not NATIVE.has_output({"text": "", "output_ids": [], "meta_info": {"completion_tokens": 0}})
    assert not NATIVE.has_output(["not", "a", "dict"])
    NATIVE.check_counts({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2}}, 2, "w")
    with pytest.raises(StageError, match="reported 3 completion tokens for w but returned 2 output ids"):
        NATIVE.check_counts({"output_ids": [1, 2], "meta_info": {"completion_tokens": 3}}, 8, "w")
    with pytest.raises(StageError, match="which asked for at most 1"):
        NATIVE.check_counts({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2}}, 1, "w")


def test_openai_answers() -> None:
    assert OPENAI.has_output({"choices": [{"text": "x"}]})
    assert OPENAI.has_output({"choices": [{"text": ""}], "usage": {"completion_tokens": 1}})
    assert not OPENAI.has_output({"choices": []})
    OPENAI.check_counts({"usage": {"completion_tokens": 4}}, 4, "w")
    with pytest.raises(StageError, match="reported 5 completion tokens for w"):
        OPENAI.check_counts({"usage": {"completion_tokens": 5}}, 4, "w")


# --- streamed chunks -> events --------------------------------------------------------------------

def test_chunk_events_for_both_protocols() -> None:
    (ev,) = NATIVE.events({"index": 2, "output_ids": [5, 6], "meta_info": {"completion_tokens": 2,
                                                                            "prompt_tokens": 9}})
    assert (ev.index, ev.completion_tokens, ev.prompt_tokens, ev.output_ids, ev.finished) == (2, 2, 9, 2, False)
    events = OPENAI.events({"choices": [{"index": 0, "text": "a", "finish_reason": None},
                                        {"index": 1, "text": "", "finish_reason": "length"}]})
    assert [e.index for e in events] == [0]  # a finish-only choice carries no token
    # vLLM groups several tokens in one chunk (speculative decoding): the cumulative usage says how many.
    (grouped,) = OPENAI.events({"choices": [{"index": 0, "text": "abc", "finish_reason": None}],
                                "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    assert grouped.completion_tokens == 3 and grouped.prompt_tokens == 4
    for wire in (NATIVE, OPENAI):
        with pytest.raises(StageError, match="server reported an error in the stream: boom"):
            wire.events({"error": {"message": "boom"}})


# --- the serving hot path: TokenStream ------------------------------------------------------------

def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _openai_chunk(text: str, usage: int | None, finish: str | None = None) -> bytes:
    obj: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = {"prompt_tokens": 4, "completion_tokens": usage}
    return _sse(obj)


def test_openai_token_stream_with_vllm_grouped_tokens() -> None:
    stream = OPENAI.token_stream()
    stream.feed(_openai_chunk("a", 1), 1.0)
    stream.feed(_openai_chunk("bcd", 4), 2.0)  # three tokens in one chunk
    stream.feed(_openai_chunk("e", 5) + _openai_chunk("", 5, "length"), 3.0)
    stream.feed(_sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5}}), 3.5)
    assert stream.feed(b"data: [DONE]\n\n", 4.0)
    assert stream.counts == [1, 4, 5] and stream.times == [1.0, 2.0, 3.0]
    assert stream.output_tokens == 5 and stream.final_prompt_tokens() == 4
    assert stream.count_error(5) is None
    assert "reported 5 completion tokens" in stream.count_error(4)


def test_openai_token_stream_grouped_tokens_without_per_chunk_usage() -> None:
    # Without continuous_usage_stats a grouped chunk looks like one token; the final usage decides
    # the count, and nothing contradicts it.
    stream = OPENAI.token_stream()
    stream.feed(_openai_chunk("ab", None) + _openai_chunk("cd", None), 1.0)
    stream.feed(_sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4}}) + b"data: [DONE]\n\n",
                2.0)
    assert stream.counts == [2] and stream.output_tokens == 4 and stream.count_error(4) is None
    assert stream.final_prompt_tokens() == 4


def test_native_token_stream_reads_counts_and_holds_them_to_the_ids() -> None:
    def chunk(n: int, claimed: int | None = None) -> bytes:
        return _sse({"text": "x" * n, "output_ids": list(range(n)),
                     "meta_info": {"prompt_tokens": 7, "completion_tokens": claimed if claimed is not None else n}})

    stream = NATIVE.token_stream()
    stream.feed(chunk(1) + chunk(3), 1.0)  # two tokens in the second chunk
    assert stream.feed(chunk(4) + b"data: [DONE]\n\n", 2.0)
    assert stream.counts == [3, 4] and stream.output_tokens == 4  # one arrival per read
    assert stream.final_prompt_tokens() == 7 and stream.count_error(4) is None
    liar = NATIVE.token_stream()
    liar.feed(chunk(1) + chunk(2) + chunk(3, claimed=30) + b"data: [DONE]\n\n", 1.0)
    assert "reported 30 completion tokens but its last chunk carries 3 output ids" in liar.count_error(64)


# --- the one-batch stage: BatchTally ---------------------------------------------------------------

def test_native_batch_tally() -> None:
    tally = NATIVE.batch_tally(2, 3)
    for i, (index, n) in enumerate([(0, 1), (1, 1), (0, 3), (1, 3)]):
        tally.take({"index": index, "output_ids": list(range(n)), "meta_info": {"completion_tokens": n}}, float(i))
    tally.check("case")
    assert tally.first_token_at == {0: 0.0, 1: 1.0} and tally.output_tokens() == 6
    lying = NATIVE.batch_tally(1, 8)
    lying.take({"index": 0, "output_ids": [1, 2], "meta_info": {"completion_tokens": 5}}, 0.0)
    with pytest.raises(StageError, match="reported 5 completion tokens but its output ids add up to neither"):
        lying.check("case")


def test_openai_batch_tally_counts_from_the_final_usage() -> None:
    tally = OPENAI.batch_tally(2, 3)
    tally.take({"choices": [{"index": 1, "text": "a", "finish_reason": None},
                            {"index": 0, "text": "b", "finish_reason": None}]}, 1.0)
    tally.take({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 6}}, 2.0)
    tally.check("case")
    assert tally.first_token_at == {0: 1.0, 1: 1.0} and tally.output_tokens() == 6
    no_usage = OPENAI.batch_tally(2, 3)
    no_usage.take({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}, 1.0)
    assert no_usage.output_tokens() == 6  # batch_size * max_tokens when the server counts nothing
    claims = OPENAI.batch_tally(2, 3)
    claims.take({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 90}}, 1.0)
    with pytest.raises(StageError, match="reported 90 completion tokens for the batch case, which asked for at most 6"):
        claims.check("case")


# --- log-probabilities (quality) -------------------------------------------------------------------

def test_native_scoring_request_and_answer() -> None:
    body = NATIVE.scoring_body([1, 2, 3], [[4], [5, 6]])
    assert body["input_ids"] == [[1, 2, 3, 4], [1, 2, 3, 5, 6]] and body["logprob_start_len"] == 2
    assert body["return_logprob"] is True and body["sampling_params"]["max_new_tokens"] == 0
    doc = [{"meta_info": {"input_token_logprobs": [[None, 3, None], [-0.5, 4, None]]}},
           {"meta_info": {"input_token_logprobs": [[None, 3, None], [-1.0, 5, None], [None, 6, None]]}}]
    values = NATIVE.ending_logprobs(doc, [1, 2, 3], [[4], [5, 6]], "item 0")
    assert values[0] == [-0.5] and values[1][0] == -1.0 and math.isnan(values[1][1])
    with pytest.raises(StageError, match=r"item 0: the server scored tokens \[9\] where the ending is \[4\]"):
        NATIVE.ending_logprobs([{"meta_info": {"input_token_logprobs": [[-0.1, 9, None]]}}], [1], [[4]], "item 0")
    with pytest.raises(StageError, match="return_logprob / logprob_start_len"):
        NATIVE.ending_logprobs([{"meta_info": {}}], [1], [[4]], "item 0")


def test_openai_scoring_request_and_answer() -> None:
    body = OPENAI.scoring_body([1, 2], [[3], [4, 5]], "m")
    assert body == {"model": "m", "prompt": [[1, 2, 3], [1, 2, 4, 5]], "max_tokens": 1, "temperature": 0.0,
                    "echo": True, "logprobs": 1}
    doc = {"choices": [{"index": 1, "logprobs": {"token_logprobs": [None, -0.1, -0.2, -0.3, -9.0]}},
                       {"index": 0, "logprobs": {"token_logprobs": [None, -0.1, -0.4, -9.0]}}]}
    assert OPENAI.ending_logprobs(doc, [1, 2], [[3], [4, 5]], "item 0") == [[-0.4], [-0.2, -0.3]]
    with pytest.raises(StageError, match="echo \\+ logprobs"):
        OPENAI.ending_logprobs({"choices": [{"index": 0, "logprobs": None}]}, [1], [[2]], "item 0")
    with pytest.raises(ConfigError):
        OPENAI.scoring_body([1], [[2]])


def test_greedy_requests_and_answers() -> None:
    assert NATIVE.greedy_body([[1, 2]], 4)["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0,
                                                                   "ignore_eos": True}
    native = [{"output_ids": [7, 8], "meta_info": {"output_token_logprobs": [[-0.5, 7, None], [None, 8, None]]}}]
    assert NATIVE.greedy_outputs(native, 1, "agree") == [([7, 8], [-0.5, None])]
    with pytest.raises(StageError, match="one result per prompt"):
        NATIVE.greedy_outputs(native, 2, "agree")
    body = OPENAI.greedy_body([[1, 2]], 4, "m")
    assert body["return_tokens_as_token_ids"] is True and body["ignore_eos"] is True and "echo" not in body
    doc = {"choices": [{"index": 1, "logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.2]}},
                       {"index": 0, "logprobs": {"tokens": ["token_id:7", 8], "token_logprobs": [-0.5, None]}}]}
    assert OPENAI.greedy_outputs(doc, 2, "agree") == [([7, 8], [-0.5, None]), ([9], [-0.2])]
    with pytest.raises(StageError, match="return_tokens_as_token_ids"):
        OPENAI.greedy_outputs({"choices": [{"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}]}, 1, "a")


def test_protocol_objects_are_the_only_three() -> None:
    assert isinstance(NATIVE, NativeProtocol) and isinstance(OPENAI, OpenAIProtocol)
    assert isinstance(OPENAI_TEXT, OpenAITextProtocol)
    assert {type(p) for p in PROTOCOLS.values()} == {NativeProtocol, OpenAIProtocol, OpenAITextProtocol}
    assert [p.name for p in PROTOCOLS.values() if p.needs_text_prompts] == ["openai-text"]


# --- openai-text: OpenAI's schema strictly (transformers serve) -------------------------------------

def test_openai_text_body_has_a_text_prompt_and_no_ignore_eos() -> None:
    # transformers serve 5.23: ignore_eos is 422 "Unexpected fields", a token-id prompt or a list 400.
    body = OPENAI_TEXT.body("hello there", 16, model="servegate/smollm2-135m", stream=True)
    assert body == {"model": "servegate/smollm2-135m", "prompt": "hello there", "max_tokens": 16,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    # Asked for ignore_eos (serving's default) or not (warmup's None): never sent.
    assert "ignore_eos" not in OPENAI_TEXT.body("hi", 4, model="m", stream=None, ignore_eos=True)
    assert OPENAI_TEXT.body("hi", 4, model="m", stream=None, ignore_eos=None) == {
        "model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0.0}
    with pytest.raises(ConfigError, match="text prompts only.*as_text_prompts"):
        OPENAI_TEXT.body([101, 102], 4, model="m", stream=True)
    with pytest.raises(ConfigError, match="one prompt per request.*takes_prompt_batches"):
        OPENAI_TEXT.body(["a", "b"], 4, model="m", stream=True)
    with pytest.raises(ConfigError, match="takes_prompt_batches"):
        OPENAI_TEXT.batch_tally(2, 4)
    with pytest.raises(ConfigError, match="needs the served model's name"):
        OPENAI_TEXT.body("hi", 8, stream=True)
    assert OPENAI_TEXT.url("http://h:1") == "http://h:1/v1/completions" and OPENAI_TEXT.needs_model


def _transformers_chunk(text: str) -> bytes:
    # transformers serve dumps chunks with exclude_none: a token chunk has no finish_reason key at all.
    return _sse({"id": "req-1", "object": "text_completion", "created": 1, "model": "m",
                 "choices": [{"text": text, "index": 0}]})


def _transformers_finish(completion: int, reason: str = "length") -> bytes:
    return _sse({"id": "req-1", "object": "text_completion", "created": 1, "model": "m",
                 "choices": [{"text": "", "index": 0, "finish_reason": reason}],
                 "usage": {"prompt_tokens": 9, "completion_tokens": completion, "total_tokens": 9 + completion}})


def test_openai_text_stream_ends_at_the_finish_chunk_with_usage() -> None:
    stream = OPENAI_TEXT.token_stream()
    assert not stream.feed(_transformers_chunk(" a") + _transformers_chunk(" b"), 1.0)
    assert not stream.feed(_transformers_chunk(" c"), 2.0)
    assert stream.feed(_transformers_finish(3), 3.0)  # no [DONE] follows: the finish chunk ends it
    assert stream.done and stream.end_ts == 3.0
    assert stream.counts == [2, 3] and stream.times == [1.0, 2.0]  # one arrival per read
    assert stream.output_tokens == 3 and stream.final_prompt_tokens() == 9
    # Without ignore_eos the output is *up to* max_tokens: fewer is a measurement, more a lie.
    assert stream.count_error(16) is None and stream.count_error(3) is None
    assert "reported 3 completion tokens" in stream.count_error(2)


def test_openai_text_stream_ended_by_eos_or_done_and_cut_streams() -> None:
    eos = OPENAI_TEXT.token_stream()
    eos.feed(_transformers_chunk(" a"), 1.0)
    assert eos.feed(_transformers_finish(1, "stop"), 2.0) and eos.count_error(16) is None
    # A [DONE] that does come (a server that sends it) ends the stream too.
    done = OPENAI_TEXT.token_stream()
    done.feed(_openai_chunk("a", None) + _openai_chunk("", None, "length"), 1.0)
    assert done.feed(b"data: [DONE]\n\n", 2.0) and done.output_tokens == 1
    # Cut before the finish chunk: not done (serving makes it a failed request, error_kind "stream").
    cut = OPENAI_TEXT.token_stream()
    assert not cut.feed(_transformers_chunk(" a") + _transformers_chunk(" b"), 1.0)
    cut.close()
    assert not cut.done
    # An error chunk (transformers serve's {"error": ...}) fails the request.
    broken = OPENAI_TEXT.token_stream()
    with pytest.raises(StageError, match="server reported an error in the stream: CUDA out of memory"):
        broken.feed(_sse({"error": "CUDA out of memory"}), 1.0)
    # The plain OpenAI stream still waits for [DONE] after the same finish chunk.
    plain = OPENAI.token_stream()
    plain.feed(_transformers_chunk(" a"), 1.0)
    assert not plain.feed(_transformers_finish(1), 2.0)
