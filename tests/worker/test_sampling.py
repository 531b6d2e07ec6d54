"""Sampling parameters and the token picker (servegate.worker.sampling), in process."""

from __future__ import annotations

import pytest
import torch

from servegate.errors import ConfigError
from servegate.worker.sampling import Sampler, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
WARM = SamplingParams(temperature=1.0)


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, 50, generator=torch.Generator().manual_seed(7))


def test_the_same_seed_draws_the_same_tokens() -> None:
    logits = _logits(4)
    a = [Sampler(3).sample(logits, [WARM] * 4).tolist() for _ in range(2)]
    assert a[0] == a[1]


def test_greedy_rows_of_a_mixed_batch_keep_their_argmax() -> None:
    logits = _logits(4)
    tokens = Sampler(0).sample(logits, [GREEDY, WARM, SamplingParams(top_k=1), WARM])
    argmax = logits.argmax(dim=-1)
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]


def test_top_k_and_top_p_only_draw_from_the_head() -> None:
    logits = _logits(1).repeat(200, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    drawn = Sampler(1).sample(logits, [SamplingParams(top_k=3)] * 200).tolist()
    assert set(drawn) <= top3
    peaked = torch.full((1, 50), -10.0)
    peaked[0, 4] = 10.0
    assert Sampler(1).sample(peaked.repeat(50, 1), [SamplingParams(top_p=0.5)] * 50).tolist() == [4] * 50


def test_the_corrupt_logits_fault_shifts_every_logit_by_one() -> None:
    logits = _logits(2)
    assert torch.equal(Sampler(0, corrupt_logits=True).process(logits), torch.roll(logits, 1, dims=-1))
    assert torch.equal(Sampler(0).process(logits), logits)


@pytest.mark.parametrize("raw", [{"max_new_tokens": -1}, {"temperature": -0.5}, {"top_p": 0}, {"top_k": "x"}])
def test_invalid_sampling_params_are_config_errors(raw: dict) -> None:
    with pytest.raises(ConfigError):
        SamplingParams.from_dict(raw)
