"""References a worker's answers are held to, computed here or stored from a trusted run.

- In-process: the same model run with transformers in float32 (``reference_outputs``:
  greedy decoding, EOS ignored, each step's log-probability), and ``teacher_forced_reference``,
  the reference model scoring the *worker's* own continuation, so that every one of the first
  N positions can be compared (``scoring.compare_outputs``).
- Stored: a JSON file recorded from a trusted run (``record_reference``; versioned, checked
  by ``load_reference``) where no in-process run is possible (SGLang on GPU).
- ``run_accuracy_in_process``: the multiple-choice accuracy of a model with no server at all,
  for measuring the floors the expectations hold a worker to.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from servegate.bench.quality.data import (
    EncodedItem,
    encode_item,
    file_sha256,
    load_mc_items,
    load_reference_prompts,
    sample_items,
)
from servegate.bench.quality.scoring import score_items, summarise_accuracy
from servegate.config import QualityConfig
from servegate.errors import ConfigError

__all__ = [
    "REFERENCE_SCHEMA_VERSION",
    "ReferenceOutput",
    "reference_generate",
    "reference_outputs",
    "teacher_forced_reference",
    "record_reference",
    "load_reference",
    "score_items_in_process",
    "run_accuracy_in_process",
]

REFERENCE_SCHEMA_VERSION: Final = 1


@dataclass(frozen=True)
class ReferenceOutput:
    """One prompt's greedy output: ids and the log-probability of each (as generated)."""

    prompt_id: str
    prompt: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]


def teacher_forced_reference(model: Any, prompt_ids: Sequence[int], worker_ids: Sequence[int],
                             n_tokens: int) -> list[tuple[float, float]]:
    """``(reference logprob of worker token k, reference top-1 logprob)`` for the first ``n_tokens``.

    One forward pass over ``prompt + worker output`` (float32 log-softmax), i.e. the reference
    model scoring the worker's own continuation.
    """
    from servegate.worker.logprobs import input_token_logprobs

    out = [int(t) for t in worker_ids[:n_tokens]]
    if not out:
        return []
    ids = [int(t) for t in prompt_ids]
    triples, tops = input_token_logprobs(model, ids + out, start_len=len(ids) - 1, top_k=1)
    return [(float(t[0]), float(top[0][0])) for t, top in zip(triples[1:], tops[1:])]


