"""The scheduler and its batch (servegate.worker.scheduler, .batch), in process.

The process tests run ``tiny-random``, which greedily repeats its last token, so a row that
read another row's KV or a shifted position would still produce the same tokens. Here a
random untied Llama, whose greedy output wanders, shows such a mistake.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from servegate.worker.metrics import WorkerMetrics
from servegate.worker.request import Request
from servegate.worker.sampling import SamplingParams
from servegate.worker.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.timeout(120)

TOKENIZER = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


@pytest.fixture(scope="module")
def model():
    # initializer_range 0.2, ten times the default: at the default, attention is nearly uniform and
    # a row decoded at the wrong RoPE positions still produced the same tokens (checked by shifting them).
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256, initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


def _scheduler(model, **overrides) -> Scheduler:
    config = {"max_total_tokens": 2000, "max_running_requests": 8, "context_length": 256, "decode_log_interval": 4,
              **overrides}
    scheduler = Scheduler(model, TOKENIZER, SchedulerConfig(**config), metrics=WorkerMetrics("m", enabled=True))
    scheduler.start()
    return scheduler


def _wait(reqs: list[Request], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(r.finished for r in reqs):
        assert time.monotonic() < deadline, "requests did not finish"
        time.sleep(0.01)


def _request(i: int, max_new: int) -> Request:
    prompt = [10 + (7 * i + 3 * j) % 400 for j in range(4 + 5 * i)]
    return Request(prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))


def test_rows_of_different_lengths_decode_as_they_would_alone(model) -> None:
    """Left padding, per-row positions, rows leaving mid-batch and column trimming change no token."""
    lengths = [9, 3, 14, 6]
    scheduler = _scheduler(model, enable_prefix_cache=False)
    try:
        solo = []
        for i, n in enumerate(lengths):
            req = scheduler.submit(_request(i, n))
            _wait([req])
            solo.append(req.output_ids)
        together = [_request(i, n) for i, n in enumerate(lengths)]
        for req in together[:2]:
            scheduler.submit(req)
        time.sleep(0.05)  # the others join a running batch
        for req in together[2:]:
            scheduler.submit(req)
        _wait(together)
    finally:
        scheduler.stop()
    assert [r.output_ids for r in together] == solo
    assert [len(o) for o in solo] == lengths
    assert len({tuple(o) for o in solo}) == len(solo)  # the model's output wanders: the check has teeth


def test_a_prefix_cache_hit_decodes_as_a_cold_prefill(model) -> None:
    scheduler = _scheduler(model)
    try:
        cold = scheduler.submit(_request(3, 8))
        _wait([cold])
        warm = scheduler.submit(_request(3, 8))
        _wait([warm])
        load = scheduler.load()
        assert scheduler.flush_cache()
        assert scheduler.load()["prefix_cache_tokens"] == 0
    finally:
        scheduler.stop()
    assert cold.cached_tokens == 0 and warm.cached_tokens == cold.prompt_tokens - 1
    assert warm.output_ids == cold.output_ids
    assert load["reserved_tokens"] == 0 and load["prefix_cache_tokens"] == cold.prompt_tokens


def test_admission_is_fifo_within_the_budget(model) -> None:
    """The head of the queue waits for room; a smaller request behind it does not overtake it."""
    scheduler = _scheduler(model, max_total_tokens=60, context_length=60, enable_prefix_cache=False)
    try:
        big = [Request([20 + j for j in range(10)], SamplingParams(max_new_tokens=30, temperature=0.0,
                                                                  ignore_eos=True)) for _ in range(2)]
        small = Request([30, 31], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
        for req in [*big, small]:
            scheduler.submit(req)
        _wait([*big, small])
    finally:
        scheduler.stop()
    assert big[0].finish_time < big[1].first_token_time  # 40 + 40 > 60: the second big one waited
    assert small.first_token_time > big[1].first_token_time  # and the small one waited behind it
