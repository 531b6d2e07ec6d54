"""The worker's HTTP surface against one real worker process (tiny model, float32)."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import requests
from workerutil import generate, metric_value, scrape, sse_events

pytestmark = pytest.mark.timeout(180)

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(start_worker) -> str:
    return start_worker(["--enable-metrics", "--max-total-tokens", "4096", "--max-running-requests", "4",
                         "--decode-log-interval", "4"]).url


def test_health_and_health_generate(url: str) -> None:
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/health_generate", timeout=60).status_code == 200


def test_generate_text_non_streaming(url: str) -> None:
    resp = generate(url, {"text": PROMPT, "sampling_params": GREEDY})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert len(doc["output_ids"]) == 8
    assert isinstance(doc["text"], str) and doc["text"]
    meta = doc["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8
    assert meta["prompt_tokens"] == 5
    assert meta["e2e_latency"] > 0
    assert isinstance(meta["id"], str) and meta["id"]
    again = generate(url, {"text": PROMPT, "sampling_params": GREEDY}).json()
    assert again["output_ids"] == doc["output_ids"]  # greedy is deterministic


def test_generate_batched_input_ids(url: str) -> None:
    prompts = [[504, 3575, 282, 4649, 314], [19556, 28, 919]]
    resp = generate(url, {"input_ids": prompts, "sampling_params": {**GREEDY, "max_new_tokens": 3}})
    assert resp.status_code == 200, resp.text
    docs = resp.json()
    assert isinstance(docs, list) and len(docs) == 2
    assert [d["meta_info"]["prompt_tokens"] for d in docs] == [5, 3]
    assert all(len(d["output_ids"]) == 3 for d in docs)


def test_batched_output_equals_solo_output(url: str) -> None:
    """Continuous batching must not change greedy results: requests joining mid-flight agree with solo runs."""
    prompts = ["Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,", "Hello there, my name is"]
    solo = [generate(url, {"text": p, "sampling_params": {**GREEDY, "max_new_tokens": 12}}).json()["output_ids"]
            for p in prompts]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        time.sleep(0.03 * i)  # staggered: later requests join a running batch
        body = {"text": prompts[i], "sampling_params": {**GREEDY, "max_new_tokens": 12}}
        results[i] = generate(url, body).json()["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(len(prompts))] == solo


def test_generate_streaming_sse(url: str) -> None:
    with generate(url, {"text": PROMPT, "stream": True, "sampling_params": GREEDY}, stream=True) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks, "no data chunks before [DONE]"
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 8  # cumulative, like SGLang
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    solo = generate(url, {"text": PROMPT, "sampling_params": GREEDY}).json()
    assert chunks[-1]["output_ids"] == solo["output_ids"]
    assert chunks[-1]["text"] == solo["text"]


def test_generate_streaming_batch_carries_index(url: str) -> None:
    body = {"text": ["Hi", "Hello"], "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 3}}
    with generate(url, body, stream=True) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    finals = {}
    for chunk in map(json.loads, events[:-1]):
        if chunk["meta_info"]["finish_reason"] is not None:
            finals[chunk["index"]] = chunk
    assert sorted(finals) == [0, 1]
    assert all(len(c["output_ids"]) == 3 for c in finals.values())


def test_stop_token_and_stop_string(url: str) -> None:
    base = generate(url, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 6}}).json()
    stop_tok = base["output_ids"][2]
    first = base["output_ids"].index(stop_tok)
    doc = generate(url, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 6,
                                                                  "stop_token_ids": [stop_tok]}}).json()
    assert doc["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert doc["output_ids"] == base["output_ids"][:first + 1]

    stop_str = base["text"][-4:]
    doc = generate(url, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 6,
                                                                  "stop": [stop_str]}}).json()
    assert doc["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert stop_str not in doc["text"]
    assert base["text"].startswith(doc["text"])


def test_return_logprob_sglang_shape(url: str) -> None:
    ids = [504, 3575, 282, 4649, 314]
    body = {"input_ids": [ids], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3}
    doc = generate(url, body).json()[0]
    meta = doc["meta_info"]
    assert doc["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    triples = meta["input_token_logprobs"]
    assert [t[1] for t in triples] == ids[2:]
    assert triples[0][0] is None and all(t[0] < 0 for t in triples[1:])
    assert len(meta["input_top_logprobs"]) == 3 and meta["input_top_logprobs"][0] is None
    assert all(len(t) == 3 for t in meta["input_top_logprobs"][1:])
    # Output log-probs, one per generated token.
    out = generate(url, {"text": PROMPT, "return_logprob": True, "sampling_params": GREEDY}).json()["meta_info"]
    assert [t[1] for t in out["output_token_logprobs"]] == generate(
        url, {"text": PROMPT, "sampling_params": GREEDY}).json()["output_ids"]


def test_logprob_start_len_per_prompt(url: str) -> None:
    # As SGLang: a batch may give one start per prompt (the quality stage scores several items'
    # endings in one request); each prompt's scored part equals that of a request of its own.
    a, b = [504, 3575, 282, 4649, 314], [12, 99, 7, 300]
    params = {"max_new_tokens": 0, "temperature": 0}
    batched = generate(url, {"input_ids": [a, b], "sampling_params": params, "return_logprob": True,
                             "logprob_start_len": [2, 0]}).json()
    for doc, ids, start in zip(batched, (a, b), (2, 0)):
        alone = generate(url, {"input_ids": ids, "sampling_params": params, "return_logprob": True,
                               "logprob_start_len": start}).json()
        got, want = doc["meta_info"]["input_token_logprobs"], alone["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in got] == ids[start:] == [t[1] for t in want]
        assert [t[0] for t in got[1:]] == pytest.approx([t[0] for t in want[1:]], abs=1e-4)


def test_prefix_cache_and_flush(url: str) -> None:
    assert requests.post(url + "/flush_cache", timeout=10).status_code == 200
    prompt = "A long shared system prompt about the history of the Roman empire and its provinces"
    first = generate(url, {"text": prompt, "sampling_params": GREEDY}).json()
    assert first["meta_info"]["cached_tokens"] == 0
    second = generate(url, {"text": prompt, "sampling_params": GREEDY}).json()
    n = second["meta_info"]["prompt_tokens"]
    assert second["meta_info"]["cached_tokens"] == n - 1  # the last token always runs
    assert second["output_ids"] == first["output_ids"]
    extended = generate(url, {"text": prompt + " and the cities", "sampling_params": GREEDY}).json()
    assert extended["meta_info"]["cached_tokens"] == n
    assert requests.get(url + "/flush_cache", timeout=10).status_code == 200
    after = generate(url, {"text": prompt, "sampling_params": GREEDY}).json()
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["output_ids"] == first["output_ids"]


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info(url: str, path: str) -> None:
    info = requests.get(url + path, timeout=10).json()
    assert info["max_total_num_tokens"] == 4096
    assert info["max_running_requests"] == 4
    assert info["version"]
    assert info["context_length"] == 1024
    state = info["internal_states"][0]
    assert state["memory_usage"]["token_capacity"] == 4096
    assert state["memory_usage"]["weight"] > 0 and state["memory_usage"]["kvcache"] > 0
    assert state["effective_max_running_requests_per_dp"] == 4
    assert state["last_gen_throughput"] >= 0
    assert "avg_spec_accept_length" not in state


def test_openai_completions(url: str) -> None:
    body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    doc = requests.post(url + "/v1/completions", json=body, timeout=60).json()
    assert doc["object"] == "text_completion"
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                            "prompt_tokens_details": doc["usage"]["prompt_tokens_details"]}
    native = generate(url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert doc["choices"][0]["text"] == native["text"]
    by_ids = requests.post(url + "/v1/completions", json={**body, "prompt": [504, 3575, 282, 4649, 314]},
                           timeout=60).json()
    assert by_ids["choices"][0]["text"] == native["text"]


def test_openai_completions_echo_logprobs(url: str) -> None:
    ids = [504, 3575, 282, 4649, 314]
    body = {"model": "tiny-random", "prompt": [ids], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    doc = requests.post(url + "/v1/completions", json=body, timeout=60).json()
    lp = doc["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lp) == len(ids) + 1 and lp[0] is None and all(v < 0 for v in lp[1:])
    native = generate(url, {"input_ids": [ids], "return_logprob": True, "logprob_start_len": 0,
                            "sampling_params": {"max_new_tokens": 0}}).json()[0]
    expected = [t[0] for t in native["meta_info"]["input_token_logprobs"]]
    assert lp[1:len(ids)] == pytest.approx(expected[1:], abs=1e-4)


def test_openai_completions_streaming(url: str) -> None:
    body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with requests.post(url + "/v1/completions", json=body, timeout=60, stream=True) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    native = generate(url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert text == native["text"]
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_openai_chat(url: str) -> None:
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0}
    doc = requests.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["role"] == "assistant"
    assert doc["usage"]["completion_tokens"] == 4
    assert doc["usage"]["prompt_tokens"] > 10  # the chat template wraps the message
    with requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60,
                       stream=True) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == doc["choices"][0]["message"]["content"]


def test_openai_models(url: str) -> None:
    doc = requests.get(url + "/v1/models", timeout=10).json()
    assert doc["data"][0]["id"] == "tiny-random"


@pytest.mark.parametrize("body, fragment", [
    ({"text": "x", "input_ids": [1]}, "exactly one"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [10 ** 9]}, "vocabulary"),
    ({"input_ids": [[1, 2], [3, 4]], "return_logprob": True, "logprob_start_len": [0]}, "one integer per prompt"),
])
def test_bad_requests_answer_400(url: str, body: dict, fragment: str) -> None:
    resp = generate(url, body)
    assert resp.status_code == 400
    assert fragment in resp.json()["error"]["message"]
    assert requests.get(url + "/health_generate", timeout=60).status_code == 200  # the scheduler lives on


def test_metrics_count_real_traffic(url: str) -> None:
    before = scrape(url)
    doc = generate(url, {"text": "Counting tokens for metrics", "sampling_params": {**GREEDY,
                                                                                      "max_new_tokens": 12}}).json()
    after = scrape(url)

    def total(samples: dict, name: str) -> float:
        return sum(s.value for s in samples.get(name, []))

    assert total(after, "sglang:generation_tokens_total") - total(before, "sglang:generation_tokens_total") == 12
    assert total(after, "sglang:prompt_tokens_total") - total(before, "sglang:prompt_tokens_total") == \
        doc["meta_info"]["prompt_tokens"]
    assert total(after, "sglang:num_requests_total") - total(before, "sglang:num_requests_total") == 1
    assert total(after, "sglang:time_to_first_token_seconds_count") > total(before,
                                                                          "sglang:time_to_first_token_seconds_count")
    assert total(after, "sglang:inter_token_latency_seconds_count") - total(
        before, "sglang:inter_token_latency_seconds_count") == 11
    assert "sglang:e2e_request_latency_seconds_bucket" in after
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
                 "sglang:cache_hit_rate", "sglang:spec_accept_length", "sglang:fwd_occupancy"):
        (sample,) = after[name]
        assert sample.labels == {"model_name": "tiny-random", "engine_type": "unified", "tp_rank": "0",
                                 "pp_rank": "0"}, name
    # The gauge is published at the end of the step that finished the request, which may come a moment
    # after the response's last byte (SGLang's gauges lag to their log interval): it reads 0 soon after.
    deadline = time.monotonic() + 5
    while metric_value(url, "sglang:num_running_reqs") != 0:
        assert time.monotonic() < deadline, "num_running_reqs never went back to 0 after the request"
        time.sleep(0.02)
    assert metric_value(url, "sglang:gen_throughput") > 0  # a 4-step window completed
    assert after["sglang:prompt_tokens_total"][0].labels == {"model_name": "tiny-random"}


def test_fwd_occupancy_is_a_percentage_during_decode(url: str) -> None:
    values: list[float] = []
    done = threading.Event()

    def load() -> None:
        generate(url, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 300}}, timeout=120)
        done.set()

    thread = threading.Thread(target=load)
    thread.start()
    while not done.is_set():
        values.append(metric_value(url, "sglang:fwd_occupancy"))
        done.wait(0.02)
    thread.join()
    finite = [v for v in values if not math.isnan(v)]
    assert finite, f"no finite fwd_occupancy sample in {len(values)} scrapes"
    assert all(0 < v <= 100 for v in finite)
    # Idle, the window restarts and the gauge reads NaN: the scheduler finds itself idle a moment after
    # the response's last byte (a fast lane once read the last window's 93.5 % right after it).
    deadline = time.monotonic() + 5
    while not math.isnan(metric_value(url, "sglang:fwd_occupancy")):
        assert time.monotonic() < deadline, "fwd_occupancy still reads a value 5 s after the request ended"
        time.sleep(0.02)


# ---- the API key (issue 11, findings 13 and 15c) ---------------------------------------------
KEY = "sékrit-ключ-0123"  # non-ASCII on purpose: the header arrives as latin-1 text


def test_api_key_by_environment_stays_off_the_command_line(start_worker) -> None:
    import psutil

    # exec_start: the command line `ps` shows is the subject (a fork's would be its fork server's)
    worker = start_worker([], env={"SERVEGATE_API_KEY": KEY}, exec_start=True)
    body = {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 2}}
    bearer = f"Bearer {KEY}".encode()
    assert generate(worker.url, body).status_code == 401
    assert generate(worker.url, body, headers={"Authorization": b"Bearer wrong"}).status_code == 401
    assert generate(worker.url, body, headers={"Authorization": bearer + b"x"}).status_code == 401
    assert generate(worker.url, body, headers={"Authorization": "Bearer \xff\xfe".encode("latin-1")}).status_code == 401
    assert generate(worker.url, body, headers={"Authorization": bearer}).status_code == 200
    assert requests.get(worker.url + "/health", timeout=10).status_code == 200  # probes stay open
    cmdline = " ".join(psutil.Process(worker.proc.pid).cmdline())
    assert KEY not in cmdline and "--api-key" not in cmdline  # `ps` shows no key
    info = requests.get(worker.url + "/server_info", headers={"Authorization": bearer}, timeout=10).json()
    assert info["api_key"] == "<set>" and KEY not in json.dumps(info, ensure_ascii=False)


def test_key_check_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The middleware decides through hmac.compare_digest (an early-exit != leaks, by timing, how
    much of a guess matches); the app runs in-process so that the call can be observed."""
    import hmac

    from fastapi.testclient import TestClient

    from servegate.worker.faults import FaultConfig
    from servegate.worker.metrics import WorkerMetrics
    from servegate.worker.http_plumbing import WorkerState
    from servegate.worker.server import build_app

    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    state = WorkerState(model_name="m", server_args={}, metrics=WorkerMetrics("m", enabled=False),
                        faults=FaultConfig(), token_capacity=64, max_running_requests=1, context_length=64,
                        weight_bytes=0, kv_bytes_per_token=1, version="t", api_key="k3y")
    with TestClient(build_app(state)) as client:
        assert client.get("/v1/models", headers={"Authorization": "Bearer k3x"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k3y"}).status_code != 401
        assert client.get("/v1/models").status_code == 401
    assert compared == [(b"Bearer k3x", b"Bearer k3y"), (b"Bearer k3y", b"Bearer k3y"), (b"", b"Bearer k3y")]
