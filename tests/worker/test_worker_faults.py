"""Every fault switch of the worker, each against a real worker process."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import requests
from workerutil import TINY_ARGS, WorkerProcess, generate, metric_value, sse_events

from servegate.worker.faults import burn_cpu_for, burn_cpu_until

pytestmark = pytest.mark.timeout(240)

BODY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                 "ignore_eos": True}}


def _occupancy_during(url: str, max_new_tokens: int = 80) -> list[float]:
    values: list[float] = []
    done = threading.Event()

    def load() -> None:
        generate(url, {"text": "x", "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}},
                 timeout=120)
        done.set()

    thread = threading.Thread(target=load)
    thread.start()
    while not done.is_set():
        values.append(metric_value(url, "sglang:fwd_occupancy"))
        done.wait(0.02)
    thread.join()
    return [v for v in values if not math.isnan(v)]


def test_decode_delay_slows_decode_and_lowers_occupancy(start_worker) -> None:
    # 250 ms of host overhead per step dwarfs the tiny model's forward (~3 ms) even on a loaded machine.
    worker = start_worker(["--enable-metrics", "--decode-log-interval", "2", "--fault-decode-delay-ms", "250"])
    doc = generate(worker.url, {"text": "x", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}).json()
    # token 1 comes from the prefill; the delay follows each decode step, so two precede token 4
    assert doc["meta_info"]["e2e_latency"] >= 2 * 0.25
    finite = _occupancy_during(worker.url, 8)
    assert finite and max(finite) < 50


def test_decode_slowdown_keeps_occupancy_high(start_worker) -> None:
    # The slowdown happens inside the forward window: slower kernels, not host overhead.
    worker = start_worker(["--enable-metrics", "--decode-log-interval", "2"],
                          env={"SERVEGATE_FAULT_DECODE_SLOWDOWN_PCT": "2000"})
    info = requests.get(worker.url + "/get_server_info", timeout=10).json()
    assert info["faults"] == {"decode_slowdown_pct": 2000.0}
    finite = _occupancy_during(worker.url, 24)  # 12 windows: seen by the scrape on a busy machine too
    assert finite and max(finite) > 50, finite


def _cpu_seconds_of(worker, body: dict) -> tuple[float, float]:
    """The worker process's CPU seconds (user + system) and the wall seconds of one request."""
    proc = psutil.Process(worker.proc.pid)
    before, t0 = proc.cpu_times(), time.perf_counter()
    assert generate(worker.url, body, timeout=120).status_code == 200
    after, wall = proc.cpu_times(), time.perf_counter() - t0
    return (after.user + after.system) - (before.user + before.system), wall


