"""The worker's profiler routes (--profiler-dir: vLLM's /start_profile and /stop_profile) and the
fault that slows one real operator (--fault-slow-activation-factor), on real worker processes."""

from __future__ import annotations

from pathlib import Path

import requests
from workerutil import generate

from servegate.profiling import find_traces, read_operator_times

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
LAYERS = 2  # the tiny-random model's decoder layers


def _profile_one_request(url: str, prompt: str) -> tuple[dict, str]:
    assert requests.post(url + "/start_profile", timeout=60).status_code == 200
    answer = generate(url, {"text": prompt, "sampling_params": GREEDY})
    assert answer.status_code == 200, answer.text
    stopped = requests.post(url + "/stop_profile", timeout=120)
    assert stopped.status_code == 200, stopped.text
    return answer.json(), stopped.json()["trace"]


def test_a_profile_of_one_request_is_a_trace_of_its_operators_written_before_stop_answers(start_worker, tmp_path):
    trace_dir = tmp_path / "traces"
    worker = start_worker(["--profiler-dir", str(trace_dir)])
    # A stop without a start is refused, and says what to do.
    refused = requests.post(worker.url + "/stop_profile", timeout=30)
    assert refused.status_code == 400 and "/start_profile first" in refused.text

    answer, trace = _profile_one_request(worker.url, "The capital of France is")
    # /stop_profile answered once the trace was on disk, in DIR, in torch.profiler's gzipped Chrome format.
    assert Path(trace).parent == trace_dir.resolve() and trace.endswith(".pt.trace.json.gz")
    assert find_traces(trace_dir) == [Path(trace)]
    ops = read_operator_times([Path(trace)]).set_index("op")
    # The model ran in the profiled thread: its operators are in the trace, once per layer and forward
    # pass (one prefill and 15 decode steps for 16 tokens).
    assert answer["meta_info"]["completion_tokens"] == 16
    assert ops.loc["aten::silu", "calls"] == LAYERS * 16
    assert ops.loc["aten::mm", "self_ms"] > 0
    assert requests.post(worker.url + "/start_profile", timeout=30).status_code == 200
    again = requests.post(worker.url + "/start_profile", timeout=30)
    assert again.status_code == 400 and "already running" in again.text
    assert requests.post(worker.url + "/stop_profile", timeout=120).status_code == 200
    assert len(find_traces(trace_dir)) == 2


def test_without_profiler_dir_the_routes_answer_404_as_vllm_without_a_profiler(start_worker):
    worker = start_worker([])
    for route in ("/start_profile", "/stop_profile"):
        response = requests.post(worker.url + route, timeout=30)
        assert response.status_code == 404 and "--profiler-dir" in response.text


def test_the_slow_activation_fault_computes_silu_k_times_with_the_same_tokens_in_the_first_launch_only(
        start_worker, tmp_path):
    k = 7
    args = ["--profiler-dir", str(tmp_path / "traces"), "--fault-slow-activation-factor", str(k),
            "--fault-only-first-launch", str(tmp_path / "first")]
    slowed = start_worker(args)  # the first launch: the fault is on
    plain = start_worker(args)  # a later launch (--fault-only-first-launch): no fault
    prompt = "Once upon a time"
    slowed_answer, slowed_trace = _profile_one_request(slowed.url, prompt)
    plain_answer, plain_trace = _profile_one_request(plain.url, prompt)
    assert slowed_answer["output_ids"] == plain_answer["output_ids"]  # the same result: only slower
    assert read_operator_times([Path(slowed_trace)]).set_index("op").loc["aten::silu", "calls"] == k * LAYERS * 16
    assert read_operator_times([Path(plain_trace)]).set_index("op").loc["aten::silu", "calls"] == LAYERS * 16
    assert f"MLP activations computed {k} times per call" in slowed.log_text()
    assert "fault injection" not in plain.log_text()
