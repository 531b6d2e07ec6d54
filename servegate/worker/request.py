"""One generation request of the embedded worker and its live state.

The HTTP routes build a :class:`Request`; the scheduler thread fills in its state (output
tokens, timings, log-probs, finish reason) and calls ``notify`` after each change. Every other
module of the worker uses it, so it imports only the sampling parameters and the worker's clock.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from servegate.worker.metrics import now
from servegate.worker.sampling import SamplingParams, top_logprobs

__all__ = ["Request", "KV"]

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer (keys, values), each ``[batch, kv_heads, tokens, head_dim]``."""


@dataclass(eq=False)
class Request:
    """One generation request and its live state.

    Only the scheduler thread writes the state fields; it calls ``notify`` (from that thread)
    after each change. Readers on other threads copy ``output_ids`` once per response chunk
    (``list(req.output_ids)``), because the list keeps growing while they read it.
    """

    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    user_request: bool = True
    """Counts towards the crash-after-N fault (``/health_generate`` does not)."""
    notify: Callable[[], None] | None = None
    # --- state, written by the scheduler thread ---
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    finished: bool = False
    aborted: bool = False
    created: float = field(default_factory=now)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    spec_verify_ct: int | None = None
    reserved_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    def e2e_latency(self) -> float:
        end = self.finish_time if self.finish_time is not None else now()
        return end - self.created

    def record_output_logprobs(self, lp_row: torch.Tensor, token: int) -> None:
        """Keep the log-prob of the sampled ``token`` (and the top ones when asked) from one log-softmax row."""
        self.output_token_logprobs.append((float(lp_row[token]), token))
        if self.top_logprobs_num > 0:
            self.output_top_logprobs.append(top_logprobs(lp_row, self.top_logprobs_num))
