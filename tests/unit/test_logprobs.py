"""servegate.worker.logprobs against a direct computation on the real tiny-random model."""

from __future__ import annotations

import pytest
import torch

from servegate.errors import ConfigError
from servegate.worker.logprobs import (
    batch_input_token_logprobs,
    input_token_logprobs,
    token_logprobs_from_logits,
    top_logprobs,
)
from servegate.models import ensure_model, load_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model(ensure_model("tiny-random"), dtype="float32")
    return model, tokenizer


@pytest.fixture(scope="module")
def ids(tiny):
    _, tokenizer = tiny
    out = tokenizer.encode("The cat sat on the mat because the floor was warm")
    assert len(out) >= 8
    return out


def _full_logprobs(model, ids) -> torch.Tensor:
    """Row j: log P(. | ids[:j+1]), computed independently of the module under test."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("start", [0, 1, 5])
def test_input_logprobs_match_the_forward_pass_in_sglang_shape(tiny, ids, start):
    model, _ = tiny
    ref = _full_logprobs(model, ids)
    triples, tops = input_token_logprobs(model, ids, start_len=start)
    assert len(triples) == len(ids) - start
    assert tops == []
    # Entry 0 is None whatever the start, as SGLang pads it; the rest are aligned with ids[start:].
    assert triples[0] == [None, ids[start], None]
    assert [t[1] for t in triples] == ids[start:]
    for i, (lp, tok, text) in enumerate(triples[1:], start=1):
        pos = start + i
        assert text is None
        assert lp == pytest.approx(float(ref[pos - 1, tok]), abs=1e-5)
        assert lp < 0


def test_top_logprobs_are_aligned_sorted_and_hold_the_argmax(tiny, ids):
    model, _ = tiny
    ref = _full_logprobs(model, ids)
    triples, tops = input_token_logprobs(model, ids, start_len=2, top_k=3)
    assert len(tops) == len(triples) and tops[0] is None
    for i, top in enumerate(tops[1:], start=1):
        row = ref[2 + i - 1]
        assert len(top) == 3
        values = [v for v, _, _ in top]
        assert values == sorted(values, reverse=True)
        assert top[0][1] == int(row.argmax())
        assert top[0][0] == pytest.approx(float(row.max()), abs=1e-5)
        # The scored token is never more likely than the best one.
        assert triples[i][0] <= top[0][0] + 1e-6


def test_batch_matches_single_prompts(tiny, ids):
    model, _ = tiny
    batch = [ids, ids[:4], ids[2:9]]
    starts = [3, 0, 2]
    got = batch_input_token_logprobs(model, batch, starts, top_k=2)
    for (triples, tops), prompt, start in zip(got, batch, starts):
        want, want_tops = input_token_logprobs(model, prompt, start, top_k=2)
        assert [t[1] for t in triples] == [t[1] for t in want]
        assert triples[0][0] is None
        assert [t[0] for t in triples[1:]] == pytest.approx([t[0] for t in want[1:]], abs=1e-5)
        assert [[t[1] for t in top] for top in tops[1:]] == [[t[1] for t in top] for top in want_tops[1:]]


def test_decode_step_logprob_is_float32_log_softmax_of_the_row():
    torch.manual_seed(0)
    row = (torch.randn(50) * 4).to(torch.bfloat16)
    triple, top = token_logprobs_from_logits(row, 7, top_k=4)
    expected = torch.log_softmax(row.float(), dim=-1)
    assert triple == [pytest.approx(float(expected[7]), abs=1e-6), 7, None]
    assert [t[1] for t in top] == expected.topk(4).indices.tolist()
    assert token_logprobs_from_logits(row, 7)[1] is None
    assert top_logprobs(expected, 100)[-1][1] == int(expected.argmin())  # k clipped to the vocabulary


def test_decode_step_logprob_on_the_real_model(tiny, ids):
    model, _ = tiny
    ref = _full_logprobs(model, ids)
    with torch.no_grad():
        last = model(input_ids=torch.tensor([ids])).logits[0, -1]
    token = int(last.argmax())
    triple, _ = token_logprobs_from_logits(last, token)
    assert triple[0] == pytest.approx(float(ref[-1, token]), abs=1e-5)


def test_bad_arguments_are_config_errors(tiny, ids):
    model, _ = tiny
    with pytest.raises(ConfigError, match="logprob_start_len"):
        input_token_logprobs(model, ids, start_len=len(ids))
    with pytest.raises(ConfigError, match="empty"):
        input_token_logprobs(model, [], start_len=0)
    with pytest.raises(ConfigError, match="start"):
        batch_input_token_logprobs(model, [ids], [0, 1])
    with pytest.raises(ConfigError, match="1-D"):
        token_logprobs_from_logits(torch.zeros(2, 5), 1)
    with pytest.raises(ConfigError, match="vocabulary"):
        token_logprobs_from_logits(torch.zeros(5), 9)


def test_from_existing_logits_equals_the_own_forward(tiny, ids):
    from servegate.worker.logprobs import input_logprobs_from_logits

    model, _ = tiny
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    start = 3
    got = input_logprobs_from_logits(ids, logits[start:len(ids) - 1], start, top_k=2)
    want = input_token_logprobs(model, ids, start, top_k=2)
    assert [t[1] for t in got[0]] == [t[1] for t in want[0]]
    assert [t[0] for t in got[0][1:]] == pytest.approx([t[0] for t in want[0][1:]], abs=1e-5)
    with pytest.raises(ConfigError, match="logits rows"):
        input_logprobs_from_logits(ids, logits, start)
