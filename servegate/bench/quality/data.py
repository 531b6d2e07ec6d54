"""The quality stage's inputs: the multiple-choice set, the reference prompts, their tokens.

A multiple-choice set is a HellaSwag-format JSONL file (``ctx``, ``endings``, ``label``; the
real HellaSwag works too); reference prompts a JSON list of ``{"id", "prompt"}``. Both are
checked line by line (``ConfigError`` names the line). Items are encoded with the model's
tokenizer, context and endings separately, so that the endings' token boundaries are exact.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from servegate.config import QUALITY_DATA_DIR
from servegate.errors import ConfigError, InsufficientDataError, ModelUnavailableError

__all__ = [
    "DATA_DIR",
    "DEFAULT_DATASET",
    "DEFAULT_REFERENCE_PROMPTS",
    "MCItem",
    "EncodedItem",
    "load_mc_items",
    "sample_items",
    "load_reference_prompts",
    "TokenizerFile",
    "load_tokenizer",
    "encode_item",
    "file_sha256",
]

DATA_DIR: Final = QUALITY_DATA_DIR
DEFAULT_DATASET: Final = DATA_DIR / "commonsense_mc.jsonl"
DEFAULT_REFERENCE_PROMPTS: Final = DATA_DIR / "reference_prompts.json"


@dataclass(frozen=True)
class MCItem:
    """One multiple-choice item: a context, its candidate endings, the index of the right one."""

    ctx: str
    endings: tuple[str, ...]
    label: int
    index: int
    """Line position in the file (0-based), kept so a sampled subset stays traceable."""


@dataclass(frozen=True)
class EncodedItem:
    """An item as token ids: the shared context prefix and each ending's continuation."""

    item: MCItem
    ctx_ids: list[int]
    ending_ids: list[list[int]]


def file_sha256(path: Path) -> str:
    """The file's SHA-256 (hex), recorded with the accuracy so that a changed dataset shows."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_mc_items(path: str | Path) -> list[MCItem]:
    """Read a HellaSwag-format JSONL file; every line is checked (``ConfigError`` names the line).

    Each line: ``{"ctx": str, "endings": [str, ...] (>= 2), "label": int}``. Extra keys (HellaSwag
    has ``ind``, ``activity_label``, ...) are ignored; a string label ("2") is accepted as
    HellaSwag's own files write it.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"quality dataset {p} does not exist; set quality.dataset_path to a HellaSwag-format "
                          f"JSONL file or leave it unset for the shipped {DEFAULT_DATASET.name}")
    items: list[MCItem] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where} is not valid JSON ({exc}); each line must be one JSON object") from exc
            if not isinstance(doc, dict):
                raise ConfigError(f"{where} must be a JSON object with ctx, endings, label")
            ctx, endings, label = doc.get("ctx"), doc.get("endings"), doc.get("label")
            if not isinstance(ctx, str) or not ctx.strip():
                raise ConfigError(f"{where}: 'ctx' must be a non-empty string")
            if (not isinstance(endings, list) or len(endings) < 2
                    or not all(isinstance(e, str) and e.strip() for e in endings)):
                raise ConfigError(f"{where}: 'endings' must be a list of at least 2 non-empty strings")
            if isinstance(label, str) and label.strip().isdigit():
                label = int(label)
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
                raise ConfigError(f"{where}: 'label' must be an integer in [0, {len(endings) - 1}], got {label!r}")
            items.append(MCItem(ctx=ctx, endings=tuple(endings), label=label, index=len(items)))
    if not items:
        raise InsufficientDataError(f"quality dataset {p} holds no items; give a file with at least one line")
    return items


def sample_items(items: list[MCItem], max_items: int | None, seed: int) -> list[MCItem]:
    """``max_items`` items drawn with ``seed``, in file order (all of them when ``max_items`` is None)."""
    if max_items is None or max_items >= len(items):
        return items
    picked = np.random.default_rng(seed).choice(len(items), size=max_items, replace=False)
    return [items[i] for i in sorted(picked.tolist())]


