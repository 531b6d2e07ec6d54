"""The embedded worker's KV token budget and the prefix cache that lives inside it.

Owns three things that answer "how many tokens of KV may exist":

* :func:`kv_bytes_per_token` and :func:`plan_token_capacity` turn a memory budget into a
  token capacity at start-up (before a port is bound, so a budget too small for one request
  fails the launch instead of the first request);
* :class:`PrefixCache` keeps the KV of recent prompts for reuse, least recently used first out;
* :class:`TokenBudget` keeps running reservations plus the prefix cache within the capacity,
  evicting cached prompts to make room for requests (a running request outranks a cache hit).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from servegate.errors import ConfigError
from servegate.worker.request import KV

__all__ = ["kv_bytes_per_token", "plan_token_capacity", "PrefixCache", "TokenBudget", "MAX_PREFIX_ENTRIES"]

# Rough cap on the number of stored prompts: a lookup scans them all.
MAX_PREFIX_ENTRIES = 256


def kv_bytes_per_token(model_config: Any, dtype_bytes: int) -> int:
    """KV bytes one token occupies: 2 (K and V) * layers * kv_heads * head_dim * dtype bytes."""
    layers = model_config.num_hidden_layers
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return 2 * layers * heads * head_dim * dtype_bytes


def plan_token_capacity(*, bytes_per_token: int, weight_bytes: int, available_bytes: int,
                        max_total_tokens: int | None, mem_fraction_static: float | None,
                        context_length: int) -> int:
    """The KV token capacity for this budget; ``ConfigError`` when one full-length request cannot fit.

    ``max_total_tokens`` wins when given (capped by ``mem_fraction_static`` when that is
    given too, as SGLang does); otherwise ``mem_fraction_static`` of the available memory,
    minus the weights, divided by ``bytes_per_token``.
    """
    from_memory = None
    if mem_fraction_static is not None:
        budget = mem_fraction_static * available_bytes - weight_bytes
        from_memory = max(0, int(budget // bytes_per_token))
    if max_total_tokens is not None:
        capacity = max_total_tokens if from_memory is None else min(max_total_tokens, from_memory)
    elif from_memory is not None:
        capacity = from_memory
    else:
        raise ConfigError("no KV budget: pass --max-total-tokens N or --mem-fraction-static F")
    if capacity < context_length:
        how = (f"--max-total-tokens {max_total_tokens}" if max_total_tokens is not None and capacity == max_total_tokens
               else f"--mem-fraction-static {mem_fraction_static} of {available_bytes / 2**30:.2f} GiB available "
                    f"minus {weight_bytes / 2**30:.2f} GiB of weights")
        raise ConfigError(
            f"the KV cache budget holds {capacity} tokens ({how}, {bytes_per_token} bytes per token), "
            f"less than one request of the context length {context_length}; raise --max-total-tokens or "
            f"--mem-fraction-static, or lower --context-length")
    return capacity


class PrefixCache:
    """KV of recent prompts keyed by their token ids; LRU; counts the tokens it holds.

    A lookup returns the longest common prefix over the stored prompts. Stored tensors are
    never modified in place (the batch is always rebuilt with ``torch.cat``), so they are
    kept by reference, without copies.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, KV]] = OrderedDict()
        self.tokens = 0
        # Its own lock: a flush from the HTTP thread may clear it while the scheduler thread looks up.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[int, KV | None]:
        """(matched length, per-layer (K, V)) of the longest stored prefix of ``ids``."""
        if not ids:
            return 0, None
        query = torch.tensor(ids, dtype=torch.long)
        best_len, best_key = 0, None
        with self._lock:
            for key, (stored, _) in self._entries.items():
                m = min(len(stored), len(query))
                if m <= best_len or int(stored[0]) != ids[0]:
                    continue
                diff = (stored[:m] != query[:m]).nonzero()
                common = m if diff.numel() == 0 else int(diff[0, 0])
                if common > best_len:
                    best_len, best_key = common, key
            if best_key is None:
                return 0, None
            self._entries.move_to_end(best_key)
            return best_len, self._entries[best_key][1]

    def insert(self, ids: list[int], kv: KV) -> None:
        key = tuple(ids)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            # A stored prompt that this one extends is redundant: the longer one serves both.
            for other in [k for k in self._entries if len(k) < len(key) and key[:len(k)] == k]:
                self._drop(other)
            self._entries[key] = (torch.tensor(ids, dtype=torch.long), kv)
            self.tokens += len(key)
            while len(self._entries) > MAX_PREFIX_ENTRIES:
                self._drop(next(iter(self._entries)))

    def evict(self, tokens_needed: int) -> int:
        """Drop least recently used prompts until ``tokens_needed`` are freed; returns tokens freed."""
        freed = 0
        with self._lock:
            while freed < tokens_needed and self._entries:
                freed += self._drop(next(iter(self._entries)))
        return freed

    def clear(self) -> int:
        with self._lock:
            dropped = self.tokens
            self._entries.clear()
            self.tokens = 0
            return dropped

    def _drop(self, key: tuple[int, ...]) -> int:
        del self._entries[key]
        self.tokens -= len(key)
        return len(key)


class TokenBudget:
    """Reservations of admitted requests plus the prefix cache, kept within ``capacity`` tokens.

    Each admitted request reserves ``prompt_len + max_new_tokens`` up front, so a running
    request can never run out of KV mid-generation. Not locked itself: the scheduler calls it
    under its own lock, together with the queue and batch changes that a reservation goes with.
    """

    def __init__(self, capacity: int, prefix_cache: PrefixCache) -> None:
        self.capacity = capacity
        self.prefix_cache = prefix_cache
        self.reserved = 0

    @property
    def free(self) -> int:
        return self.capacity - self.reserved - self.prefix_cache.tokens

    def make_room(self, tokens: int) -> bool:
        """Evict cached prompts (least recently used first) until ``tokens`` fit; True when they do."""
        free = self.free
        if tokens > free:
            self.prefix_cache.evict(tokens - free)
        return tokens <= self.free

    def reserve(self, tokens: int) -> None:
        self.reserved += tokens

    def release(self, tokens: int) -> None:
        self.reserved -= tokens
