"""The running batch of the embedded worker: one left-padded KV cache, and the forward passes over it.

Owns the tensors of continuous batching and nothing about who gets in:

* :meth:`Batch.prefill` runs newly admitted requests, as SGLang's chunked prefill does: one
  request alone reuses the longest cached prompt prefix and runs the rest in chunks of at most
  ``chunk_tokens`` tokens (one forward pass each, so a long prompt never needs its whole
  attention and logits at once); several requests run together in one forward pass without
  prefix reuse, either left-padded to the longest or packed in one row, each distinct prompt
  prefix once, under a mask that keeps each token to its own request's prompt (:class:`_Packing`),
  whichever costs fewer FLOPs (:func:`_packing_is_cheaper`: padding computes ``rows x longest``
  tokens, packing makes attention span the whole row). Either way the input log-probs are
  recorded chunk by chunk (:func:`start_input_logprobs`, :func:`record_input_logprobs`, the only
  code that fills them) and the first token is sampled;
* :meth:`Batch.merge` joins prefilled requests to the batch by left-padding whichever side is
  shorter; padded columns are masked out by a per-row attention mask, and every row carries its
  own ``position_ids`` so that padding never shifts RoPE positions;
* :meth:`Batch.decode` feeds each row's last token through the model once (a batched decode on
  a ``DynamicCache`` whose layers write each step's KV into spare columns, :class:`_BatchKVLayer`);
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
from transformers.cache_utils import DynamicLayer

from servegate.worker.kv_budget import PrefixCache
from servegate.worker.metrics import now
from servegate.worker.request import KV, Request
from servegate.worker.sampling import Sampler, top_logprobs

__all__ = ["Batch", "start_input_logprobs", "record_input_logprobs"]


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


_KV_SPARE_TOKENS = 64
"""Columns a running batch's KV holds beyond its length, so that decode steps write in place.

A ``DynamicLayer`` concatenates a step's KV to the whole cache, a copy of the batch's KV per
layer per step: profiled on SmolLM2 at batch 8 with 96 tokens of KV, 7 % of a decode step. With
spare columns a step writes one column, and the batch is copied once per this many steps. The
spare columns are not counted against the KV budget, as padding is not (at most batch x this)."""


class _BatchKVLayer(DynamicLayer):
    """One layer of the running batch's KV: ``keys``/``values`` are views of buffers with spare columns."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buf = self._value_buf = torch.zeros(0)

    def assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys``/``values`` (``[batch, kv_heads, tokens, head_dim]``), copied into buffers with spare
        columns (never aliased: the prefix cache may hold the tensors given)."""
        batch, heads, tokens, dim = keys.shape
        self._key_buf = keys.new_empty(batch, heads, tokens + _KV_SPARE_TOKENS, dim)
        self._value_buf = values.new_empty(batch, heads, tokens + _KV_SPARE_TOKENS, dim)
        self._key_buf[:, :, :tokens] = keys
        self._value_buf[:, :, :tokens] = values
        self.keys, self.values = self._key_buf[:, :, :tokens], self._value_buf[:, :, :tokens]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.keys.shape[2]
        end = start + key_states.shape[2]
        if end > self._key_buf.shape[2]:
            self.assign(self.keys, self.values)
        self._key_buf[:, :, start:end] = key_states
        self._value_buf[:, :, start:end] = value_states
        self.keys, self.values = self._key_buf[:, :, :end], self._value_buf[:, :, :end]
        return self.keys, self.values


def _batch_cache(model_config: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` of :class:`_BatchKVLayer` holding ``kv`` (per layer, keys and values)."""
    cache = DynamicCache(config=model_config)
    cache.layers = [_BatchKVLayer() for _ in kv]
    for layer, (k, v) in zip(cache.layers, kv):
        layer.assign(k, v)
    return cache


_PACKED_MAX_TOKENS = 2048
"""The most tokens a packed prefill holds: its mask is ``tokens x tokens`` (4 M entries at most)."""

_PACKED_ATTENTION = ("sdpa", "servegate_sdpa_float32")
"""Attention implementations that take a boolean 4-D mask as given (``servegate.worker.fastpath.ATTENTION`` too)."""


