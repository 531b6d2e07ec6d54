"""Sampling for the embedded worker: the request's ``sampling_params`` and the token picker.

Owns :class:`SamplingParams` (the subset of SGLang's ``sampling_params`` the worker honours,
validated at the HTTP boundary) and :class:`Sampler`, which turns one row of logits per
request into one token per request (greedy, temperature, top-k, top-p) from one seeded
generator. The corrupt-logits fault is applied here, where every prefill and decode logit
passes, so that no path can dodge it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from servegate.errors import ConfigError

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "SamplingParams", "Sampler", "top_logprobs"]

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


@dataclass(frozen=True)
class SamplingParams:
    """SGLang ``sampling_params`` (the subset the worker honours)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "SamplingParams":
        """Validate a JSON ``sampling_params`` object; unknown keys are ignored like SGLang does."""
        raw = dict(raw or {})
        try:
            max_new = raw.get("max_new_tokens")
            stop = raw.get("stop") or ()
            if isinstance(stop, str):
                stop = (stop,)
            params = cls(
                max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else int(max_new),
                temperature=float(raw.get("temperature", 1.0) if raw.get("temperature") is not None else 1.0),
                top_p=float(raw.get("top_p", 1.0) if raw.get("top_p") is not None else 1.0),
                top_k=int(raw.get("top_k", -1) if raw.get("top_k") is not None else -1),
                ignore_eos=bool(raw.get("ignore_eos", False)),
                stop=tuple(str(s) for s in stop if s),
                stop_token_ids=tuple(int(t) for t in (raw.get("stop_token_ids") or ())),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid sampling_params {raw!r}: {exc}; max_new_tokens/top_k must be integers, "
                              f"temperature/top_p numbers, stop a string or list of strings") from exc
        if params.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {params.max_new_tokens}")
        if params.temperature < 0 or math.isnan(params.temperature):
            raise ConfigError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ConfigError(f"top_p must be within (0, 1], got {params.top_p}")
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Sampler:
    """Picks one token per row of logits; one seeded generator, so a worker's run is reproducible."""

    def __init__(self, seed: int, *, corrupt_logits: bool = False) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._corrupt = corrupt_logits

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Model logits as the sampler and the logprobs see them (float32; the corrupt-logits fault)."""
        logits = logits.float()
        if self._corrupt:
            # Fluent-looking garbage with wrong log-probs: a regression only the quality stage catches.
            logits = torch.roll(logits, shifts=1, dims=-1)
        return logits

    def sample(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """One token per row of ``logits`` ([B, V], already processed), row i under ``params[i]``."""
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy
        temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=logits.dtype)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            kmax = max(k for k in top_ks if k > 0)
            vals, _ = probs.topk(min(kmax, probs.shape[-1]), dim=-1)
            ks = torch.tensor([min(k, vals.shape[-1]) if k > 0 else vals.shape[-1] for k in top_ks])
            thresh = vals.gather(1, (ks - 1)[:, None])
            probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
        top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
        if bool((top_ps < 1.0).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(-1)
            drop = (cum - sorted_p) > top_ps[:, None] * cum[:, -1:]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
        sampled = torch.multinomial(probs, 1, generator=self._generator).squeeze(1)
        is_greedy = torch.tensor([p.greedy for p in params])
        return torch.where(is_greedy, greedy, sampled)


def top_logprobs(lp_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The ``k`` most likely tokens of one log-softmax row as ``(logprob, token_id)`` pairs."""
    vals, idx = lp_row.topk(k)
    return list(zip(vals.tolist(), idx.tolist()))
