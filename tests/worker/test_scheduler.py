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

from servegate.worker import batch as batch_module
from servegate.worker.logprobs import input_token_logprobs
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


class CountingModel:
    """The model, recording the ``input_ids`` shape of every forward pass (prefill: ``(rows, tokens)``)."""

    def __init__(self, model) -> None:
        self._model = model
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, *, input_ids, **kwargs):
        self.shapes.append(tuple(input_ids.shape))
        return self._model(input_ids=input_ids, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        # Decode passes feed one token per row; every prompt in these tests is longer than one token.
        return [s for s in self.shapes if s[1] > 1]


def _scheduler(model, **overrides) -> Scheduler:
    config = {"max_total_tokens": 2000, "max_running_requests": 8, "context_length": 256, "decode_log_interval": 4,
              **overrides}
    scheduler = Scheduler(model, TOKENIZER, SchedulerConfig(**config), metrics=WorkerMetrics("m", enabled=True))
    scheduler.start()
    return scheduler


def _submitted_together(model, reqs: list[Request], **overrides) -> None:
    """Run ``reqs`` arriving at once, as one HTTP batch does: queued in one go, so one admission takes them all."""
    scheduler = _scheduler(model, **overrides)
    try:
        scheduler.submit_batch(reqs)
        _wait(reqs)
    finally:
        scheduler.stop()


def _solo(model, reqs: list[Request], **overrides) -> None:
    """Run ``reqs`` one after the other on one scheduler, each prefilled alone."""
    scheduler = _scheduler(model, **overrides)
    try:
        for req in reqs:
            _wait([scheduler.submit(req)])
    finally:
        scheduler.stop()


def _assert_same_logprobs(got: list, want: list) -> None:
    assert [t for _, t in got] == [t for _, t in want]
    assert [lp is None for lp, _ in got] == [lp is None for lp, _ in want]
    assert [lp for lp, _ in got if lp is not None] == pytest.approx([lp for lp, _ in want if lp is not None],
                                                                    abs=1e-4)


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
    # and the small one waited behind it. >=, not >: admitted in the same turn as big[1], it is now
    # prefilled in the same forward pass, and its first token is taken right after big[1]'s (microseconds).
    assert small.first_token_time >= big[1].first_token_time


def _logprob_request(i: int, max_new: int) -> Request:
    req = _request(i, max_new)
    req.return_logprob = True
    req.logprob_start_len = 3 * i  # 0, 3, 6, 9 for prompts of 4, 9, 14, 19 tokens
    req.top_logprobs_num = 3 if i % 2 else 0
    return req


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "left-padded"])
def test_requests_arriving_together_are_prefilled_in_one_pass(model, monkeypatch, packed: bool) -> None:
    """Four requests admitted together: one forward pass, and each gets what a prefill alone gives.

    Prompts of 4, 9, 14 and 19 tokens: packed end to end in one row of 46 tokens (the cheaper form
    here), or, with packing turned off, left-padded to 4 x 19."""
    if not packed:
        monkeypatch.setattr(batch_module, "_PACKED_MAX_TOKENS", 0)
    solo = [_logprob_request(i, 6) for i in range(4)]
    _solo(model, solo, enable_prefix_cache=False)
    counting = CountingModel(model)
    together = [_logprob_request(i, 6) for i in range(4)]
    _submitted_together(counting, together, enable_prefix_cache=False)
    assert counting.prefill_shapes() == ([(1, 46)] if packed else [(4, 19)])
    for alone, batched in zip(solo, together):
        assert batched.output_ids == alone.output_ids
        _assert_same_logprobs(batched.output_token_logprobs, alone.output_token_logprobs)
        _assert_same_logprobs(batched.input_token_logprobs, alone.input_token_logprobs)
        assert len(batched.input_token_logprobs) == batched.prompt_tokens - batched.logprob_start_len
        assert [[t for _, t in top] if top else None for top in batched.input_top_logprobs] == \
            [[t for _, t in top] if top else None for top in alone.input_top_logprobs]
    assert len({tuple(r.output_ids) for r in together}) == 4  # the rows are told apart: the check has teeth


def test_a_prefill_is_packed_where_padding_would_cost_more() -> None:
    """The FLOP estimate that picks packed or left-padded, on SmolLM2-135M's shapes: a quality stage's short prompts
    of mixed lengths pack; equal lengths, and long prompts whose packed attention would cost more, do not; a model
    whose attention would not take the packed mask (eager, sliding windows) never packs."""
    def config(**kw):
        return LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                           num_hidden_layers=1, vocab_size=64, attn_implementation="sdpa", **kw)

    def cheaper(lengths, packed=None):
        return batch_module._packing_is_cheaper(costs, lengths, sum(lengths) if packed is None else packed)

    costs = batch_module._prefill_costs(config())
    weights = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3
    assert costs == (2.0 * weights, 4.0 * 576)
    assert cheaper([14, 15, 16, 15, 9, 10, 10, 11, 25, 26, 24, 25])
    assert not cheaper([64] * 8)
    assert cheaper([64] * 8, packed=64 + 7 * 8)  # one 56-token context, eight endings of 8
    assert not cheaper([256] * 7 + [200])  # packed: 1992^2 pairs of attention
    assert cheaper([256, 16, 16, 16])
    assert not cheaper([1500, 600])  # more than _PACKED_MAX_TOKENS
    assert not cheaper([30])
    assert batch_module._prefill_costs(LlamaConfig(attn_implementation="eager")) is None
    windowed = config()
    windowed.sliding_window = 64
    assert batch_module._prefill_costs(windowed) is None


