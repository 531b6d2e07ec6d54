"""Log-probabilities from a transformers model, in SGLang's ``/generate`` shape.

Pure functions over a loaded causal LM (no server state): the embedded worker's
``/generate`` (``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``) and
``/v1/completions`` (``logprobs``, ``echo``) call them, and the quality stage uses them
in-process as its reference. Values are real: ``log_softmax`` of the model's logits,
computed in float32 whatever the model's dtype.

SGLang's shape, which these functions reproduce:

- ``input_token_logprobs`` covers ``input_ids[start_len:]`` as ``[logprob, token_id, None]``
  triples (the third slot is the token text, which SGLang fills only with
  ``return_text_in_logprobs``). Entry 0 is always ``None``: SGLang pads the first returned
  position with None whatever ``logprob_start_len`` is, so entry ``i`` holds
  ``log P(input_ids[start_len + i] | input_ids[:start_len + i])`` for ``i >= 1``. To score
  tokens from position ``p`` on, ask for ``start_len = p - 1``.
- ``input_top_logprobs`` is aligned with it: entry 0 ``None``, entry ``i`` the top-k of the
  distribution that predicted position ``start_len + i``.
- ``output_token_logprobs[i] = log P(output_ids[i] | prompt + output_ids[:i])``, one triple
  per decode step (:func:`token_logprobs_from_logits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from servegate.errors import ConfigError

__all__ = [
    "LogprobTriple",
    "input_token_logprobs",
    "input_logprobs_from_logits",
    "batch_input_token_logprobs",
    "token_logprobs_from_logits",
    "top_logprobs",
    "log_softmax_f32",
]

LogprobTriple = list[Any]
"""``[logprob (float | None), token_id (int), text (None)]`` as SGLang's meta_info carries it."""


def log_softmax_f32(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dimension in float32 (bf16 logits would lose ~3 digits)."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_logprobs(logprob_row: torch.Tensor, top_k: int) -> list[LogprobTriple]:
    """The ``top_k`` most likely tokens of one log-probability row, best first, as triples."""
    k = min(int(top_k), logprob_row.shape[-1])
    values, indices = logprob_row.topk(k)
    return [[float(v), int(i), None] for v, i in zip(values.tolist(), indices.tolist())]


def token_logprobs_from_logits(logits_row: torch.Tensor, token_id: int,
                               top_k: int = 0) -> tuple[LogprobTriple, list[LogprobTriple] | None]:
    """One decode step: the chosen token's triple and, when ``top_k > 0``, the step's top-k.

    ``logits_row`` is the 1-D (vocab) logits row that produced ``token_id``, in any dtype;
    the log-softmax is taken in float32. Returns ``([logprob, token_id, None], top_k_triples
    or None)`` — what SGLang appends to ``output_token_logprobs`` / ``output_top_logprobs``.
    """
    if logits_row.dim() != 1:
        raise ConfigError(f"token_logprobs_from_logits needs one 1-D logits row, got shape {tuple(logits_row.shape)}; "
                          f"index the batch row first (logits[i])")
    lp = log_softmax_f32(logits_row)
    if not 0 <= int(token_id) < lp.shape[0]:
        raise ConfigError(f"token id {token_id} is outside the vocabulary (size {lp.shape[0]})")
    triple: LogprobTriple = [float(lp[int(token_id)]), int(token_id), None]
    return triple, (top_logprobs(lp, top_k) if top_k > 0 else None)


def _check_start(n: int, start_len: int) -> None:
    if n == 0:
        raise ConfigError("input_ids is empty: there is nothing to compute log-probabilities for")
    if not 0 <= start_len < n:
        raise ConfigError(f"logprob_start_len {start_len} is outside the prompt (length {n}); "
                          f"give 0 <= logprob_start_len < len(input_ids)")


def input_logprobs_from_logits(ids: Sequence[int], rows: torch.Tensor, start_len: int = 0,
                               top_k: int = 0) -> tuple[list[LogprobTriple], list[list[LogprobTriple] | None]]:
    """SGLang's ``(input_token_logprobs, input_top_logprobs)`` from logits a forward pass already made.

    ``rows`` are the raw logits (any dtype) of positions ``start_len .. len(ids) - 2`` — for a
    full-prompt forward, ``logits[start_len:len(ids) - 1]``; row ``i`` predicts
    ``ids[start_len + 1 + i]``, returned as entry ``i + 1`` (entry 0 is None, as SGLang).
    """
    n = len(ids)
    _check_start(n, start_len)
    if rows.shape[0] != n - 1 - start_len:
        raise ConfigError(f"got {rows.shape[0]} logits rows for {n - 1 - start_len} scored positions; pass "
                          f"logits[start_len:len(ids) - 1]")
    lp = log_softmax_f32(rows).cpu()
    targets = torch.tensor(list(ids[start_len + 1:n]), dtype=torch.long)
    values = lp.gather(1, targets[:, None]).squeeze(1).tolist() if len(targets) else []
    token_lp: list[LogprobTriple] = [[None, int(ids[start_len]), None]]
    token_lp += [[float(v), int(t), None] for v, t in zip(values, ids[start_len + 1:n])]
    tops: list[list[LogprobTriple] | None] = []
    if top_k > 0:
        tops = [None] + [top_logprobs(lp[i], top_k) for i in range(lp.shape[0])]
    return token_lp, tops


@torch.inference_mode()
def input_token_logprobs(model: Any, input_ids: Sequence[int], start_len: int = 0,
                         top_k: int = 0) -> tuple[list[LogprobTriple], list[list[LogprobTriple] | None]]:
    """Prompt log-probabilities of ``input_ids[start_len:]`` in SGLang's shape (one forward pass).

    Returns ``(input_token_logprobs, input_top_logprobs)``: ``len(input_ids) - start_len``
    triples ``[logprob, token_id, None]`` whose entry 0 is ``None`` (as SGLang), and, when
    ``top_k > 0``, as many top-k lists (entry 0 ``None``); otherwise an empty list.
    """
    ids = [int(t) for t in input_ids]
    _check_start(len(ids), start_len)
    device = next(model.parameters()).device
    n = len(ids)
    # Only the rows that predict ids[start_len+1:] go through the LM head and the softmax.
    out = model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False,
                logits_to_keep=n - start_len)
    return input_logprobs_from_logits(ids, out.logits[0, :-1], start_len, top_k)


@torch.inference_mode()
def batch_input_token_logprobs(model: Any, batch: Sequence[Sequence[int]], start_lens: Sequence[int],
                               top_k: int = 0, pad_token_id: int = 0
                               ) -> list[tuple[list[LogprobTriple], list[list[LogprobTriple] | None]]]:
    """:func:`input_token_logprobs` for several prompts in one right-padded forward pass.

    Right padding keeps every real position's logits exact: attention is causal, so a real
    token never attends to the padding after it, and positions start at 0 for every row.
    """
    if len(batch) != len(start_lens):
        raise ConfigError(f"{len(batch)} prompts but {len(start_lens)} start lengths; give one start per prompt")
    if not batch:
        return []
    seqs = [[int(t) for t in ids] for ids in batch]
    for ids, start in zip(seqs, start_lens):
        _check_start(len(ids), start)
    width = max(len(s) for s in seqs)
    device = next(model.parameters()).device
    input_ids = torch.full((len(seqs), width), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, ids in enumerate(seqs):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
    out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False)
    results = []
    for i, (ids, start) in enumerate(zip(seqs, start_lens)):
        results.append(input_logprobs_from_logits(ids, out.logits[i, int(start):len(ids) - 1], int(start), top_k))
    return results