def test_decode_compute_burns_the_cpu_where_the_slowdown_sleeps(start_worker) -> None:
    # Both make each decode forward 20x longer inside the forward window (occupancy stays high);
    # the compute fault spends that time on the CPU, the slowdown off it. That is the difference
    # a duet on one shared core sees (docs/paired.md).
    body = {"text": "x", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
    computing = start_worker(["--enable-metrics", "--decode-log-interval", "2", "--fault-decode-compute-pct", "2000"])
    sleeping = start_worker(["--enable-metrics", "--fault-decode-slowdown-pct", "2000"])
    info = requests.get(computing.url + "/get_server_info", timeout=10).json()
    assert info["faults"] == {"decode_compute_pct": 2000.0}
    for worker in (computing, sleeping):
        generate(worker.url, BODY)  # first-request costs out of the way
    cpu_computing, wall_computing = _cpu_seconds_of(computing, body)
    cpu_sleeping, wall_sleeping = _cpu_seconds_of(sleeping, body)
    seen = (f"compute: {cpu_computing:.2f} CPU s in {wall_computing:.2f} s; "
            f"sleep: {cpu_sleeping:.2f} in {wall_sleeping:.2f} s")
    assert cpu_computing > 3 * cpu_sleeping, seen  # measured here, 48 tokens: 3.83 CPU s in 3.83 s against 0.26 in 4.72 s
    assert cpu_computing > 0.4 * wall_computing, seen
    # 24 steps make 12 windows of 2 (~2 s): a scrape every 20 ms sees some even when the machine is busy
    # (12 steps in windows of 4, 2 windows in under a second: a busy CI lane once saw none).
    finite = _occupancy_during(computing.url, 24)
    assert finite and max(finite) > 50, finite


def test_burn_cpu_for_counts_this_threads_cpu_time_not_the_turns_of_a_neighbour_on_its_core() -> None:
    # The compute fault's sizing: P % of the forward's CPU time, on the thread's CPU clock. Beside a busy
    # process on the same core, half the wall time is the neighbour's: the burn takes about twice as long in
    # wall time and the same on the CPU. (Sized on the wall clock, a 3 % fault moved a duet's ITL by 4.0 %;
    # on the CPU clock by 2.2 %: benchmarks/paired_cost.py, docs/paired.md.)
    burn_cpu_for(0.0)  # torch imported
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        psutil.Process(hog.pid).cpu_affinity([cpu])
        os.sched_setaffinity(0, {cpu})  # this thread (the main one) shares the core with the hog
        time.sleep(0.5)  # the hog is running
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        burn_cpu_for(0.5)
        used, took = time.thread_time() - cpu0, time.perf_counter() - wall0
    finally:
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait()
    assert 0.5 <= used < 0.6, f"burned {used:.3f} CPU s for 0.5"
    assert took > 1.4 * used, f"{used:.3f} CPU s in {took:.3f} s: the neighbour never got a turn"


def test_burn_cpu_until_stops_at_its_deadline() -> None:
    burn_cpu_until(0.0)  # a deadline already passed: returns at once (after importing torch)
    t0 = time.perf_counter()
    burn_cpu_until(t0 + 0.2)
    took = time.perf_counter() - t0
    assert 0.2 <= took < 1.0
    t1 = time.perf_counter()
    burn_cpu_until(t1)
    assert time.perf_counter() - t1 < 0.05


def test_crash_after_requests(start_worker) -> None:
    worker = start_worker(["--fault-crash-after-requests", "2"])
    assert requests.get(worker.url + "/health_generate", timeout=60).status_code == 200  # not counted
    assert generate(worker.url, BODY).status_code == 200
    assert generate(worker.url, BODY).status_code == 200  # the 2nd answer still gets out
    assert worker.wait_exit(30) == 1


def test_error_rate_is_seeded_and_spares_health(start_worker) -> None:
    worker = start_worker(["--fault-error-rate", "0.5"])
    rng = random.Random(0)  # SERVEGATE_FAULT_SEED defaults to 0: one draw per generate request
    expected = [500 if rng.random() < 0.5 else 200 for _ in range(13)]
    codes = [generate(worker.url, BODY).status_code for _ in range(12)]
    assert codes == expected[:12] and set(codes) == {200, 500}
    assert requests.get(worker.url + "/health_generate", timeout=60).status_code == 200  # no draw
    resp = requests.post(worker.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert resp.status_code == expected[12]
    if resp.status_code == 500:
        assert "fault injection" in resp.json()["error"]["message"]


def test_cut_stream_after_tokens(start_worker) -> None:
    worker = start_worker(["--fault-cut-stream-after-tokens", "3", "--fault-decode-delay-ms", "10"])
    body = {**BODY, "stream": True, "sampling_params": {**BODY["sampling_params"], "max_new_tokens": 20}}
    events: list[str] = []
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        with generate(worker.url, body, stream=True) as resp:
            for line in resp.iter_lines(decode_unicode=True):
                if line:
                    events.append(line)
    assert events and "data: [DONE]" not in events
    last = json.loads(events[-1][len("data: "):])
    assert 3 <= len(last["output_ids"]) < 20 and last["meta_info"]["finish_reason"] is None
    assert generate(worker.url, BODY).status_code == 200  # non-streaming answers are untouched
    with generate(worker.url, {**body, "sampling_params": {"max_new_tokens": 2}}, stream=True) as resp:
        assert sse_events(resp)[-1] == "[DONE]"  # shorter than N: complete


@pytest.mark.parametrize("mode", ["nan", "absent"])
def test_occupancy_fault(start_worker, mode: str) -> None:
    worker = start_worker(["--enable-metrics", "--decode-log-interval", "2", "--fault-occupancy", mode])
    generate(worker.url, {"text": "x", "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}})
    text = requests.get(worker.url + "/metrics", timeout=10).text
    if mode == "absent":
        assert "sglang:fwd_occupancy" not in text
    else:
        assert math.isnan(metric_value(worker.url, "sglang:fwd_occupancy"))
        assert metric_value(worker.url, "sglang:gen_throughput") > 0  # everything else is real


def test_startup_oom_is_a_sigkill_before_ready(tmp_path) -> None:
    worker = WorkerProcess([*TINY_ARGS, "--fault-startup-oom"], None, tmp_path / "worker.log")
    try:
        assert worker.wait_exit(120) == -signal.SIGKILL
        assert "startup-oom" in worker.log_text()
    finally:
        worker.stop()


def test_corrupt_logits_shifts_every_greedy_token(start_worker) -> None:
    from servegate.models import ensure_model, load_model
    import torch

    worker = start_worker(["--fault-corrupt-logits"])
    ids = [504, 3575, 282, 4649, 314]
    doc = generate(worker.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    model, _ = load_model(ensure_model("tiny-random"), "float32")
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    expected = (int(logits.argmax()) + 1) % logits.shape[-1]  # the logits were rotated by one position
    assert doc["output_ids"] == [expected]
    assert doc["output_ids"] != [int(logits.argmax())]


def test_api_key(start_worker) -> None:
    worker = start_worker(["--api-key", "sekrit"])
    assert generate(worker.url, BODY).status_code == 401
    assert generate(worker.url, BODY, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert generate(worker.url, BODY, headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert requests.get(worker.url + "/health", timeout=10).status_code == 200
    assert requests.get(worker.url + "/v1/models", timeout=10).status_code == 401
    # Without --enable-metrics, /metrics is 404 like SGLang (and open: no key needed to learn that).
    assert requests.get(worker.url + "/metrics", timeout=10).status_code == 404
