"""Prompt sets for the measurement stages: seeded random token ids, ShareGPT-format files, SGLang's
generated shared-prefix groups, Mooncake-format traces and a team's own JSONL prompts
(docs/workloads.md describes each with its config).

Random prompts are token ids sent as ``input_ids`` (native) or as a token-id ``prompt``
(OpenAI), so the client needs no tokenizer and the server sees exactly the planned
input length; nothing is decoded and re-encoded, so lengths cannot drift.

A protocol that takes text only (``WireProtocol.needs_text_prompts``: "openai-text") gets the ids
decoded with the model's tokenizer (``as_text_prompts``, once per run, before any clock starts), as
SGLang's bench_serving does for OpenAI backends. The server re-tokenizes the text, so its
``prompt_tokens`` may differ a little from the planned length; the load keeps the planned length in
``planned_input_tokens`` and the server's in ``input_tokens``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np

from servegate.bench.protocol import Prompt
from servegate.errors import ConfigError, ModelUnavailableError

__all__ = [
    "TOKEN_ID_LOW",
    "TOKEN_ID_HIGH",
    "DatasetRow",
    "random_token_ids",
    "sample_random_requests",
    "load_sharegpt",
    "sample_shared_prefix_requests",
    "MOONCAKE_BLOCK_TOKENS",
    "SMALL_TRACE_PATH",
    "load_mooncake_trace",
    "load_jsonl_prompts",
    "dataset_needs_tokenizer",
    "as_text_prompts",
    "load_prompt_tokenizer",
]

# Every model the gate targets has a vocabulary above 16k (SmolLM2: 49152); SGLang's
# one-batch benchmark draws from [0, 16384) for the same reason. Ids under 100 are skipped
# because tokenizers put their special tokens (BOS/EOS/pad) there.
TOKEN_ID_LOW: Final = 100
TOKEN_ID_HIGH: Final = 16384

MOONCAKE_BLOCK_TOKENS: Final = 512
"""Tokens per ``hash_ids`` block in a Mooncake trace (the FAST'25 traces' block size)."""

SMALL_TRACE_PATH: Final = Path(__file__).resolve().parent / "data" / "mooncake_small.jsonl"
"""A shipped Mooncake-format trace for tests and CPU gates: 20 requests over 7.8 s, inputs 64-700 tokens
(hash ids of 512-token blocks, shared as in Mooncake's traces), outputs 6-16 tokens."""

# Independent random streams per use of the same seed (numpy SeedSequence entropy lists).
_GSP_STREAM: Final = 0x65
_TRACE_BLOCK_STREAM: Final = 0x7B
_TRACE_TAIL_STREAM: Final = 0x7C


class _Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class _Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class DatasetRow:
    """One request to send."""

    prompt: Prompt
    """Token ids, or text (ShareGPT without a tokenizer)."""
    prompt_len: int | None
    """Planned input tokens; None when unknown to the client (text prompt, no tokenizer)."""
    output_len: int
    """max_new_tokens (sent with ignore_eos, so it is also the expected output length)."""
    send_at_s: float | None = None
    """Scheduled send time in s from the first request (trace datasets: the trace's own schedule);
    None: the arrival process (serving.arrival) schedules the request."""


def random_token_ids(rng: np.random.Generator, batch_size: int, input_len: int) -> list[list[int]]:
    """``batch_size`` prompts of exactly ``input_len`` token ids each."""
    ids = rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=(batch_size, input_len))
    return ids.tolist()


def _lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    # As SGLang's bench_serving: uniform integers in [max(int(len*ratio), 1), len].
    low = max(int(length * range_ratio), 1)
    return rng.integers(low, length + 1, size=n)


def sample_random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                           seed: int) -> list[DatasetRow]:
    """Seeded random requests; lengths drawn uniformly in ``[len*range_ratio, len]``."""
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    rows = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        prompt = rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=n_in).tolist()
        rows.append(DatasetRow(prompt=prompt, prompt_len=n_in, output_len=n_out))
    return rows