def load_reference_prompts(path: str | Path) -> list[tuple[str, str]]:
    """``[(id, prompt), ...]`` from a JSON list of ``{"id": str, "prompt": str}`` objects."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"reference prompts file {p} does not exist; set quality.reference_prompts_path or "
                          f"leave it unset for the shipped {DEFAULT_REFERENCE_PROMPTS.name}")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p} is not valid JSON ({exc})") from exc
    if not isinstance(doc, list) or not doc:
        raise ConfigError(f"{p} must be a non-empty JSON list of {{\"id\": ..., \"prompt\": ...}} objects")
    prompts: list[tuple[str, str]] = []
    for i, entry in enumerate(doc):
        if (not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]
                or not isinstance(entry.get("id"), str)):
            raise ConfigError(f"{p} entry {i} must be an object with a string 'id' and a non-empty string 'prompt'")
        prompts.append((entry["id"], entry["prompt"]))
    ids = [pid for pid, _ in prompts]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{p}: prompt ids must be unique, got duplicates in {ids}")
    return prompts


class TokenizerFile:
    """A model's ``tokenizer.json`` read by the ``tokenizers`` library, which is what transformers'
    fast tokenizer runs: the same ids (a test compares them over the shipped data) without importing
    transformers and torch first, ~10 s of the quality stage on a busy 2-core machine (issue 17)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the post-processor's special tokens unless told otherwise."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


def _tokenizer_file(model: str) -> Path | None:
    """The model's ``tokenizer.json``: in its servegate cache or local directory, else in the Hugging Face cache."""
    from servegate.models import MODEL_ALIASES, ensure_model

    if model in MODEL_ALIASES or Path(model).expanduser().is_dir():
        path = Path(ensure_model(model)) / "tokenizer.json"
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "tokenizer.json")
    except ValueError:  # not a repository id
        return None
    return Path(cached) if isinstance(cached, str) else None


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer: a servegate alias or a local directory, else a Hugging Face id in the cache.

    Its ``tokenizer.json`` through ``tokenizers`` (:class:`TokenizerFile`) when it has one, else
    transformers' ``AutoTokenizer`` (a model with a slow tokenizer only).
    """
    file = _tokenizer_file(model)
    if file is not None:
        return TokenizerFile(file)
    from transformers import AutoTokenizer

    from servegate.models import MODEL_ALIASES, ensure_model

    source = str(ensure_model(model)) if (model in MODEL_ALIASES or Path(model).expanduser().is_dir()) else model
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ModelUnavailableError(
            f"could not load the tokenizer of {model!r} ({exc}); the quality stage needs it to find the endings' "
            f"token boundaries — give a servegate alias ({sorted(MODEL_ALIASES)}), a local model directory, or a "
            f"Hugging Face id that is in the local cache") from exc


def encode_item(tokenizer: Any, item: MCItem) -> EncodedItem:
    """Token ids of the context and of each ending, encoded separately so boundaries are exact.

    The ending is joined with one space (HellaSwag's convention, as lm-eval-harness does) unless
    the context already ends with whitespace. The context gets the tokenizer's special tokens
    (a BOS where the model uses one); the endings get none.
    """
    ctx_ids = [int(t) for t in tokenizer.encode(item.ctx)]
    if not ctx_ids:
        raise ConfigError(f"item {item.index}: the context {item.ctx!r} encodes to no tokens")
    sep = "" if item.ctx[-1].isspace() else " "
    endings = []
    for ending in item.endings:
        ids = [int(t) for t in tokenizer.encode(sep + ending.lstrip() if sep else ending, add_special_tokens=False)]
        if not ids:
            raise ConfigError(f"item {item.index}: the ending {ending!r} encodes to no tokens")
        endings.append(ids)
    return EncodedItem(item=item, ctx_ids=ctx_ids, ending_ids=endings)
