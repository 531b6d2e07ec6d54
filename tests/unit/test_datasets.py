"""Prompt sets (random token ids, ShareGPT files, shared-prefix groups, Mooncake traces, JSONL prompts)
and the arrival schedule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from servegate.bench.datasets import (
    SMALL_TRACE_PATH,
    TOKEN_ID_HIGH,
    TOKEN_ID_LOW,
    as_text_prompts,
    dataset_needs_tokenizer,
    load_jsonl_prompts,
    load_mooncake_trace,
    load_sharegpt,
    random_token_ids,
    sample_random_requests,
    sample_shared_prefix_requests,
)
from servegate.bench.serving import arrival_schedule, build_requests
from servegate.config import ServingConfig
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


def test_gamma_schedule_statistics() -> None:
    # vLLM's get_request: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate.
    rate = 25.0
    for shape in (0.3, 1.0, 3.0):
        t = arrival_schedule(4000, "gamma", rate, seed=11, burstiness=shape)
        gaps = np.diff(t)
        assert t[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.08)
        assert gaps.var() == pytest.approx(1 / (shape * rate**2), rel=0.2)  # burstier: larger variance
        assert scipy_stats.kstest(gaps, "gamma", args=(shape, 0, 1 / (rate * shape))).pvalue > 0.01
    seeded = arrival_schedule(50, "gamma", rate, 2, 0.5)
    np.testing.assert_array_equal(seeded, arrival_schedule(50, "gamma", rate, 2, 0.5))
    assert not np.array_equal(seeded, arrival_schedule(50, "gamma", rate, 3, 0.5))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_shared_prefix_groups() -> None:
    rows = sample_shared_prefix_requests(3, 5, system_prompt_len=40, question_len=7, output_len=9, seed=4)
    assert len(rows) == 15  # groups x per group, whatever serving.num_prompts says
    assert all(len(r.prompt) == r.prompt_len == 47 and r.output_len == 9 for r in rows)
    assert all(min(r.prompt) >= TOKEN_ID_LOW and max(r.prompt) < TOKEN_ID_HIGH for r in rows)
    by_system: dict[tuple[int, ...], list[list[int]]] = {}
    for r in rows:
        by_system.setdefault(tuple(r.prompt[:40]), []).append(r.prompt)
    assert sorted(len(v) for v in by_system.values()) == [5, 5, 5]  # three system prompts, five each
    for prompts in by_system.values():
        questions = {tuple(p[40:]) for p in prompts}
        assert len(questions) == 5  # each request its own question
    systems = list(by_system)
    assert all(_common_prefix(list(a), list(b)) < 3 for a in systems for b in systems if a != b)
    # Shuffled, as SGLang: a group's requests are not all adjacent.
    order = [systems.index(tuple(r.prompt[:40])) for r in rows]
    assert order != sorted(order)
    assert rows == sample_shared_prefix_requests(3, 5, 40, 7, 9, seed=4)
    assert rows != sample_shared_prefix_requests(3, 5, 40, 7, 9, seed=5)


def test_build_requests_for_shared_prefix_ignores_num_prompts() -> None:
    cfg = ServingConfig(dataset="generated-shared-prefix", num_prompts=3, gsp_num_groups=2, gsp_prompts_per_group=3,
                        gsp_system_prompt_len=16, gsp_question_len=4, gsp_output_len=5)
    rows = build_requests(cfg)
    assert len(rows) == 6 and {r.output_len for r in rows} == {5}


def _trace(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_mooncake_trace_blocks_give_shared_prefixes(tmp_path: Path) -> None:
    path = _trace(tmp_path, [
        {"timestamp": 1000, "input_length": 20, "output_length": 3, "hash_ids": [5, 6]},
        {"timestamp": 1500, "input_length": 25, "output_length": 4, "hash_ids": [5, 6, 7]},
        {"timestamp": 1200, "input_length": 12, "output_length": 2, "hash_ids": [5, 9]},
        {"timestamp": 3000, "input_length": 30, "output_length": 5, "hash_ids": [8]},
    ])
    rows = load_mooncake_trace(path, num_prompts=4, seed=1, block_size=8)
    # Sorted by timestamp, send times in s from the first request.
    assert [r.send_at_s for r in rows] == [0.0, 0.2, 0.5, 2.0]
    assert [r.prompt_len for r in rows] == [20, 12, 25, 30] and [r.output_len for r in rows] == [3, 2, 4, 5]
    assert all(len(r.prompt) == r.prompt_len for r in rows)
    a, c, b, d = (r.prompt for r in rows)
    assert a[:16] == b[:16] and _common_prefix(a, b) >= 16  # blocks 5, 6 shared
    assert _common_prefix(a, c) >= 8 and c[8:12] != a[8:12]  # block 5 shared, then 9 vs 6
    assert d[:8] != a[:8]
    assert _common_prefix(a[16:], b[16:]) < 2  # tokens past the blocks are each request's own
    assert rows == load_mooncake_trace(path, 4, seed=1, block_size=8)
    assert load_mooncake_trace(path, 2, seed=1, block_size=8) == rows[:2]


def test_mooncake_trace_errors_name_file_and_line(tmp_path: Path) -> None:
    good = {"timestamp": 0, "input_length": 4, "output_length": 2, "hash_ids": [1]}
    cases = [
        ("{not json", "line 2 is not JSON"),
        (json.dumps({**good, "timestamp": -1}), "line 2: 'timestamp' must be a number of ms >= 0"),
        (json.dumps({**good, "input_length": 0}), "line 2: 'input_length' must be an integer >= 1"),
        (json.dumps({**good, "hash_ids": "abc"}), "line 2: 'hash_ids' must be a list of integers"),
        ("[1, 2]", "line 2 is a JSON list, not an object"),
    ]
    for bad, message in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n" + bad + "\n")
        with pytest.raises(ConfigError, match=message) as info:
            load_mooncake_trace(path, 1, 0)
        assert str(path) in str(info.value) and "Mooncake trace format" in str(info.value)
    with pytest.raises(ConfigError, match="has 1 requests, 3 requested"):
        load_mooncake_trace(_trace(tmp_path, [good]), 3, 0)
    with pytest.raises(ConfigError, match="does not exist"):
        load_mooncake_trace(tmp_path / "missing.jsonl", 1, 0)


def test_shipped_trace_is_small_mooncake_with_shared_blocks() -> None:
    rows = load_mooncake_trace(SMALL_TRACE_PATH, 20, seed=1)
    assert len(rows) == 20 and rows[-1].send_at_s < 10.0
    assert max(r.prompt_len for r in rows) <= 700 and max(r.output_len for r in rows) <= 16
    raw = [json.loads(line) for line in SMALL_TRACE_PATH.read_text().splitlines()]
    # Mooncake's convention: one hash id per started 512-token block.
    assert all(len(x["hash_ids"]) == -(-x["input_length"] // 512) for x in raw)
    shared = sum(_common_prefix(rows[i].prompt, rows[j].prompt) >= 64 for i in range(20) for j in range(i))
    assert shared >= 10
    cfg = ServingConfig(dataset="trace", dataset_path=str(SMALL_TRACE_PATH), num_prompts=20, trace_time_scale=0.5)
    scaled = build_requests(cfg)
    assert [r.send_at_s for r in scaled] == pytest.approx([r.send_at_s * 0.5 for r in rows])


class _WordIds:
    """Encodes each word to one id and decodes ids back to words."""

    def encode(self, text: str) -> list[int]:
        return [1000 + len(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * (i - 1000) for i in ids)


def test_jsonl_prompts(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there world", "output_len": 5}\n\n{"prompt": "one", "output_len": 2}\n'
                    '{"prompt": "a b", "output_len": 1}\n')
    rows = load_jsonl_prompts(path, 2)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in rows] == [("hello there world", None, 5), ("one", None, 2)]
    ids = load_jsonl_prompts(path, 3, _WordIds())
    assert [(r.prompt, r.prompt_len) for r in ids] == [([1005, 1005, 1005], 3), ([1003], 1), ([1001, 1001], 2)]
    text = load_jsonl_prompts(path, 3, _WordIds(), keep_text=True)
    assert [(r.prompt, r.prompt_len) for r in text] == [("hello there world", 3), ("one", 1), ("a b", 2)]
    # A text-only protocol keeps the original text, not a decode of its ids.
    cfg = ServingConfig(dataset="jsonl", dataset_path=str(path), num_prompts=3)
    assert [r.prompt for r in build_requests(cfg, _WordIds(), text_prompts=True)] == ["hello there world", "one", "a b"]
    assert as_text_prompts(ids, _WordIds())[0].prompt == "xxxxx xxxxx xxxxx"


def test_jsonl_bad_lines_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    for bad, message in [('{"prompt": "", "output_len": 2}', "line 2: 'prompt' must be a non-empty string"),
                         ('{"prompt": "x", "output_len": "8"}', "line 2: 'output_len' must be an integer >= 1"),
                         ('{"prompt": "x", "output_len": true}', "line 2: 'output_len' must be an integer >= 1"),
                         ('{"prompt": "x"', "line 2 is not JSON")]:
        path.write_text('{"prompt": "fine", "output_len": 3}\n' + bad + "\n")
        with pytest.raises(ConfigError, match=message) as info:
            load_jsonl_prompts(path, 1)
        assert str(path) in str(info.value) and '"output_len"' in str(info.value)
    path.write_text('{"prompt": "fine", "output_len": 3}\n')
    with pytest.raises(ConfigError, match="has 1 prompts, 2 requested; lower serving.num_prompts"):
        load_jsonl_prompts(path, 2)
    path.write_text("\n")
    with pytest.raises(ConfigError, match="no requests"):
        load_jsonl_prompts(path, 1)


def test_which_datasets_want_the_tokenizer() -> None:
    assert dataset_needs_tokenizer("jsonl", False) and dataset_needs_tokenizer("sharegpt", False)
    assert not dataset_needs_tokenizer("random", False) and not dataset_needs_tokenizer("trace", False)
    assert dataset_needs_tokenizer("generated-shared-prefix", True)
