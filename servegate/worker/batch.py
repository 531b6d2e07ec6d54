"""The running batch of the embedded worker: one left-padded KV cache, and the forward passes over it.

Owns the tensors of continuous batching and nothing about who gets in:

* :meth:`Batch.prefill` runs one new request alone (reusing the longest cached prompt
  prefix), computes its input log-probs when asked, and samples its first token;
* :meth:`Batch.merge` joins prefilled requests to the batch by left-padding whichever side is
  shorter; padded columns are masked out by a per-row attention mask, and every row carries its
  own ``position_ids`` so that padding never shifts RoPE positions;
* :meth:`Batch.decode` feeds each row's last token through the model once (a batched decode on
  a ``DynamicCache``);
* :meth:`Batch.select` keeps only the rows still running and trims leading columns that are
  padding in every remaining row.

Padding is not counted against the KV budget: the padded batch can hold up to
``batch * longest_row`` tokens of KV.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import DynamicCache

from servegate.worker.kv_budget import PrefixCache
from servegate.worker.metrics import now
from servegate.worker.request import KV, Request
from servegate.worker.sampling import Sampler, top_logprobs

__all__ = ["Batch"]


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class Batch:
    """The requests decoding together and their KV; driven by the scheduler thread only.

    ``rows`` is also read by other threads (load, gauges) under ``lock``, the scheduler's lock;
    every change of ``rows`` happens under it. The tensors are the scheduler thread's alone.
    """

    def __init__(self, model: Any, sampler: Sampler, lock: threading.Condition) -> None:
        self.model = model
        self.sampler = sampler
        self.lock = lock
        self.rows: list[Request] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._pos = torch.zeros(0, dtype=torch.long)
        self._last = torch.zeros(0, dtype=torch.long)

    def used_tokens(self) -> int:
        """KV tokens the rows hold without padding (prompt plus output so far)."""
        return sum(len(r.input_ids) + len(r.output_ids) for r in self.rows)

    def clear_locked(self) -> None:
        """Drop every row and its KV (caller holds ``lock``)."""
        self.rows = []
        self._cache = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._pos = torch.zeros(0, dtype=torch.long)
        self._last = torch.zeros(0, dtype=torch.long)

    # ------------------------------------------------------------------ prefill
    def prefill(self, req: Request, prefix_cache: PrefixCache | None) -> tuple[KV, int]:
        """Run ``req``'s prompt alone, reusing the longest prefix ``prefix_cache`` holds (None: no reuse).

        Returns the prompt's KV and the first sampled token (-1 when ``max_new_tokens`` is 0).
        Sets ``req.cached_tokens`` and, when asked, its input and first output log-probs.
        """
        ids = req.input_ids
        n = len(ids)
        # Prompt log-probs need logits for every prompt token, and reused tokens produce none.
        want_input_lp = req.return_logprob and 0 <= req.logprob_start_len < n
        reuse, stored = 0, None
        if prefix_cache is not None and not want_input_lp:
            reuse, stored = prefix_cache.lookup(ids)
            reuse = min(reuse, n - 1)  # at least one token must run to produce logits
        cache = DynamicCache(config=self.model.config)
        if reuse > 0 and stored is not None:
            for layer, (k, v) in zip(cache.layers, stored):
                layer.update(k[:, :, :reuse], v[:, :, :reuse])
        req.cached_tokens = reuse
        rest = torch.tensor([ids[reuse:]], dtype=torch.long)
        positions = torch.arange(reuse, n, dtype=torch.long)[None, :]
        out = self.model(input_ids=rest, position_ids=positions, past_key_values=cache, use_cache=True,
                         logits_to_keep=0 if want_input_lp else 1)
        logits = self.sampler.process(out.logits[0])
        if want_input_lp:
            lp = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(ids[1:], dtype=torch.long)
            token_lp = lp[:-1].gather(1, targets[:, None]).squeeze(1).tolist() if n > 1 else []
            # SGLang's shape: entry 0 is None whatever logprob_start_len is; entry i is
            # log P(ids[start + i] | ids[:start + i]).
            start = req.logprob_start_len
            full: list[tuple[float | None, int]] = [(None, ids[0])] + list(zip(token_lp, ids[1:]))
            req.input_token_logprobs = [(None, ids[start])] + full[start + 1:]
            if req.top_logprobs_num > 0:
                req.input_top_logprobs = [None] + [top_logprobs(lp[i - 1], req.top_logprobs_num)
                                                   for i in range(start + 1, n)]
        last = logits[-1:]
        first = int(self.sampler.sample(last, [req.params])[0]) if req.params.max_new_tokens > 0 else -1
        if req.return_logprob and first >= 0:
            req.record_output_logprobs(torch.log_softmax(last[0], dim=-1), first)
        return [(layer.keys, layer.values) for layer in cache.layers], first

    def merge(self, joined: list[tuple[Request, KV, int]]) -> None:
        """Left-pad the batch and the new rows (request, prompt KV, first token) to one length and concatenate them."""
        old_len = self._mask.shape[1] if self.rows else 0
        new_len = max([old_len] + [len(r.input_ids) for r, _, _ in joined])
        n_layers = len(joined[0][1])
        keys: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        values: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        masks: list[torch.Tensor] = []
        if self.rows and self._cache is not None:
            for i, layer in enumerate(self._cache.layers):
                keys[i].append(_pad_left(layer.keys, new_len - old_len, 2))
                values[i].append(_pad_left(layer.values, new_len - old_len, 2))
            masks.append(_pad_left(self._mask, new_len - old_len, 1))
        for req, kv, _ in joined:
            p = len(req.input_ids)
            for i, (k, v) in enumerate(kv):
                keys[i].append(_pad_left(k, new_len - p, 2))
                values[i].append(_pad_left(v, new_len - p, 2))
            masks.append(_pad_left(torch.ones(1, p, dtype=torch.long), new_len - p, 1))
        cache = self._cache if (self.rows and self._cache is not None) else DynamicCache(config=self.model.config)
        for i, layer in enumerate(cache.layers):
            k = torch.cat(keys[i], dim=0) if len(keys[i]) > 1 else keys[i][0]
            v = torch.cat(values[i], dim=0) if len(values[i]) > 1 else values[i][0]
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        # The concatenation above runs unlocked (it is the slow part); only the switch to the
        # new rows is published under the lock.
        with self.lock:
            self._cache = cache
            self._mask = torch.cat(masks, dim=0) if len(masks) > 1 else masks[0]
            self._pos = torch.cat([self._pos, torch.tensor([len(r.input_ids) for r, _, _ in joined])])
            self._last = torch.cat([self._last, torch.tensor([tok for _, _, tok in joined])])
            self.rows = self.rows + [r for r, _, _ in joined]

    # ------------------------------------------------------------------ decode
    def decode(self) -> tuple[list[int], float]:
        """One decode step over every row: (the token sampled per row, seconds spent in the forward pass).

        The forward time covers the model call, sampling and log-probs; the occupancy gauge
        divides it by the step's wall time.
        """
        rows = self.rows
        batch = len(rows)
        self._mask = torch.cat([self._mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
        fwd_start = now()
        out = self.model(input_ids=self._last[:, None], attention_mask=self._mask, position_ids=self._pos[:, None],
                         past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        logits = self.sampler.process(out.logits[:, -1, :])
        tokens = self.sampler.sample(logits, [r.params for r in rows])
        if any(r.return_logprob for r in rows):
            lp = torch.log_softmax(logits, dim=-1)
            toks = tokens.tolist()
            for i, r in enumerate(rows):
                if r.return_logprob:
                    r.record_output_logprobs(lp[i], toks[i])
        fwd_s = now() - fwd_start
        self._pos = self._pos + 1
        self._last = tokens
        return tokens.tolist(), fwd_s

    def select_locked(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (indices into ``rows``) and their KV (caller holds ``lock``)."""
        if not keep:
            self.clear_locked()
            return
        index = torch.tensor(keep, dtype=torch.long)
        self.rows = [self.rows[i] for i in keep]
        self._mask = self._mask[index]
        self._pos = self._pos[index]
        self._last = self._last[index]
        # Columns that are padding in every remaining row carry no information: trim them.
        first_real = int(self._mask.any(dim=0).to(torch.int8).argmax())
        assert self._cache is not None
        for layer in self._cache.layers:
            k = layer.keys[index]
            v = layer.values[index]
            if first_real:
                k, v = k[:, :, first_real:], v[:, :, first_real:]
            layer.keys, layer.values = k, v
        if first_real:
            self._mask = self._mask[:, first_real:]

