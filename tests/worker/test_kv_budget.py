"""The KV token budget and the prefix cache (servegate.worker.kv_budget), in process."""

from __future__ import annotations

import pytest
import torch

from servegate.errors import ConfigError
from servegate.worker.kv_budget import PrefixCache, TokenBudget, plan_token_capacity


def _kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))]


def test_lookup_finds_the_longest_common_prefix() -> None:
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], _kv(4))
    cache.insert([1, 2, 9, 9, 9], _kv(5))
    assert cache.lookup([1, 2, 3, 7])[0] == 3
    assert cache.lookup([1, 2, 9, 9, 9, 9])[0] == 5
    assert cache.lookup([5, 1, 2]) == (0, None)


def test_a_prompt_that_extends_a_stored_one_replaces_it() -> None:
    cache = PrefixCache()
    cache.insert([1, 2, 3], _kv(3))
    cache.insert([1, 2, 3, 4, 5], _kv(5))
    assert len(cache) == 1 and cache.tokens == 5


def test_make_room_evicts_the_least_recently_used_prompt_first() -> None:
    cache = PrefixCache()
    budget = TokenBudget(100, cache)
    cache.insert([1] * 30, _kv(30))
    cache.insert([2] * 40, _kv(40))
    cache.lookup([1] * 30)  # now [2]*40 is the least recently used
    budget.reserve(20)
    assert budget.free == 10
    assert budget.make_room(30)
    assert cache.lookup([1] * 30)[0] == 30 and cache.lookup([2] * 40)[0] == 0
    assert budget.free == 50


def test_make_room_fails_when_reservations_alone_leave_too_little() -> None:
    cache = PrefixCache()
    budget = TokenBudget(100, cache)
    cache.insert([1] * 30, _kv(30))
    budget.reserve(80)
    assert not budget.make_room(30)
    assert cache.tokens == 0  # evicted all the same: a running request outranks a cache hit
    budget.release(80)
    assert budget.make_room(30)


def test_a_budget_below_one_full_request_names_the_flags() -> None:
    with pytest.raises(ConfigError, match="--max-total-tokens"):
        plan_token_capacity(bytes_per_token=10, weight_bytes=0, available_bytes=0, max_total_tokens=100,
                            mem_fraction_static=None, context_length=200)
    assert plan_token_capacity(bytes_per_token=10, weight_bytes=0, available_bytes=10_000, max_total_tokens=None,
                               mem_fraction_static=0.5, context_length=200) == 500