def reference_generate(model: Any, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy decoding (EOS ignored, as the worker is asked to) with each step's log-probability.

    One prompt at a time with a KV cache; the log-softmax is float32
    (:func:`servegate.worker.logprobs.token_logprobs_from_logits`).
    """
    import torch

    from servegate.worker.logprobs import token_logprobs_from_logits

    device = next(model.parameters()).device
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device), use_cache=True,
                        logits_to_keep=1)
            tokens: list[int] = []
            logprobs: list[float] = []
            for step in range(max_new_tokens):
                row = out.logits[0, -1]
                token = int(row.float().argmax())
                triple, _ = token_logprobs_from_logits(row, token)
                tokens.append(token)
                logprobs.append(float(triple[0]))
                if step + 1 < max_new_tokens:
                    out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=out.past_key_values,
                                use_cache=True)
            results.append((tokens, logprobs))
    return results


def reference_outputs(model_name: str, prompts: Sequence[tuple[str, str]], max_new_tokens: int,
                       dtype: str = "float32") -> tuple[list[ReferenceOutput], dict[str, Any], Any]:
    """``(outputs, model identity, loaded model)`` of an in-process greedy run."""
    from servegate.models import ensure_model, load_model, model_identity

    path = ensure_model(model_name)
    model, tokenizer = load_model(path, dtype=dtype)
    input_ids = [[int(t) for t in tokenizer.encode(text)] for _, text in prompts]
    generated = reference_generate(model, input_ids, max_new_tokens)
    outputs = [ReferenceOutput(prompt_id=pid, prompt=text, input_ids=ids, output_ids=toks, output_logprobs=lps)
               for (pid, text), ids, (toks, lps) in zip(prompts, input_ids, generated)]
    identity = {**model_identity(path), "model": model_name, "dtype": dtype}
    return outputs, identity, model


def record_reference(model: str, prompts: Sequence[tuple[str, str]] | str | Path, path: str | Path, *,
                     max_new_tokens: int = 16, dtype: str = "float32") -> Path:
    """Run ``model`` in-process (transformers, greedy) on ``prompts`` and store the outputs as JSON.

    ``prompts``: ``[(id, text), ...]`` or a reference prompts file. The file holds
    ``schema_version``, ``model`` (identity: name, source, checksum, dtype), ``max_new_tokens``,
    ``created_at`` and one record per prompt (``id, prompt, input_ids, output_ids,
    output_logprobs``). Written atomically. Returns the path.
    """
    if isinstance(prompts, (str, Path)):
        prompts = load_reference_prompts(prompts)
    outputs, identity, _ = reference_outputs(model, prompts, max_new_tokens, dtype)
    doc = {
        "schema_version": REFERENCE_SCHEMA_VERSION, "model": identity, "max_new_tokens": max_new_tokens,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "records": [{"id": o.prompt_id, "prompt": o.prompt, "input_ids": o.input_ids, "output_ids": o.output_ids,
                     "output_logprobs": o.output_logprobs} for o in outputs],
    }
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, target)
    return target


class _StoredRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    prompt: str
    input_ids: list[int] = Field(min_length=1)
    output_ids: list[int]
    output_logprobs: list[float]

    @model_validator(mode="after")
    def _aligned(self) -> "_StoredRecord":
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError(f"record {self.id!r}: {len(self.output_ids)} output_ids but "
                             f"{len(self.output_logprobs)} output_logprobs")
        return self


class _StoredReference(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int
    model: dict[str, Any]
    max_new_tokens: int = Field(ge=1)
    created_at: str
    records: list[_StoredRecord] = Field(min_length=1)


def load_reference(path: str | Path) -> tuple[list[ReferenceOutput], dict[str, Any], int]:
    """Read a stored reference: ``(outputs, model identity, max_new_tokens)``; ``ConfigError`` when unusable."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"stored reference {p} does not exist; record one from a trusted run with "
                          f"servegate.bench.quality.record_reference(model, prompts, path), or set "
                          f"quality.reference = 'in-process'")
    try:
        doc = _StoredReference.model_validate_json(p.read_text(encoding="utf-8"))
    except ValidationError as exc:
        raise ConfigError(f"stored reference {p} is malformed: {exc}; record it again with record_reference") from exc
    if doc.schema_version != REFERENCE_SCHEMA_VERSION:
        raise ConfigError(f"stored reference {p} has schema_version {doc.schema_version}, this servegate reads "
                          f"{REFERENCE_SCHEMA_VERSION}; record it again with record_reference")
    outputs = [ReferenceOutput(prompt_id=r.id, prompt=r.prompt, input_ids=r.input_ids, output_ids=r.output_ids,
                               output_logprobs=r.output_logprobs) for r in doc.records]
    return outputs, doc.model, doc.max_new_tokens


def score_items_in_process(model: Any, encoded: Sequence[EncodedItem], *, pad_token_id: int = 0,
                           progress: Callable[[int], None] | None = None) -> list[list[list[float]]]:
    """Each ending's token log-probabilities straight from the model (one padded batch per item)."""
    from servegate.worker.logprobs import batch_input_token_logprobs

    out = []
    for i, enc in enumerate(encoded):
        start = len(enc.ctx_ids) - 1
        batch = [enc.ctx_ids + e for e in enc.ending_ids]
        results = batch_input_token_logprobs(model, batch, [start] * len(batch), pad_token_id=pad_token_id)
        out.append([[float(t[0]) for t in triples[1:]] for triples, _ in results])
        if progress is not None:
            progress(i)
    return out


def run_accuracy_in_process(model: str, cfg: QualityConfig,
                            dtype: str = "bfloat16") -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(accuracy, items)`` for ``model`` scored in this process (no server): for measuring floors."""
    from servegate.models import ensure_model, load_model

    dataset = Path(cfg.dataset_path).expanduser()
    items = sample_items(load_mc_items(dataset), cfg.max_items, cfg.seed)
    lm, tokenizer = load_model(ensure_model(model), dtype=dtype)
    encoded = [encode_item(tokenizer, it) for it in items]
    started = time.perf_counter()
    logprobs = score_items_in_process(lm, encoded, pad_token_id=tokenizer.pad_token_id or 0)
    duration = time.perf_counter() - started
    table = score_items(encoded, logprobs)
    return summarise_accuracy(table, dataset=dataset.name, dataset_sha256=file_sha256(dataset),
                              protocol=f"in-process-{dtype}", duration_s=duration), table
