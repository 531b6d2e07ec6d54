"""The quality stage against the real embedded worker (tiny-random, float32, one thread).

float32 on both sides, so the worker's log-probabilities must equal the in-process ones to
rounding, and greedy outputs must agree exactly. Skipped only when the running worker answers
``return_logprob`` without ``meta_info.input_token_logprobs``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from servegate.bench.protocol import NATIVE
from servegate.bench.quality import (
    QualityConfig,
    encode_item,
    load_mc_items,
    record_reference,
    reference_generate,
    run_quality,
    score_items_in_process,
    server_ending_logprobs,
    server_greedy_outputs,
)
from servegate.config import WorkerSpec
from servegate.engines import get_engine
from servegate.errors import StageError
from servegate.launch import WorkerHandle, launch_worker
from servegate.worker.logprobs import input_token_logprobs
from servegate.models import ensure_model, load_model

from sim_server import SimServer, SimState

pytestmark = pytest.mark.timeout(600)

WORKER_ARGS = ["--dtype", "float32", "--num-threads", "1"]
PROMPTS = [{"id": "a", "prompt": "The capital of France is"}, {"id": "b", "prompt": "Once upon a time"},
           {"id": "c", "prompt": "def add(a, b):"}]


def _launch(tmp: Path, name: str, extra: list[str]) -> WorkerHandle:
    spec = WorkerSpec(engine="embedded", model="tiny-random", enable_metrics=False,
                      extra_args=[*WORKER_ARGS, *extra])
    return launch_worker(spec, tmp / f"{name}.log", ready_timeout_s=240)


def _require_logprobs(base_url: str) -> None:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0}
    doc = requests.post(base_url + "/generate", json=body, timeout=60).json()
    if "input_token_logprobs" not in (doc.get("meta_info") or {}):
        pytest.skip("the embedded worker answers /generate return_logprob without meta_info.input_token_logprobs; "
                    "the quality stage needs it (servegate/worker/server.py must call servegate.worker.logprobs)")


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[WorkerHandle]:
    handle = _launch(tmp_path_factory.mktemp("quality-worker"), "worker", [])
    try:
        _require_logprobs(handle.base_url)
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def tiny():
    return load_model(ensure_model("tiny-random"), dtype="float32")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps(PROMPTS))
    return path


def _cfg(prompts_file: Path, **kw) -> QualityConfig:
    settings = {"max_items": 12, "reference_prompts_path": str(prompts_file), "reference_max_new_tokens": 6,
                "exact_match_tokens": 6, "logprob_tolerance": 1e-3, "concurrency": 2, **kw}
    return QualityConfig(**settings)


def test_worker_input_logprobs_match_in_process(worker, tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode("The cat sat on the mat because the floor was warm")
    for start in (0, 4):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 3}
        doc = requests.post(worker.base_url + "/generate", json=body, timeout=60).json()
        meta = doc["meta_info"]
        want, want_tops = input_token_logprobs(model, ids, start, top_k=3)
        got = meta["input_token_logprobs"]
        assert [t[1] for t in got] == ids[start:]
        # Entry 0 is None in SGLang whatever the start; compare every scored position after it.
        assert [t[0] for t in got[1:]] == pytest.approx([t[0] for t in want[1:]], abs=1e-4)
        assert [[t[1] for t in top] for top in meta["input_top_logprobs"][1:]] == \
            [[t[1] for t in top] for top in want_tops[1:]]
        out = meta["output_token_logprobs"]
        assert [t[1] for t in out] == doc["output_ids"]
        # The first output token's logprob is the last prompt position's distribution.
        teacher, _ = input_token_logprobs(model, ids + doc["output_ids"], len(ids) - 1)
        assert [t[0] for t in out] == pytest.approx([t[0] for t in teacher[1:]], abs=1e-4)


def test_server_ending_logprobs_equal_in_process_scoring(worker, tiny):
    model, tokenizer = tiny
    encoded = [encode_item(tokenizer, it) for it in load_mc_items(QualityConfig().dataset_path)[:6]]
    served = server_ending_logprobs(worker.base_url, NATIVE, encoded, concurrency=2)
    local = score_items_in_process(model, encoded)
    for s_item, l_item, enc in zip(served, local, encoded):
        assert [len(e) for e in s_item] == [len(e) for e in enc.ending_ids]
        for s, l in zip(s_item, l_item):
            assert s == pytest.approx(l, abs=1e-4)


def test_run_quality_in_process_reference(worker, prompts_file):
    result = run_quality(worker.base_url, get_engine("embedded"), _cfg(prompts_file), model_for_reference="tiny-random")
    acc = result.accuracy.iloc[0]
    assert acc["n_items"] == 12 and len(result.items) == 12
    assert 0.0 <= acc["accuracy"] <= 1.0 and acc["protocol"] == "native" and acc["duration_s"] > 0
    assert result.items["item_index"].is_monotonic_increasing
    agree = result.agreement.iloc[0]
    assert agree["n_prompts"] == len(PROMPTS) and agree["reference_source"] == "in-process"
    assert agree["exact_match_rate"] == 1.0 and agree["within_tolerance_rate"] == 1.0
    assert agree["n_tokens_compared"] == 6 * len(PROMPTS)
    assert agree["max_abs_logprob_diff"] < 1e-3
    assert result.agreement_rows["worker_output_ids"].map(len).tolist() == [6] * len(PROMPTS)


def test_run_quality_stored_reference(worker, prompts_file, tmp_path):
    stored = record_reference("tiny-random", prompts_file, tmp_path / "ref.json", max_new_tokens=6)
    cfg = _cfg(prompts_file, reference=str(stored), max_items=4)
    agree = run_quality(worker.base_url, get_engine("embedded"), cfg, model_for_reference="tiny-random").agreement
    assert agree.iloc[0]["exact_match_rate"] == 1.0 and agree.iloc[0]["reference_source"] == str(stored)
    # A reference that disagrees at token 2 of one prompt is caught there.
    doc = json.loads(stored.read_text())
    doc["records"][1]["output_ids"][2] += 1
    stored.write_text(json.dumps(doc))
    result = run_quality(worker.base_url, get_engine("embedded"), cfg, model_for_reference="tiny-random")
    rows = result.agreement_rows.set_index("prompt_id")
    assert rows.loc["b", "first_mismatch_index"] == 2 and not rows.loc["b", "exact_match"]
    assert result.agreement.iloc[0]["exact_match_rate"] == pytest.approx(2 / 3)


def test_corrupted_logits_fail_agreement(prompts_file, tmp_path):
    with _launch(tmp_path, "corrupt", ["--fault-corrupt-logits"]) as handle:
        _require_logprobs(handle.base_url)
        result = run_quality(handle.base_url, get_engine("embedded"), _cfg(prompts_file, max_items=4),
                             model_for_reference="tiny-random")
    agree = result.agreement.iloc[0]
    assert agree["exact_match_rate"] < 1.0 and agree["within_tolerance_rate"] < 1.0


# ----------------------------------------------------------------------------- OpenAI protocol (vLLM shape)
# vLLM cannot run here and the embedded worker's /v1/completions has no logprobs yet, so a
# stand-in HTTP server answers in vLLM's shape with real values from the tiny model.


class _VllmLikeHandler(BaseHTTPRequestHandler):
    model: Any = None
    bodies: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._send({"object": "list", "data": [{"id": "tiny-served", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        choices = []
        for i, prompt in enumerate(body["prompt"]):
            out = reference_generate(self.model, [prompt], body["max_tokens"])[0]
            if body.get("echo"):
                triples, _ = input_token_logprobs(self.model, prompt, 0)
                tokens = prompt + out[0]
                values = [t[0] for t in triples] + out[1]
            else:
                tokens, values = out
            choices.append({"index": i, "text": "", "finish_reason": "length", "logprobs": {
                "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": values,
                "top_logprobs": None, "text_offset": list(range(len(tokens)))}})
        self._send({"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices[::-1]})


@pytest.fixture(scope="module")
def vllm_like(tiny) -> Iterator[str]:
    _VllmLikeHandler.model = tiny[0]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _VllmLikeHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_openai_protocol_scores_and_agrees_like_native(vllm_like, tiny, prompts_file):
    model, tokenizer = tiny
    _VllmLikeHandler.bodies.clear()
    cfg = _cfg(prompts_file, max_items=3, concurrency=1)
    result = run_quality(vllm_like, get_engine("vllm"), cfg, model_for_reference="tiny-random")
    scoring, greedy = _VllmLikeHandler.bodies[0], _VllmLikeHandler.bodies[-1]
    assert scoring["model"] == "tiny-served" and scoring["echo"] is True and scoring["logprobs"] == 1
    assert scoring["max_tokens"] == 1 and len(scoring["prompt"]) == 4
    assert greedy["return_tokens_as_token_ids"] is True and greedy["max_tokens"] == 6
    assert "echo" not in greedy
    encoded = [encode_item(tokenizer, it) for it in load_mc_items(cfg.dataset_path)]
    picked = [encoded[i] for i in result.items["item_index"]]
    local = score_items_in_process(model, picked)
    for scores, per_ending in zip(result.items["sum_logprobs"], local):
        assert scores == pytest.approx([sum(e) for e in per_ending], abs=1e-4)
    agree = result.agreement.iloc[0]
    assert agree["exact_match_rate"] == 1.0 and agree["within_tolerance_rate"] == 1.0


# --- issue 11: whole-request deadline and API key, against the simulated server ---------------

@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimState(prefill_delay_s=0.005, per_token_delay_s=0.001)) as server:
        yield server


@pytest.mark.timeout(30)
def test_dripping_server_fails_the_quality_request_at_its_deadline(sim):
    sim.state.drip_routes = {"/generate"}
    sim.state.drip_interval_s = 0.2  # a byte inside every per-read timeout, forever
    started = time.monotonic()
    with pytest.raises(StageError, match=r"reference agreement \(POST .*/generate\) did not complete within its "
                                         r"deadline of 1 s .*raise quality.request_timeout_s"):
        server_greedy_outputs(sim.base_url, NATIVE, [[1, 2, 3]], 4, timeout_s=1.0)
    assert time.monotonic() - started < 5.0


def test_server_that_requires_an_api_key(sim):
    sim.state.api_key = "sekrit"
    ((ids, logprobs),) = server_greedy_outputs(sim.base_url, NATIVE, [[1, 2, 3]], 4, api_key="sekrit")
    assert len(ids) == 4 and logprobs == [-0.5] * 4
    with pytest.raises(StageError, match="401"):
        server_greedy_outputs(sim.base_url, NATIVE, [[1, 2, 3]], 4)
