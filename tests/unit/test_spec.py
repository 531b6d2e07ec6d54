"""NGRAM speculative decoding: greedy-exact against transformers' generate, streaming, stops.

The equality tests run random-weight models in float32 (speculation must not change a
single greedy token): the project's ``tiny-random`` and a test-local untied Llama. The
latter matters: ``tiny-random`` (tied embeddings) greedily repeats its last input token
forever, so every draft is accepted and the crop-after-rejection path would go untested.
The accept-length test needs a model that actually copies its prompt, so it runs the real
SmolLM2 and is marked e2e.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from servegate.errors import ConfigError
from servegate.models import ensure_model, load_model
from servegate.worker.spec import NgramDraftIndex, SpecResult, speculative_generate

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 48


@pytest.fixture(scope="module")
def tiny():
    model, _tokenizer = load_model(ensure_model("tiny-random"), dtype="float32")
    return model


@pytest.fixture(scope="module")
def untied():
    """A random Llama whose greedy output wanders: drafts get both accepted and rejected."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(params=["tiny", "untied"])
def model(request):
    return request.getfixturevalue(request.param)


def _greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: int | None,
                      logits_processor=None) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = {} if logits_processor is None else {"logits_processor": LogitsProcessorList([logits_processor])}
    # attention_mask given explicitly: generate would otherwise mask prompt tokens equal to pad_token_id.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def _repetitive_prompt() -> list[int]:
    return [100 + i for i in range(12)] * 4 + [100, 101, 102]


def _random_prompt(seed: int = 3, length: int = 40) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (length,), generator=gen).tolist()


def _spec(model, prompt, *, k=4, max_new=MAX_NEW, eos=frozenset(), ignore_eos=True,
          **kwargs) -> tuple[SpecResult, list[int]]:
    streamed: list[int] = []
    result = speculative_generate(model, prompt, max_new_tokens=max_new, num_draft_tokens=k, eos_token_ids=set(eos),
                                  ignore_eos=ignore_eos, on_token=streamed.append, **kwargs)
    return result, streamed


# --- NgramDraftIndex ---------------------------------------------------------------------------

def test_draft_index_copies_what_followed_the_latest_match():
    index = NgramDraftIndex([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3])
    # suffix (2, 3) last occurred before at positions 6-7, followed by 7, 8, 2, 3
    assert index.propose(3) == [7, 8, 2]


def test_draft_index_prefers_the_longest_ngram():
    index = NgramDraftIndex([5, 1, 2, 6, 0, 1, 2, 7, 5, 1, 2])
    # (1, 2) most recently continues with 7, but (5, 1, 2) pins the earlier occurrence followed by 6
    assert index.propose(2) == [6, 0]


def test_draft_index_extends_a_short_loop_to_the_full_draft():
    index = NgramDraftIndex([4, 8, 9, 8, 9])
    assert index.propose(5) == [8, 9, 8, 9, 8]


def test_draft_index_never_matches_the_suffix_with_itself():
    index = NgramDraftIndex([1, 2, 3])
    assert index.propose(4) == []
    index.append(1)
    assert index.propose(4) == [2, 3, 1, 2]
    assert index.propose(0) == []


def test_draft_index_rejects_a_bad_window():
    with pytest.raises(ConfigError, match="min_ngram"):
        NgramDraftIndex(min_ngram=3, max_ngram=2)


# --- speculative_generate: exactness -------------------------------------------------------

@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("prompt_kind", ["repetitive", "random"])
def test_output_equals_plain_greedy_ignore_eos(model, k, prompt_kind):
    prompt = _repetitive_prompt() if prompt_kind == "repetitive" else _random_prompt()
    reference = _greedy_reference(model, prompt, MAX_NEW, eos=None)
    assert len(reference) == MAX_NEW
    result, streamed = _spec(model, prompt, k=k)
    assert result.output_ids == reference
    assert streamed == reference
    assert result.finish_reason == "length"
    assert 1 <= result.verify_ct <= MAX_NEW - 1
    assert result.accept_length == pytest.approx(MAX_NEW / result.verify_ct)