def _prefill_costs(model_config: Any) -> tuple[float, float] | None:
    """FLOPs per layer of a prefill, ``(per token through the weights, per query-key pair of attention)``,
    for a model whose attention takes a packed prefill's mask; None when it does not (eager attention,
    sliding windows, a config without the sizes): such a model is always left-padded."""
    hidden = getattr(model_config, "hidden_size", None)
    inter = getattr(model_config, "intermediate_size", None)
    heads = getattr(model_config, "num_attention_heads", None)
    if not (isinstance(hidden, int) and isinstance(inter, int) and isinstance(heads, int)) or heads < 1:
        return None
    if getattr(model_config, "_attn_implementation", None) not in _PACKED_ATTENTION:
        return None
    if getattr(model_config, "sliding_window", None) or any(
            t != "full_attention" for t in getattr(model_config, "layer_types", None) or ()):
        return None
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    kv_dim = (getattr(model_config, "num_key_value_heads", None) or heads) * head_dim
    q_dim = heads * head_dim
    weights = hidden * q_dim * 2 + hidden * kv_dim * 2 + hidden * inter * 3  # q, o; k, v; gate, up, down
    return 2.0 * weights, 4.0 * q_dim  # multiply-adds x 2; scores and weighted values, every head


class _Packing:
    """A packed prefill's row: each distinct prompt prefix of the group once, in a token trie.

    A request whose prompt begins like an earlier one's (the same context scored with four endings,
    the same system prompt) shares that request's tokens for as long as they agree and adds its own
    after them: ``rows[j][p]`` is the row holding request ``j``'s prompt position ``p``.
    """

    def __init__(self, prompts: list[list[int]]) -> None:
        self.token_ids: list[int] = []
        self.positions: list[int] = []
        self.rows: list[list[int]] = []
        root: dict[int, tuple[int, dict]] = {}
        for ids in prompts:
            node, rows = root, []
            for pos, token in enumerate(ids):
                if token not in node:
                    node[token] = (len(self.token_ids), {})
                    self.token_ids.append(token)
                    self.positions.append(pos)
                row, node = node[token]
                rows.append(row)
            self.rows.append(rows)

    def mask(self) -> torch.Tensor:
        """``[rows, rows]``, True where a row attends to a row: to its own request's prompt up to its position.

        A shared row's line is written by every request through it, the same line each time."""
        n = len(self.token_ids)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for rows in self.rows:
            index = torch.tensor(rows, dtype=torch.long)
            mask[index[:, None], index[None, :]] = torch.ones(len(rows), len(rows), dtype=torch.bool).tril()
        return mask


def _packing_is_cheaper(costs: tuple[float, float] | None, lengths: list[int], packed_tokens: int) -> bool:
    """Whether prompts of ``lengths`` cost fewer FLOPs packed in one row of ``packed_tokens`` (their distinct
    prefixes; ``packed_tokens^2`` pairs of attention) than left-padded (``rows x longest`` tokens,
    ``rows x longest^2`` pairs). Equal lengths with nothing shared never pack."""
    rows, longest = len(lengths), max(lengths)
    if costs is None or rows < 2 or packed_tokens > _PACKED_MAX_TOKENS:
        return False
    per_token, per_pair = costs
    return (packed_tokens * per_token + packed_tokens * packed_tokens * per_pair
            < rows * longest * (per_token + longest * per_pair))


def _wants_input_logprobs(req: Request) -> bool:
    """Whether ``req`` asks for prompt log-probs (``return_logprob`` with a start inside the prompt)."""
    return req.return_logprob and 0 <= req.logprob_start_len < len(req.input_ids)


def start_input_logprobs(req: Request) -> None:
    """Reset ``req``'s prompt log-probs to SGLang's first entry: ``None`` whatever ``logprob_start_len`` is."""
    req.input_token_logprobs = [(None, req.input_ids[req.logprob_start_len])]
    req.input_top_logprobs = [None] if req.top_logprobs_num > 0 else []


