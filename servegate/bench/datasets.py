"""Prompt sets for the measurement stages: seeded random token ids, and ShareGPT-format files.

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
from dataclasses import dataclass
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
    "as_text_prompts",
    "load_prompt_tokenizer",
]

# Every model the gate targets has a vocabulary above 16k (SmolLM2: 49152); SGLang's
# one-batch benchmark draws from [0, 16384) for the same reason. Ids under 100 are skipped
# because tokenizers put their special tokens (BOS/EOS/pad) there.
TOKEN_ID_LOW: Final = 100
TOKEN_ID_HIGH: Final = 16384


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


def as_text_prompts(rows: list[DatasetRow], tokenizer: _Decoder | None) -> list[DatasetRow]:
    """``rows`` with every token-id prompt decoded to text by ``tokenizer`` (text prompts kept);
    the planned lengths stay. ``ConfigError`` when a prompt is ids and there is no tokenizer."""
    if tokenizer is None:
        if any(not isinstance(r.prompt, str) for r in rows):
            raise ConfigError("this protocol sends text prompts only and the prompts are token ids: pass the "
                              "model's tokenizer (load_prompt_tokenizer(worker.model)) to decode them")
        return rows
    return [r if isinstance(r.prompt, str) else DatasetRow(prompt=tokenizer.decode(r.prompt), prompt_len=r.prompt_len,
                                                           output_len=r.output_len)
            for r in rows]


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
            f"it to decode the random token-id prompts — give worker.model as a servegate alias "
            f"({sorted(MODEL_ALIASES)}) fetched with `servegate model fetch`, a local model directory, or a "
            f"Hugging Face id that is in the local cache") from exc