@pytest.mark.parametrize("prompt_kind", ["repetitive", "random"])
def test_equality_cases_both_accept_and_reject_drafts(untied, prompt_kind):
    # Guards the equality tests above: they only prove something if drafts were both
    # accepted (cache kept) and rejected (cache cropped) along the way.
    fed: list[int] = []
    hook = untied.register_forward_pre_hook(lambda _m, _a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        prompt = _repetitive_prompt() if prompt_kind == "repetitive" else _random_prompt()
        result, _ = _spec(untied, prompt, k=4)
    finally:
        hook.remove()
    verify_fed = fed[1:]  # fed[0] is the prefill
    produced_by_verify = len(result.output_ids) - 1
    assert len(verify_fed) == result.verify_ct
    assert result.verify_ct < produced_by_verify, "no draft accepted: the equality test proves little"
    assert sum(verify_fed) > produced_by_verify, "no draft rejected: cropping the cache went untested"


def test_stops_on_eos_like_generate(untied):
    prompt = _repetitive_prompt()
    free_run = _greedy_reference(untied, prompt, MAX_NEW, eos=None)
    stop_at = 20
    eos = free_run[stop_at]
    expected = free_run[:free_run.index(eos) + 1]  # the first occurrence ends generation, EOS included
    assert len(expected) > 5, "pick an EOS that the free run reaches after a few verify passes"
    assert _greedy_reference(untied, prompt, MAX_NEW, eos=eos) == expected
    result, streamed = _spec(untied, prompt, eos={eos}, ignore_eos=False)
    assert result.output_ids == expected
    assert streamed == expected
    assert result.finish_reason == "stop"

    ignoring, _ = _spec(untied, prompt, eos={eos}, ignore_eos=True)
    assert ignoring.output_ids == free_run
    assert ignoring.finish_reason == "length"


class _BanToken(LogitsProcessor):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[:, self.token] = -math.inf
        return scores


def test_logits_processor_applies_at_every_position(untied):
    prompt = _repetitive_prompt()
    free_run = _greedy_reference(untied, prompt, MAX_NEW, eos=None)
    banned = max(set(free_run), key=free_run.count)
    reference = _greedy_reference(untied, prompt, MAX_NEW, eos=None, logits_processor=_BanToken(banned))
    result, _ = _spec(untied, prompt, logits_processor=_BanToken(banned))
    assert banned not in result.output_ids
    assert result.output_ids == reference


# --- speculative_generate: budget, abort, errors ----------------------------------------------

@pytest.mark.parametrize("max_new", [2, 3, 7])
def test_never_exceeds_max_new_tokens(untied, max_new):
    prompt = _repetitive_prompt()
    result, _ = _spec(untied, prompt, k=8, max_new=max_new)
    assert result.output_ids == _greedy_reference(untied, prompt, MAX_NEW, eos=None)[:max_new]


def test_one_token_needs_no_verify_pass(tiny):
    result, streamed = _spec(tiny, _random_prompt(), max_new=1)
    assert len(result.output_ids) == 1 and streamed == result.output_ids
    assert result.verify_ct == 0
    assert math.isnan(result.accept_length)


def test_zero_tokens_runs_nothing(tiny):
    result, streamed = _spec(tiny, _random_prompt(), max_new=0)
    assert result.output_ids == [] and streamed == [] and result.verify_ct == 0


def test_should_stop_aborts_between_passes(untied):
    prompt = _repetitive_prompt()
    streamed: list[int] = []
    result = speculative_generate(untied, prompt, max_new_tokens=MAX_NEW, num_draft_tokens=4, eos_token_ids=set(),
                                  ignore_eos=True, on_token=streamed.append, should_stop=lambda: len(streamed) >= 5)
    assert result.finish_reason == "abort"
    assert 5 <= len(result.output_ids) < MAX_NEW
    assert result.output_ids == _greedy_reference(untied, prompt, MAX_NEW, eos=None)[:len(result.output_ids)]


def test_should_stop_before_prefill_generates_nothing(tiny):
    result, streamed = _spec(tiny, _random_prompt(), should_stop=lambda: True)
    assert (result.output_ids, streamed, result.finish_reason) == ([], [], "abort")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"input_ids": []}, "non-empty prompt"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
])
def test_invalid_arguments_raise_config_error(tiny, kwargs, match):
    args = {"input_ids": [1, 2, 3], "max_new_tokens": 4, "num_draft_tokens": 2}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        speculative_generate(tiny, args.pop("input_ids"), eos_token_ids=set(), ignore_eos=True,
                             on_token=lambda _t: None, **args)


# --- the real model: speculation pays off on text that repeats its prompt -----------------------

PASSAGE = ("The lighthouse keeper climbed the narrow stairs every evening, lit the great lamp, "
           "and wrote the weather, the passing ships and the state of the sea in his logbook.")


@pytest.mark.timeout(600)
def test_accept_length_above_one_when_the_answer_repeats_the_prompt():
    model, tokenizer = load_model(ensure_model("smollm2-135m"), dtype="float32")
    messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(encoded if isinstance(encoded, list) else encoded["input_ids"])
    eos = tokenizer.eos_token_id
    result, _ = _spec(model, prompt, k=4, max_new=48, eos={eos}, ignore_eos=False)
    assert result.output_ids == _greedy_reference(model, prompt, 48, eos=eos)
    # Measured: 36 tokens in 9 verify passes = 4.0 (K=4, fp32 and bf16); plain decoding would be 1.0.
    text = tokenizer.decode(result.output_ids)
    assert result.accept_length > 1.5, f"accept length {result.accept_length:.2f} for {text!r}"