def _conversation_pair(entry: Any) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return None
    conv = entry.get("conversations", entry.get("conversation"))
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    first, second = conv[0], conv[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    prompt, answer = first.get("value"), second.get("value")
    if not isinstance(prompt, str) or not isinstance(answer, str) or not prompt:
        return None
    return prompt, answer


def load_sharegpt(path: str | Path, num_prompts: int, seed: int, output_len: int,
                  tokenizer: _Tokenizer | None = None) -> list[DatasetRow]:
    """Requests from a ShareGPT-format JSON file (a list of ``{"conversations": [human, gpt, ...]}``).

    The first turn is the prompt. With a ``tokenizer`` (anything with ``encode``) the prompt
    is sent as token ids and the second turn's token count is the output length, filtered
    as SGLang does (prompt or output under 4 tokens, prompt over 1024, or total over 2048
    tokens are dropped). Without one the prompt is sent as text, its length is taken from
    the server's ``prompt_tokens``, and every request asks for ``output_len`` tokens —
    counting the answer's tokens would need the model's tokenizer, and a guessed
    characters-per-token ratio would make throughput numbers dishonest.

    Entries are shuffled with ``seed``; fewer usable entries than ``num_prompts`` is an error.
    """
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"ShareGPT dataset {p} does not exist; set serving.dataset_path to a "
                          f"ShareGPT-format JSON file") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"ShareGPT dataset {p} is not readable JSON ({exc}); it must be a list "
                          f"of {{\"conversations\": [...]}} entries") from exc
    if not isinstance(raw, list):
        raise ConfigError(f"ShareGPT dataset {p}: top level must be a list, got {type(raw).__name__}")
    pairs = [pair for pair in map(_conversation_pair, raw) if pair is not None]
    order = np.random.default_rng(seed).permutation(len(pairs))
    rows: list[DatasetRow] = []
    for i in order.tolist():
        if len(rows) == num_prompts:
            break
        prompt, answer = pairs[i]
        if tokenizer is None:
            rows.append(DatasetRow(prompt=prompt, prompt_len=None, output_len=output_len))
            continue
        prompt_ids = list(tokenizer.encode(prompt))
        n_out = len(tokenizer.encode(answer))
        if len(prompt_ids) < 4 or n_out < 4 or len(prompt_ids) > 1024 or len(prompt_ids) + n_out > 2048:
            continue
        rows.append(DatasetRow(prompt=prompt_ids, prompt_len=len(prompt_ids), output_len=n_out))
    if len(rows) < num_prompts:
        raise ConfigError(f"ShareGPT dataset {p} has only {len(rows)} usable conversations, "
                         f"{num_prompts} requested; lower serving.num_prompts or use a larger file")
    return rows


def sample_shared_prefix_requests(num_groups: int, prompts_per_group: int, system_prompt_len: int,
                                  question_len: int, output_len: int, seed: int) -> list[DatasetRow]:
    """SGLang's ``generated-shared-prefix`` workload as token ids: ``num_groups`` random system
    prompts of ``system_prompt_len`` tokens, each followed by ``prompts_per_group`` random
    questions of ``question_len`` tokens; every request asks for ``output_len`` tokens.

    ``num_groups * prompts_per_group`` requests, shuffled with ``seed`` as SGLang shuffles them,
    so that a group's requests are spread over the run and the later ones find its system prompt
    in the prefix cache. Exact lengths (no range ratio), as SGLang's.
    """
    rng = np.random.default_rng([seed, _GSP_STREAM])
    systems = random_token_ids(rng, num_groups, system_prompt_len)
    rows = [DatasetRow(prompt=systems[g] + question, prompt_len=system_prompt_len + question_len,
                       output_len=output_len)
            for g in range(num_groups)
            for question in random_token_ids(rng, prompts_per_group, question_len)]
    return [rows[i] for i in rng.permutation(len(rows)).tolist()]


def _jsonl_objects(path: str | Path, what: str, fix: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSONL file; ``ConfigError`` naming the file
    and line for a line that is not a JSON object."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} {p} does not exist; {fix}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {p} is not readable ({exc}); {fix}") from exc
    out: list[tuple[int, dict[str, Any]]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p} line {lineno} is not JSON ({exc.msg}); {fix}") from exc
        if not isinstance(obj, dict):
            raise ConfigError(f"{p} line {lineno} is a JSON {type(obj).__name__}, not an object; {fix}")
        out.append((lineno, obj))
    if not out:
        raise ConfigError(f"{what} {p} has no requests (no non-blank line); {fix}")
    return out


def _positive_int(obj: dict[str, Any], key: str, where: str, fix: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key!r} must be an integer >= 1, got {value!r}; {fix}")
    return value