def record_input_logprobs(req: Request, lp: torch.Tensor, first_pos: int) -> None:
    """Append the prompt log-probs that log-softmax rows ``lp`` hold, in prompt order.

    Row ``j`` is the distribution after prompt position ``first_pos + j`` (``first_pos`` may be
    negative for rows of left padding); it scores ``input_ids[first_pos + j + 1]``, which SGLang
    reports from position ``logprob_start_len`` on. Called once per forward pass, in order, after
    :func:`start_input_logprobs`, so that a chunked prefill reports what one pass over the prompt would.
    """
    ids = req.input_ids
    lo = max(first_pos, req.logprob_start_len)
    hi = min(first_pos + lp.shape[0], len(ids) - 1)
    if hi <= lo:
        return
    rows = lp[lo - first_pos:hi - first_pos]
    targets = ids[lo + 1:hi + 1]
    values = rows.gather(1, torch.tensor(targets, dtype=torch.long)[:, None]).squeeze(1).tolist()
    req.input_token_logprobs.extend(zip(values, targets))
    if req.top_logprobs_num > 0:
        req.input_top_logprobs.extend(top_logprobs(row, req.top_logprobs_num) for row in rows)


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
    def prefill(self, reqs: list[Request], prefix_cache: PrefixCache | None,
                chunk_tokens: int) -> list[tuple[KV, int]]:
        """Prefill ``reqs``: one request alone, chunked and reusing the prefix cache, or several in one pass.

        Several requests go through one forward pass without prefix reuse, packed or left-padded
        (whichever is cheaper); the scheduler groups only requests whose padded batch fits
        ``chunk_tokens``. Returns, per request, its prompt KV and its first sampled token (-1 when
        ``max_new_tokens`` is 0), and sets ``cached_tokens`` and, when asked, the input and first
        output log-probs.
        """
        if len(reqs) == 1:
            return [self._prefill_one(reqs[0], prefix_cache, chunk_tokens)]
        packing = _Packing([r.input_ids for r in reqs])
        if _packing_is_cheaper(_prefill_costs(self.model.config), [len(r.input_ids) for r in reqs],
                               len(packing.token_ids)):
            return self._prefill_packed(reqs, packing)
        return self._prefill_together(reqs)

    def _prefill_one(self, req: Request, prefix_cache: PrefixCache | None, chunk_tokens: int) -> tuple[KV, int]:
        """One request: reuse the longest cached prefix, run the rest in forward passes of at most ``chunk_tokens``."""
        ids = req.input_ids
        n = len(ids)
        want_input_lp = _wants_input_logprobs(req)
        reuse, stored = 0, None
        # Prompt log-probs need logits for every scored token, and reused tokens produce none.
        if prefix_cache is not None and not want_input_lp:
            reuse, stored = prefix_cache.lookup(ids)
            reuse = min(reuse, n - 1)  # at least one token must run to produce logits
        cache = DynamicCache(config=self.model.config)
        if reuse > 0 and stored is not None:
            for layer, (k, v) in zip(cache.layers, stored):
                layer.update(k[:, :, :reuse], v[:, :, :reuse])
        req.cached_tokens = reuse
        if want_input_lp:
            start_input_logprobs(req)
        logits = None
        for begin in range(reuse, n, chunk_tokens):
            end = min(begin + chunk_tokens, n)
            # Logits only for the rows that are scored (and the last one, which samples the first token).
            keep = max(1, end - max(begin, req.logprob_start_len)) if want_input_lp else 1
            out = self.model(input_ids=torch.tensor([ids[begin:end]], dtype=torch.long),
                             position_ids=torch.arange(begin, end, dtype=torch.long)[None, :],
                             past_key_values=cache, use_cache=True, logits_to_keep=keep)
            logits = self.sampler.process(out.logits[0])
            if want_input_lp:
                record_input_logprobs(req, torch.log_softmax(logits, dim=-1), end - keep)
        assert logits is not None  # reuse <= n - 1: at least one chunk ran
        first = self._first_token([req], logits[-1:])[0]
        return [(layer.keys, layer.values) for layer in cache.layers], first

    def _prefill_together(self, reqs: list[Request]) -> list[tuple[KV, int]]:
        """Several requests in one left-padded forward pass, none reusing the prefix cache.

        Padded columns are masked out and every row's positions start at 0 at its first real
        token, so each row's logits and KV are the ones a prefill alone gives (to float rounding);
        each request then gets its own unpadded copy of its KV rows, and decodes as if prefilled alone.
        """
        lengths = [len(r.input_ids) for r in reqs]
        width = max(lengths)
        pads = [width - n for n in lengths]
        input_ids = torch.zeros(len(reqs), width, dtype=torch.long)
        mask = torch.zeros(len(reqs), width, dtype=torch.long)
        positions = torch.zeros(len(reqs), width, dtype=torch.long)
        for i, (req, pad) in enumerate(zip(reqs, pads)):
            input_ids[i, pad:] = torch.tensor(req.input_ids, dtype=torch.long)
            mask[i, pad:] = 1
            positions[i, pad:] = torch.arange(lengths[i], dtype=torch.long)
            req.cached_tokens = 0
        wanting = [i for i, r in enumerate(reqs) if _wants_input_logprobs(r)]
        # Columns from the leftmost scored one on (the last column samples every first token).
        first_col = min([pads[i] + reqs[i].logprob_start_len for i in wanting] + [width - 1])
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=width - first_col)
        logits = self.sampler.process(out.logits)
        for i in wanting:
            req = reqs[i]
            col = max(first_col, pads[i] + req.logprob_start_len)
            start_input_logprobs(req)
            record_input_logprobs(req, torch.log_softmax(logits[i, col - first_col:], dim=-1), col - pads[i])
        firsts = self._first_token(reqs, logits[:, -1, :])
        # A copy per request: a view would keep the whole padded batch alive in the prefix cache.
        return [([(layer.keys[i:i + 1, :, pad:].clone(), layer.values[i:i + 1, :, pad:].clone())
                  for layer in cache.layers], first) for i, (pad, first) in enumerate(zip(pads, firsts))]

    def _prefill_packed(self, reqs: list[Request], packing: _Packing) -> list[tuple[KV, int]]:
        """Several requests in one row of one forward pass, each distinct prompt prefix once (``packing``).

        Each token attends to its own request's prompt up to its position (``packing.mask()``) at that
        request's positions, so each request gets the logits and KV a prefill alone gives (to float
        rounding), without a padded token and without computing a shared prefix twice. Logits are kept
        only for the rows that are scored and each request's last one. Nothing here is a prefix-cache
        hit: ``cached_tokens`` stays 0.
        """
        keep: list[int] = []
        spans: list[tuple[int, int, int]] = []  # per request: its first kept logits row, that row's position, rows
        for req, rows in zip(reqs, packing.rows):
            req.cached_tokens = 0
            first = req.logprob_start_len if _wants_input_logprobs(req) else len(rows) - 1
            spans.append((len(keep), first, len(rows) - first))
            keep.extend(rows[first:])
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=torch.tensor([packing.token_ids], dtype=torch.long),
                         attention_mask=packing.mask()[None, None],
                         position_ids=torch.tensor([packing.positions], dtype=torch.long),
                         past_key_values=cache, use_cache=True, logits_to_keep=torch.tensor(keep, dtype=torch.long))
        logits = self.sampler.process(out.logits[0])
        for req, (row, first, n_rows) in zip(reqs, spans):
            if _wants_input_logprobs(req):
                start_input_logprobs(req)
                record_input_logprobs(req, torch.log_softmax(logits[row:row + n_rows], dim=-1), first)
        firsts = self._first_token(reqs, logits[[row + n_rows - 1 for row, _, n_rows in spans]])
        kv = []
        for rows in packing.rows:
            index = torch.tensor(rows, dtype=torch.long)  # gathered: each request gets its own copy
            kv.append([(layer.keys.index_select(2, index), layer.values.index_select(2, index))
                       for layer in cache.layers])
        return list(zip(kv, firsts))

    def _first_token(self, reqs: list[Request], last_logits: torch.Tensor) -> list[int]:
        """Sample each request's first output token from its prompt's last logits row (processed, ``[B, V]``).

        -1 for a request with ``max_new_tokens`` 0; records the token's log-prob when asked.
        """
        tokens = self.sampler.sample(last_logits, [r.params for r in reqs]).tolist()
        firsts = [int(t) if r.params.max_new_tokens > 0 else -1 for r, t in zip(reqs, tokens)]
        if any(r.return_logprob for r in reqs):
            lp = torch.log_softmax(last_logits, dim=-1)
            for i, (req, first) in enumerate(zip(reqs, firsts)):
                if req.return_logprob and first >= 0:
                    req.record_output_logprobs(lp[i], first)
        return firsts

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
        cache = _batch_cache(self.model.config, [(k[0], v[0]) if len(k) == 1 else (torch.cat(k), torch.cat(v))
                                                  for k, v in zip(keys, values)])
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
            layer.assign(layer.keys[index, :, first_real:], layer.values[index, :, first_real:])
        if first_real:
            self._mask = self._mask[:, first_real:]

