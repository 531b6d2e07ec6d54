"""The embedded worker's CPU kernels (servegate/worker/fastpath.py): same model, faster operators.

Each kernel is compared with what it replaces on real tensors, and the tiny random model with both
applied is compared, teacher-forced, with its float32 self; a worker started in bfloat16 says in
``/get_server_info`` what it switched, and ``--disable-cpu-fastpath`` switches nothing.
"""

from __future__ import annotations

import pytest
import requests
import torch
import torch.nn.functional as F
from torch import nn
from workerutil import generate

from servegate.models import ensure_model, load_model
from servegate.worker import fastpath

pytestmark = pytest.mark.skipif(not fastpath.packing_available(torch.bfloat16),
                                reason="this torch build has no oneDNN bfloat16 packing")


@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (2, 5, 576)])
def test_a_packed_linear_computes_what_the_linear_does(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=True).to(torch.bfloat16)
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        expected = F.linear(x.float(), linear.weight.float(), linear.bias.float())
        got = fastpath.PackedLinear(linear)(x)
    assert got.shape == (*shape[:-1], 1536) and got.dtype == torch.bfloat16
    # Both accumulate in float32 and round once to bfloat16 (8 bits of mantissa): ~0.4 % relative.
    assert torch.allclose(got.float(), expected, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(got.float(), expected * 1.05, rtol=1e-2, atol=1e-2)  # the check can fail


def test_attention_in_float32_matches_float32_sdpa_with_a_padding_mask() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, heads, length, 64).to(torch.bfloat16)
               for heads, length in ((9, 1), (3, 40), (3, 40)))
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :15] = False  # row 0 is left-padded

    class Layer(nn.Module):
        num_key_value_groups = 3
        is_causal = True

    out, _ = fastpath._sdpa_float32(Layer(), q, k, v, mask, scaling=0.125)
    reference = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(3, 1),
                                               v.float().repeat_interleave(3, 1), attn_mask=mask, scale=0.125)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 1, 9, 64)  # transformers' [batch, q, heads, dim]
    assert torch.allclose(out.float(), reference.transpose(1, 2), atol=1e-2)
    padded_out, _ = fastpath._sdpa_float32(Layer(), q, k, v, None, scaling=0.125)
    assert not torch.allclose(padded_out[0].float(), out[0].float(), atol=1e-2)  # the mask mattered


def _logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits.float().log_softmax(-1)


def test_the_tiny_model_with_the_fast_path_scores_as_its_float32_self() -> None:
    path = ensure_model("tiny-random")
    reference, _ = load_model(path, "float32")
    model, tokenizer = load_model(path, "bfloat16")
    ids = torch.tensor([tokenizer("The capital of France is Paris, and the capital of Spain is")["input_ids"]])
    default_err = (_logprobs(model, ids) - _logprobs(reference, ids)).abs().max()
    assert fastpath.speed_up(model) == ["attention computed in float32", "15 linear weights oneDNN-packed"]
    assert model.config._attn_implementation == fastpath.ATTENTION
    assert sum(isinstance(m, fastpath.PackedLinear) for m in model.modules()) == 15
    fast_err = (_logprobs(model, ids) - _logprobs(reference, ids)).abs().max()
    # Every position's log-probabilities, teacher-forced: the fast path is bfloat16 noise away from
    # float32, as the default kernels are (the quality stage allows 0.3 per token).
    assert fast_err < 0.1 and fast_err < 3 * default_err + 0.02, (fast_err, default_err)
    # A float32 model is left alone: nothing to pack, and SDPA already computes in float32.
    assert fastpath.speed_up(reference) == []
    assert reference.config._attn_implementation == "sdpa"


def test_a_bfloat16_worker_says_what_it_switched_and_the_flag_turns_it_off(start_worker) -> None:
    args = ["--model", "tiny-random", "--dtype", "bfloat16", "--context-length", "1024", "--num-threads", "1"]
    fast = start_worker([], model_args=args)
    plain = start_worker(["--disable-cpu-fastpath"], model_args=args)
    info = {name: requests.get(w.url + "/get_server_info", timeout=10).json() for name, w in
            (("fast", fast), ("plain", plain))}
    assert info["fast"]["cpu_fastpath"] == ["attention computed in float32", "15 linear weights oneDNN-packed"]
    assert info["plain"]["cpu_fastpath"] == [] and info["plain"]["disable_cpu_fastpath"] is True
    for worker in (fast, plain):  # both serve
        out = generate(worker.url, {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 4, out.text
