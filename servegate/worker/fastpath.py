"""CPU kernels for the embedded worker's model, chosen where transformers' defaults are slow on CPU.

Profiled on SmolLM2-135M in bfloat16, 1 torch thread, on this project's 2-core AVX-512 VM
(``benchmarks/worker_decode_kernels.py`` prints the figures side by side):

* **Packed linear weights.** A decode step is one matrix-vector product per weight matrix, so it
  reads every weight once: it is bound by memory bandwidth. ``torch.nn.functional.linear`` on a
  bfloat16 weight streams it at ~8 GB/s here; the same weight reordered once into oneDNN's blocked
  layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing and IPEX do) is
  read at ~13 GB/s. Same products, same float32 accumulation, bfloat16 out.
* **Attention in float32.** PyTorch's CPU flash-attention kernel is several times slower in
  bfloat16 than in float32 for one query row: 1.6 ms against 0.36 ms per layer at batch 8 and
  160 cached tokens, 0.18 against 0.06 ms at batch 1 (30 layers per step). The query, keys and
  values are upcast for the call and the output cast back; the KV cache stays in the model's
  dtype, so the KV budget is unchanged. The attention's own output is closer to a float32
  reference (isolated, max error 3e-7 against 1.5e-3 for the bfloat16 kernel); the model's
  logits stay bfloat16 noise away from float32's either way (SmolLM2, one prompt: max 0.51
  against 0.41), and greedy tokens at near-ties can differ from the default kernels'.

:func:`speed_up` applies both to a loaded model in place and says what it did. A packed ``lm_head``
that shares its weight with the input embedding (SmolLM2 ties them) is a second copy of that
matrix: vocabulary x hidden x 2 bytes more (57 MB for SmolLM2), not counted in the KV budget.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

__all__ = ["ATTENTION", "PackedLinear", "packing_available", "speed_up"]

log = logging.getLogger(__name__)

ATTENTION = "servegate_sdpa_float32"
"""The name the float32-upcast attention is registered under with transformers."""


class PackedLinear(nn.Module):
    """``nn.Linear`` over a weight reordered once into oneDNN's blocked layout (bfloat16 on CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def _sdpa_float32(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, computed in float32 and returned in the query's dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(ATTENTION, _sdpa_float32)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the same masks SDPA gets


def packing_available(dtype: torch.dtype) -> bool:
    """Whether bfloat16 weights can be oneDNN-packed in this torch build (and the model is bfloat16)."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def speed_up(model: nn.Module) -> list[str]:
    """Switch ``model`` (loaded on CPU with SDPA attention) to the kernels above, in place; returns what changed."""
    done: list[str] = []
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32 and getattr(model.config, "_attn_implementation", None) == "sdpa":
        _register_attention()
        model.set_attn_implementation(ATTENTION)
        done.append("attention computed in float32")
    if packing_available(dtype):
        packed = 0
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                    setattr(parent, name, PackedLinear(child))
                    packed += 1
        if packed:
            done.append(f"{packed} linear weights oneDNN-packed")
    log.info("CPU fast path: %s", "; ".join(done) or "nothing applies (dtype %s)" % dtype)
    return done