def load_mooncake_trace(path: str | Path, num_prompts: int, seed: int,
                        block_size: int = MOONCAKE_BLOCK_TOKENS) -> list[DatasetRow]:
    """The first ``num_prompts`` requests (by timestamp) of a Mooncake-format JSONL trace, each with
    its send time: ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``.

    ``send_at_s`` is the timestamp in seconds from the first request's (the caller scales it by
    ``serving.trace_time_scale``). Prompts are token ids built so that shared hash ids give shared
    tokens: hash id ``h`` stands for one block of ``block_size`` seeded random ids (the same block
    wherever ``h`` appears), a prompt is its blocks in order cut to ``input_length``, and tokens past
    its last block are the request's own. Two requests whose ``hash_ids`` start alike thus start with
    the same tokens, and a prefix cache can reuse them — the trace's cache behaviour, replayed.
    A trace with fewer requests than ``num_prompts`` is an error, as for ShareGPT.
    """
    p = Path(path)
    fix = ("each line must be {\"timestamp\": ms, \"input_length\": n, \"output_length\": m, "
           "\"hash_ids\": [ints]} (the Mooncake trace format)")
    entries: list[tuple[float, int, int, int, list[int]]] = []
    for lineno, obj in _jsonl_objects(p, "trace", fix):
        where = f"{p} line {lineno}"
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise ConfigError(f"{where}: 'timestamp' must be a number of ms >= 0, got {ts!r}; {fix}")
        n_in = _positive_int(obj, "input_length", where, fix)
        n_out = _positive_int(obj, "output_length", where, fix)
        hashes = obj.get("hash_ids", [])
        if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0
                                               for h in hashes):
            raise ConfigError(f"{where}: 'hash_ids' must be a list of integers >= 0, got {hashes!r}; {fix}")
        entries.append((float(ts), lineno, n_in, n_out, hashes))
    if len(entries) < num_prompts:
        raise ConfigError(f"trace {p} has {len(entries)} requests, {num_prompts} requested; lower "
                          f"serving.num_prompts or use a longer trace")
    entries.sort(key=lambda e: e[0])  # stable: equal timestamps keep the file's order
    entries = entries[:num_prompts]
    first_ms = entries[0][0]
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            rng = np.random.default_rng([seed, _TRACE_BLOCK_STREAM, h])
            blocks[h] = rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=block_size).tolist()
        return blocks[h]

    rows: list[DatasetRow] = []
    for ts, lineno, n_in, n_out, hashes in entries:
        ids = [t for h in hashes for t in block(h)][:n_in]
        if len(ids) < n_in:
            tail = np.random.default_rng([seed, _TRACE_TAIL_STREAM, lineno])
            ids += tail.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=n_in - len(ids)).tolist()
        rows.append(DatasetRow(prompt=ids, prompt_len=n_in, output_len=n_out, send_at_s=(ts - first_ms) / 1000.0))
    return rows


def load_jsonl_prompts(path: str | Path, num_prompts: int, tokenizer: _Tokenizer | None = None, *,
                       keep_text: bool = False) -> list[DatasetRow]:
    """The first ``num_prompts`` lines of a JSONL file of ``{"prompt": "...", "output_len": N}``.

    With a ``tokenizer`` the prompt is sent as its token ids (``keep_text``: as the original text,
    for a text-only protocol) and its planned length is their count; without one it is sent as
    text and its length is the server's ``prompt_tokens``. A bad line is a ``ConfigError`` naming
    the file and the line; fewer lines than ``num_prompts`` too.
    """
    p = Path(path)
    fix = "each line must be {\"prompt\": \"a non-empty string\", \"output_len\": an integer >= 1}"
    rows: list[DatasetRow] = []
    for lineno, obj in _jsonl_objects(p, "prompt file", fix):
        where = f"{p} line {lineno}"
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}; {fix}")
        n_out = _positive_int(obj, "output_len", where, fix)
        if tokenizer is None:
            rows.append(DatasetRow(prompt=prompt, prompt_len=None, output_len=n_out))
        else:
            ids = list(tokenizer.encode(prompt))
            rows.append(DatasetRow(prompt=prompt if keep_text else ids, prompt_len=len(ids), output_len=n_out))
    if len(rows) < num_prompts:
        raise ConfigError(f"prompt file {p} has {len(rows)} prompts, {num_prompts} requested; lower "
                          f"serving.num_prompts or add prompts")
    return rows[:num_prompts]


def dataset_needs_tokenizer(dataset: str, needs_text_prompts: bool) -> bool:
    """Whether the serving load should be given the model's tokenizer (``load_prompt_tokenizer``):
    a text-only protocol needs it to decode token ids, and the text datasets (sharegpt, jsonl) use it
    to send token ids with exact planned lengths (without it they are sent as text)."""
    return needs_text_prompts or dataset in ("sharegpt", "jsonl")


def as_text_prompts(rows: list[DatasetRow], tokenizer: _Decoder | None) -> list[DatasetRow]:
    """``rows`` with every token-id prompt decoded to text by ``tokenizer`` (text prompts kept);
    the planned lengths stay. ``ConfigError`` when a prompt is ids and there is no tokenizer."""
    if tokenizer is None:
        if any(not isinstance(r.prompt, str) for r in rows):
            raise ConfigError("this protocol sends text prompts only and the prompts are token ids: pass the "
                              "model's tokenizer (load_prompt_tokenizer(worker.model)) to decode them")
        return rows
    return [r if isinstance(r.prompt, str) else replace(r, prompt=tokenizer.decode(r.prompt)) for r in rows]


def load_prompt_tokenizer(model: str) -> Any:
    """The tokenizer of ``worker.model`` (a servegate alias, a local directory, or a Hugging Face id in
    the local cache), loaded offline: the gate fetches nothing while it measures."""
    from transformers import AutoTokenizer

    from servegate.models import MODEL_ALIASES, ensure_model

    local = model in MODEL_ALIASES or Path(model).expanduser().is_dir()
    source = str(ensure_model(model, allow_fetch=False)) if local else model
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelUnavailableError(
            f"could not load the tokenizer of {model!r} offline ({exc}); a text-only protocol (openai-text) needs "
            f"it to decode token-id prompts, and the sharegpt and jsonl datasets to encode their text — give "
            f"worker.model as a servegate alias "
            f"({sorted(MODEL_ALIASES)}) fetched with `servegate model fetch`, a local model directory, or a "
            f"Hugging Face id that is in the local cache") from exc