def test_prompts_sharing_a_context_compute_it_once_in_a_packed_prefill(model) -> None:
    """A quality stage's item: one context scored with four endings (and one unrelated prompt, and one prompt
    that is all context). The packed row holds the context once: 12 + 4 x 3 + 5 = 29 tokens, not 12 x 5 + 4 x 3
    + 5; each request gets what a prefill alone gives."""
    context = [40 + (13 * j) % 300 for j in range(12)]

    def requests() -> list[Request]:
        prompts = [[*context, 400 + 3 * e, 401 + 3 * e, 402 + 3 * e] for e in range(4)] + [[7, 8, 9, 10, 11], context]
        reqs = [Request(p, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), return_logprob=True,
                        logprob_start_len=len(context) - 1 if len(p) > len(context) else 2, top_logprobs_num=2)
                for p in prompts]
        return reqs

    solo, together = requests(), requests()
    _solo(model, solo, enable_prefix_cache=False)
    counting = CountingModel(model)
    _submitted_together(counting, together, enable_prefix_cache=False)
    assert counting.prefill_shapes() == [(1, 29)]
    for alone, batched in zip(solo, together):
        assert batched.output_ids == alone.output_ids
        assert batched.cached_tokens == 0
        _assert_same_logprobs(batched.input_token_logprobs, alone.input_token_logprobs)
        _assert_same_logprobs(batched.output_token_logprobs, alone.output_token_logprobs)
    assert len({tuple(r.output_ids) for r in together}) >= 4  # the endings are told apart: the check has teeth


def test_a_long_prompt_is_prefilled_in_chunks(model) -> None:
    """40 tokens at --chunked-prefill-size 16: passes of 16, 16 and 8 tokens, the same tokens and log-probs as one."""
    def request() -> Request:
        req = Request([10 + (11 * j) % 400 for j in range(40)],
                      SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                      return_logprob=True, logprob_start_len=5, top_logprobs_num=2)
        return req

    whole, chunked = request(), request()
    _solo(model, [whole], enable_prefix_cache=False)
    counting = CountingModel(model)
    _solo(counting, [chunked], chunked_prefill_size=16)
    assert counting.prefill_shapes() == [(1, 16), (1, 16), (1, 8)]
    assert chunked.output_ids == whole.output_ids
    _assert_same_logprobs(chunked.input_token_logprobs, whole.input_token_logprobs)
    _assert_same_logprobs(chunked.output_token_logprobs, whole.output_token_logprobs)
    # and both are the prompt's log-probs as the quality stage's in-process reference computes them
    reference, _ = input_token_logprobs(model, chunked.input_ids, start_len=5)
    _assert_same_logprobs(chunked.input_token_logprobs, [(lp, t) for lp, t, _ in reference])
    assert [[t for _, t in top] for top in chunked.input_top_logprobs[1:]] == \
        [[t for _, t in top] for top in whole.input_top_logprobs[1:]]


def test_a_prefill_batch_is_bounded_by_the_chunk_size_with_padding(model) -> None:
    """Prompts of 10, 10, 12 and 5 tokens at chunk 32: 10 + 10 + 12 = 32 tokens, but 3 x 12 = 36 once padded.

    The first pair, of equal lengths, goes left-padded; the second (12 and 5) packed in one row of 17."""
    lengths = [10, 10, 12, 5]
    reqs = [Request([20 + 13 * i + j for j in range(n)], SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                       ignore_eos=True)) for i, n in enumerate(lengths)]
    counting = CountingModel(model)
    _submitted_together(counting, reqs, chunked_prefill_size=32, enable_prefix_cache=False)
    assert counting.prefill_shapes() == [(2, 10), (1, 17)]
    assert all(len(r.output_ids) == 3 for r in reqs)
    # FIFO as far as batching allows: a later group's first tokens never come before an earlier group's
    times = [r.first_token_time for r in reqs]
    assert times == sorted(times)


def test_a_request_sharing_a_prefix_waits_and_reuses_the_cache(model) -> None:
    """A request sharing 40 tokens with one ahead of it is not batched with it: it goes next, reusing those 40."""
    prefix = [30 + (17 * j) % 400 for j in range(40)]
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    first, second = Request(prefix, params), Request([*prefix, 5, 6, 7, 8, 9, 10, 11, 12], params)
    cold = Request(list(second.input_ids), params)
    _solo(model, [cold], enable_prefix_cache=False)
    counting = CountingModel(model)
    _submitted_together(counting, [first, second])
    assert counting.prefill_shapes() == [(1, 40), (1, 8)]
    assert first.cached_tokens == 0 and second.cached_tokens == 40
    assert second.output_ids == cold.output_ids
    assert first.first_token_time <= second.first_token_time


def test_decoding_past_the_spare_kv_columns_matches_transformers_generate(model, monkeypatch) -> None:
    """The running batch's KV is written in place into spare columns and moved to a larger buffer when they run
    out (``batch._KV_SPARE_TOKENS``); rows joining, leaving and growing past them give ``generate``'s own tokens."""
    spare = 8  # few spare columns, so that short outputs run out of them several times
    monkeypatch.setattr(batch_module, "_KV_SPARE_TOKENS", spare)
    lengths = [spare + 6, 3 * spare + 5, spare // 2]
    want = []
    for i, n in enumerate(lengths):
        ids = torch.tensor([_request(i, n).input_ids])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
        want.append(out[0, ids.shape[1]:].tolist())
    reqs = [_request(i, n) for i, n in enumerate(lengths)]
    scheduler = _scheduler(model, enable_prefix_cache=False)
    try:
        scheduler.submit(reqs[0])
        while len(reqs[0].output_ids) < 3:  # the others join a running batch
            time.sleep(0.005)
        scheduler.submit_batch(reqs[1:])
        _wait(reqs)
    finally:
        scheduler.stop()
    assert [r.output_ids for r in reqs] == want
    assert len({tuple(o) for o in want}) == len(want)
