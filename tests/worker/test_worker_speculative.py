"""NGRAM speculative mode of the worker (servegate.worker.spec), as a real process."""

from __future__ import annotations

import pytest
import requests
from workerutil import generate, metric_value

pytestmark = pytest.mark.timeout(180)


def test_speculative_mode_matches_greedy_and_reports_accept_length(start_worker) -> None:
    try:
        import servegate.worker.spec  # noqa: F401
    except ImportError:
        pytest.skip("servegate.worker.spec is not available")
    plain = start_worker(["--enable-metrics"])
    spec = start_worker(["--enable-metrics", "--speculative-algorithm", "NGRAM",
                         "--speculative-num-draft-tokens", "4"])
    body = {"text": "1 2 3 1 2 3 1 2 3 1 2 3", "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                                    "ignore_eos": True}}
    expected = generate(plain.url, body).json()
    doc = generate(spec.url, body).json()
    assert doc["output_ids"] == expected["output_ids"]  # float32: NGRAM verification is exact
    meta = doc["meta_info"]
    assert 1 <= meta["spec_verify_ct"] <= 24
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    info = requests.get(spec.url + "/get_server_info", timeout=10).json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(24 / meta["spec_verify_ct"])
    assert metric_value(spec.url, "sglang:spec_accept_length") == pytest.approx(24 / meta["spec_verify_ct"])
