"""/flush_cache with SGLang's timeout semantics against a real worker."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from workerutil import generate, metric_value

pytestmark = pytest.mark.timeout(180)

# 25 ms per decode step: a 48-token request keeps the worker busy for ~1.2 s (a flush answers in milliseconds).
SLOW = ["--enable-metrics", "--fault-decode-delay-ms", "25", "--max-total-tokens", "4096"]


@pytest.fixture(scope="module")
def url(start_worker) -> str:
    return start_worker(SLOW).url


def _busy(url: str, max_new_tokens: int = 48) -> threading.Thread:
    """Start one long request in the background and wait until it is running."""
    body = {"text": "keep busy", "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    thread = threading.Thread(target=generate, args=(url, body), kwargs={"timeout": 120})
    thread.start()
    deadline = time.monotonic() + 30
    while metric_value(url, "sglang:num_running_reqs") < 1:
        assert time.monotonic() < deadline, "the background request never started running"
        time.sleep(0.02)
    return thread


def test_idle_flush_without_timeout(url: str) -> None:
    assert requests.post(url + "/flush_cache", timeout=10).status_code == 200
    assert requests.get(url + "/flush_cache?timeout=0", timeout=10).status_code == 200


def test_busy_with_timeout_zero_answers_400_at_once(url: str) -> None:
    thread = _busy(url)
    start = time.monotonic()
    resp = requests.post(url + "/flush_cache", timeout=10)
    assert resp.status_code == 400
    assert "busy" in resp.text
    assert time.monotonic() - start < 2
    thread.join(60)


def test_busy_then_idle_within_timeout_answers_200(url: str) -> None:
    thread = _busy(url, max_new_tokens=60)
    start = time.monotonic()
    resp = requests.post(url + "/flush_cache?timeout=60", timeout=90)
    waited = time.monotonic() - start
    assert resp.status_code == 200, resp.text
    assert waited > 0.2  # it really waited for the running request
    assert metric_value(url, "sglang:num_running_reqs") == 0
    thread.join(60)


def test_busy_past_timeout_answers_400(url: str) -> None:
    thread = _busy(url, max_new_tokens=80)  # busy ~2 s: well past the flush's 0.5 s
    start = time.monotonic()
    resp = requests.post(url + "/flush_cache?timeout=0.5", timeout=30)
    assert resp.status_code == 400
    assert time.monotonic() - start >= 0.5
    thread.join(60)


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_invalid_timeout_answers_400(url: str, value: str) -> None:
    assert requests.post(url + f"/flush_cache?timeout={value}", timeout=10).status_code == 400


def test_fault_flush_busy_window(start_worker) -> None:
    """--fault-flush-busy-s: each flush request sees the worker busy for S seconds from its arrival."""
    worker = start_worker(["--fault-flush-busy-s", "1.0"])
    assert requests.post(worker.url + "/flush_cache", timeout=10).status_code == 400
    assert requests.post(worker.url + "/flush_cache?timeout=0.3", timeout=10).status_code == 400
    start = time.monotonic()
    assert requests.post(worker.url + "/flush_cache?timeout=10", timeout=30).status_code == 200
    assert time.monotonic() - start >= 1.0
