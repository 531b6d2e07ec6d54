"""NGRAM speculative mode of the worker (servegate.worker.spec), as a real process."""

from __future__ import annotations

import math

import pytest
import requests
from workerutil import generate, metric_value

pytestmark = pytest.mark.timeout(180)

# Text that repeats itself: NGRAM drafts copy the loop, so most drafts are accepted.
LOOP_BODY = {"text": "1 2 3 1 2 3 1 2 3 1 2 3", "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                                      "ignore_eos": True}}
SPEC_ARGS = ["--enable-metrics", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]


def test_speculative_mode_matches_greedy_and_reports_accept_length(start_worker) -> None:
    plain = start_worker(["--enable-metrics"])
    spec = start_worker(SPEC_ARGS)
    assert metric_value(plain.url, "sglang:spec_accept_length") == 0.0  # speculation off, as SGLang
    assert math.isnan(metric_value(spec.url, "sglang:spec_accept_length"))  # no verification pass yet
    expected = generate(plain.url, LOOP_BODY).json()
    doc = generate(spec.url, LOOP_BODY).json()
    assert doc["output_ids"] == expected["output_ids"]  # float32: NGRAM verification is exact
    meta = doc["meta_info"]
    assert 1 <= meta["spec_verify_ct"] <= 23
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    info = requests.get(spec.url + "/get_server_info", timeout=10).json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(24 / meta["spec_verify_ct"])
    # The gauge is SGLang's: tokens emitted by verification passes / passes over the last window
    # (here the whole request, 23 tokens after the prefill's first one, fewer passes than a window).
    assert metric_value(spec.url, "sglang:spec_accept_length") == pytest.approx(23 / meta["spec_verify_ct"])


def test_random_drafts_fault_keeps_greedy_output_and_drops_accept_length(start_worker) -> None:
    """--fault-random-drafts ruins every draft: the accept length falls to ~1, the output does not change."""
    spec = start_worker(SPEC_ARGS)
    ruined = start_worker([*SPEC_ARGS, "--fault-random-drafts"])
    good = generate(spec.url, LOOP_BODY).json()
    bad = generate(ruined.url, LOOP_BODY).json()
    assert bad["output_ids"] == good["output_ids"]  # verification keeps greedy output exact
    assert bad["text"] == good["text"]
    good_len = 24 / good["meta_info"]["spec_verify_ct"]
    bad_len = 24 / bad["meta_info"]["spec_verify_ct"]
    assert good_len > 2.0  # the loop is copied: drafts accepted
    # 23 passes for 23 tokens (a random token out of ~49k matches the greedy one by chance ~never)
    assert bad["meta_info"]["spec_verify_ct"] == 23
    assert bad_len == pytest.approx(24 / 23)
    assert metric_value(ruined.url, "sglang:spec_accept_length") == pytest.approx(1.0)
    info = requests.get(ruined.url + "/get_server_info", timeout=10).json()
    assert info["faults"] == {"random_drafts": True}


def test_random_drafts_fault_needs_speculation(start_worker) -> None:
    worker = start_worker(["--fault-random-drafts"], wait=False)
    assert worker.wait_exit(60) != 0
    assert "--fault-random-drafts needs --speculative-algorithm NGRAM" in worker.log_text()


def test_speculative_mode_returns_the_same_logprobs_as_plain_decoding(start_worker) -> None:
    """The quality stage scores prompts (return_logprob, logprob_start_len) on a speculative worker too."""
    plain = start_worker(["--enable-metrics"])
    spec = start_worker([*SPEC_ARGS, "--fault-random-drafts"])
    body = {**LOOP_BODY, "sampling_params": {**LOOP_BODY["sampling_params"], "max_new_tokens": 8},
            "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 2}
    want = generate(plain.url, body).json()["meta_info"]
    got = generate(spec.url, body).json()["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(got[key]) == len(want[key]) > 0
        for (lp_got, tok_got, _), (lp_want, tok_want, _) in zip(got[key], want[key]):
            assert tok_got == tok_want
            assert (lp_got is None) == (lp_want is None)
            if lp_want is not None:
                assert lp_got == pytest.approx(lp_want, abs=1e-4)
    assert [t for _, t, _ in got["output_top_logprobs"][0]] == [t for _, t, _ in want["output_top_logprobs"][0]]
