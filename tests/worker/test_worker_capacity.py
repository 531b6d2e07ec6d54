"""KV budget, admission and queueing of the worker, as a real process."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from workerutil import TINY_ARGS, WorkerProcess, generate, metric_value

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def small(start_worker) -> WorkerProcess:
    # 256 tokens: two requests of 8 + 112 fit, a third must queue. 20 ms/step keeps them running ~2 s.
    return start_worker(["--enable-metrics", "--max-total-tokens", "256", "--context-length", "200",
                         "--fault-decode-delay-ms", "20"], model_args=["--model", "tiny-random", "--dtype", "float32", "--num-threads", "1"])


def test_request_longer_than_context_gets_400_and_scheduler_survives(small: WorkerProcess) -> None:
    resp = generate(small.url, {"input_ids": list(range(10, 110)), "sampling_params": {"max_new_tokens": 150}})
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "context length 200" in message and "250" in message
    ok = generate(small.url, {"text": "still alive", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_requests_beyond_capacity_queue_fifo_and_all_finish(small: WorkerProcess) -> None:
    prompt = [504, 3575, 282, 4649, 314, 504, 3575, 282]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 112, "ignore_eos": True, "temperature": 0}}
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        time.sleep(0.05 * i)  # fixed arrival order
        results[i] = generate(small.url, body, timeout=120).json()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    max_queued = max_running = 0.0
    while any(t.is_alive() for t in threads):
        max_queued = max(max_queued, metric_value(small.url, "sglang:num_queue_reqs"))
        max_running = max(max_running, metric_value(small.url, "sglang:num_running_reqs"))
        assert metric_value(small.url, "sglang:token_usage") <= 1.0
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert max_queued == 1 and max_running == 2
    assert all(len(results[i]["output_ids"]) == 112 for i in range(3))
    # FIFO: the queued (third) request started only after one of the first two finished.
    e2e = [results[i]["meta_info"]["e2e_latency"] for i in range(3)]
    assert e2e[2] > min(e2e[:2])


def test_max_running_requests_caps_the_batch(start_worker) -> None:
    worker = start_worker(["--enable-metrics", "--max-running-requests", "1", "--fault-decode-delay-ms", "20"])
    body = {"text": "one at a time", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    threads = [threading.Thread(target=generate, args=(worker.url, body)) for _ in range(2)]
    for t in threads:
        t.start()
    seen_running, seen_queued = set(), set()
    while any(t.is_alive() for t in threads):
        seen_running.add(metric_value(worker.url, "sglang:num_running_reqs"))
        seen_queued.add(metric_value(worker.url, "sglang:num_queue_reqs"))
        time.sleep(0.02)
    assert max(seen_running) == 1 and 1 in seen_queued
    info = requests.get(worker.url + "/get_server_info", timeout=10).json()
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 1


def test_budget_too_small_for_context_fails_start_up(tmp_path) -> None:
    worker = WorkerProcess([*TINY_ARGS[:4], "--context-length", "1024", "--max-total-tokens", "100"], None,
                           tmp_path / "worker.log")
    try:
        code = worker.wait_exit(120)
        assert code != 0
        log = worker.log_text()
        assert "holds 100 tokens" in log and "context length 1024" in log and "--max-total-tokens" in log
    finally:
        worker.stop()


def test_chunked_prefill_size_below_one_is_refused(tmp_path) -> None:
    worker = WorkerProcess([*TINY_ARGS, "--chunked-prefill-size", "0"], None, tmp_path / "worker.log")
    try:
        assert worker.wait_exit(120) == 2
        assert "--chunked-prefill-size must be >= 1" in worker.log_text() and "got 0" in worker.log_text()
    finally:
        worker.stop()


def test_mem_fraction_budget_is_reported(start_worker) -> None:
    worker = start_worker(["--mem-fraction-static", "0.05"])
    info = requests.get(worker.url + "/get_server_info", timeout=10).json()
    capacity = info["internal_states"][0]["memory_usage"]["token_capacity"]
    # tiny-random: 2 layers * 2 kv heads * 16 head_dim * 2 (K,V) * 4 bytes = 512 bytes per token
    kv_gib = info["internal_states"][0]["memory_usage"]["kvcache"]
    assert capacity == info["max_total_num_tokens"] > 1024
    assert kv_gib == pytest.approx(capacity * 512 / 2 ** 30, rel=1e-2)
