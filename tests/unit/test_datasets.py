"""Prompt sets (random token ids, ShareGPT files) and the arrival schedule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from servegate.bench.datasets import (
    TOKEN_ID_HIGH,
    TOKEN_ID_LOW,
    load_sharegpt,
    random_token_ids,
    sample_random_requests,
)
from servegate.bench.serving import arrival_schedule
from servegate.errors import ConfigError


def test_random_requests_lengths_and_ids() -> None:
    rows = sample_random_requests(200, input_len=64, output_len=16, range_ratio=0.5, seed=3)
    assert len(rows) == 200
    for r in rows:
        assert 32 <= r.prompt_len <= 64 and 8 <= r.output_len <= 16
        assert len(r.prompt) == r.prompt_len  # exact: token ids, nothing re-tokenized
        assert min(r.prompt) >= TOKEN_ID_LOW and max(r.prompt) < TOKEN_ID_HIGH
    lens = [r.prompt_len for r in rows]
    assert min(lens) == 32 and max(lens) == 64  # both ends of [len*ratio, len] are drawn


def test_random_requests_are_seeded() -> None:
    a = sample_random_requests(5, 16, 4, 0.5, seed=1)
    b = sample_random_requests(5, 16, 4, 0.5, seed=1)
    c = sample_random_requests(5, 16, 4, 0.5, seed=2)
    assert a == b and a != c


def test_range_ratio_one_gives_exact_lengths() -> None:
    rows = sample_random_requests(10, 32, 8, 1.0, seed=0)
    assert {r.prompt_len for r in rows} == {32} and {r.output_len for r in rows} == {8}


def test_random_token_ids_shape() -> None:
    ids = random_token_ids(np.random.default_rng(0), 4, 7)
    assert len(ids) == 4 and all(len(x) == 7 and all(isinstance(t, int) for t in x) for x in ids)


class WhitespaceTokenizer:
    """A real (tiny) tokenizer: one id per whitespace-separated word."""

    def encode(self, text: str) -> list[int]:
        return [1000 + len(w) for w in text.split()]


def _sharegpt(tmp_path: Path, n: int) -> Path:
    entries = [{"id": str(i), "conversations": [
        {"from": "human", "value": " ".join(["q"] * (5 + i))},
        {"from": "gpt", "value": " ".join(["a"] * (6 + i))},
    ]} for i in range(n)]
    entries.append({"id": "bad", "conversations": [{"from": "human", "value": "only one turn"}]})
    entries.append({"id": "short", "conversations": [{"from": "human", "value": "hi"},
                                                       {"from": "gpt", "value": "yo"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_without_tokenizer_sends_text(tmp_path: Path) -> None:
    rows = load_sharegpt(_sharegpt(tmp_path, 6), num_prompts=4, seed=0, output_len=12)
    assert len(rows) == 4
    assert all(isinstance(r.prompt, str) and r.prompt_len is None and r.output_len == 12 for r in rows)
    assert rows == load_sharegpt(_sharegpt(tmp_path, 6), num_prompts=4, seed=0, output_len=12)


def test_sharegpt_with_tokenizer_uses_the_answer_length(tmp_path: Path) -> None:
    rows = load_sharegpt(_sharegpt(tmp_path, 6), num_prompts=6, seed=0, output_len=12,
                         tokenizer=WhitespaceTokenizer())
    assert len(rows) == 6  # the too-short pair (under 4 tokens) was dropped
    for r in rows:
        assert isinstance(r.prompt, list) and r.prompt_len == len(r.prompt)
        assert r.output_len == r.prompt_len + 1  # answers are one word longer than questions


def test_sharegpt_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only 3 usable"):
        load_sharegpt(_sharegpt(tmp_path, 2), num_prompts=5, seed=0, output_len=8)
    with pytest.raises(ConfigError, match="does not exist"):
        load_sharegpt(tmp_path / "missing.json", 1, 0, 8)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        load_sharegpt(bad, 1, 0, 8)


def test_poisson_schedule_statistics() -> None:
    rate = 25.0
    t = arrival_schedule(4000, "poisson", rate, seed=11)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert scipy_stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    np.testing.assert_array_equal(t, arrival_schedule(4000, "poisson", rate, seed=11))


def test_constant_and_all_at_once_schedules() -> None:
    np.testing.assert_allclose(arrival_schedule(5, "constant", 4.0, seed=0), [0, 0.25, 0.5, 0.75, 1.0])
    assert not arrival_schedule(5, "all-at-once", 4.0, seed=0).any()
    assert not arrival_schedule(5, "poisson", float("inf"), seed=0).any()
