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

import contextlib
import datetime as _dt
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
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
    "REFERENCE_THREADS",
    "ReferenceOutput",
    "reference_threads",
    "reference_generate",
    "reference_outputs",
    "teacher_forced_reference",
    "record_reference",
    "load_reference",
    "ITEMS_PER_FORWARD",
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


REFERENCE_THREADS: Final = 1
"""torch intra-op threads of the in-process reference. It runs beside the worker's scoring (the
stage overlaps them), and on a shared machine OpenMP threads that wait for a preempted sibling
stall: measured on 2 cores at load 5, 32 reference forwards took 12.6-23.6 s on 2 threads and
1.7-1.8 s on 1 (issue 17). The reference is a small model scored in batches; one thread is enough."""


@contextlib.contextmanager
def reference_threads(threads: int = REFERENCE_THREADS) -> Iterator[None]:
    """Run the enclosed torch work on ``threads`` intra-op threads, then restore the count.

    Enter it on the thread that runs the work: OpenMP's thread count is per calling thread.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def teacher_forced_reference(model: Any, prompts: Sequence[Sequence[int]], worker_outputs: Sequence[Sequence[int]],
                             n_tokens: int) -> list[list[tuple[float, float]]]:
    """Per prompt, ``(reference logprob of worker token k, reference top-1 logprob)`` for its first ``n_tokens``.

    The reference model scoring the worker's own continuations: ``prompt + worker output`` of
    every prompt in one right-padded forward pass (float32 log-softmax,
    :func:`servegate.worker.logprobs.batch_input_token_logprobs`). A prompt whose worker output
    is empty gets ``[]``.
    """
    from servegate.worker.logprobs import batch_input_token_logprobs

    if len(prompts) != len(worker_outputs):
        raise ConfigError(f"{len(prompts)} prompts but {len(worker_outputs)} worker outputs; "
                          f"give one output per prompt")
    forced: list[list[tuple[float, float]]] = [[] for _ in prompts]
    scored = [i for i, out in enumerate(worker_outputs) if len(out[:n_tokens])]
    batch = [[int(t) for t in prompts[i]] + [int(t) for t in worker_outputs[i][:n_tokens]] for i in scored]
    starts = [len(prompts[i]) - 1 for i in scored]
    results = batch_input_token_logprobs(model, batch, starts, top_k=1) if scored else []
    for i, (triples, tops) in zip(scored, results):
        forced[i] = [(float(t[0]), float(top[0][0])) for t, top in zip(triples[1:], tops[1:])]
    return forced


def reference_generate(model: Any, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy decoding (EOS ignored, as the worker is asked to) with each step's log-probability.

    Every prompt at once: one left-padded batch with a KV cache, padded columns masked out and
    each row's positions starting at 0 at its first real token, so that each row's tokens and
    log-probabilities are those of the prompt decoded alone, to float rounding (a test compares
    the two). The argmax is taken over the float32 logits, the log-softmax in float32
    (:func:`servegate.worker.logprobs.log_softmax_f32`).
    """
    import torch

    from servegate.worker.logprobs import log_softmax_f32

    seqs = [[int(t) for t in ids] for ids in prompts]
    if not seqs:
        return []
    if not all(seqs):
        raise ConfigError("a reference prompt encodes to no tokens; give prompts with text in them")
    lengths = [len(s) for s in seqs]
    width = max(lengths)
    device = next(model.parameters()).device
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    positions = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, ids in enumerate(seqs):
        pad = width - len(ids)
        input_ids[i, pad:] = torch.tensor(ids, dtype=torch.long)
        mask[i, pad:] = 1
        positions[i, pad:] = torch.arange(len(ids), dtype=torch.long)
    tokens: list[list[int]] = [[] for _ in seqs]
    logprobs: list[list[float]] = [[] for _ in seqs]
    with torch.inference_mode():
        out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                    use_cache=True, logits_to_keep=1)
        next_pos = torch.tensor(lengths, dtype=torch.long)
        for step in range(max_new_tokens):
            rows = out.logits[:, -1].float()
            chosen = rows.argmax(dim=-1)
            chosen_lp = log_softmax_f32(rows).gather(1, chosen[:, None])[:, 0]
            for i, (token, lp) in enumerate(zip(chosen.tolist(), chosen_lp.tolist())):
                tokens[i].append(int(token))
                logprobs[i].append(float(lp))
            if step + 1 < max_new_tokens:
                mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=torch.long)], dim=1)
                out = model(input_ids=chosen[:, None].to(device), attention_mask=mask.to(device),
                            position_ids=next_pos[:, None].to(device), past_key_values=out.past_key_values,
                            use_cache=True, logits_to_keep=1)
                next_pos += 1
    return list(zip(tokens, logprobs))


def reference_outputs(model_name: str, prompts: Sequence[tuple[str, str]], max_new_tokens: int,
                       dtype: str = "float32") -> tuple[list[ReferenceOutput], dict[str, Any], Any]:
    """``(outputs, model identity, loaded model)`` of an in-process greedy run (on :data:`REFERENCE_THREADS`)."""
    from servegate.models import ensure_model, load_model, model_identity

    path = ensure_model(model_name)
    with reference_threads():
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


ITEMS_PER_FORWARD: Final = 16
"""Items scored per forward pass in-process: every ending of 16 items (~64 rows of ~15 tokens on
the shipped set) in one right-padded batch."""


def score_items_in_process(model: Any, encoded: Sequence[EncodedItem], *, pad_token_id: int = 0,
                           items_per_forward: int = ITEMS_PER_FORWARD,
                           progress: Callable[[int], None] | None = None) -> list[list[list[float]]]:
    """Each ending's token log-probabilities straight from the model: the endings of
    ``items_per_forward`` items in one right-padded batch (the values of one item at a time, to
    float rounding: right padding leaves every real position's logits as they are)."""
    from servegate.worker.logprobs import batch_input_token_logprobs

    if items_per_forward < 1:
        raise ConfigError(f"items_per_forward must be >= 1, got {items_per_forward}")
    out: list[list[list[float]]] = []
    for first in range(0, len(encoded), items_per_forward):
        group = encoded[first:first + items_per_forward]
        batch = [enc.ctx_ids + e for enc in group for e in enc.ending_ids]
        starts = [len(enc.ctx_ids) - 1 for enc in group for _ in enc.ending_ids]
        rows = iter(batch_input_token_logprobs(model, batch, starts, pad_token_id=pad_token_id))
        for i, enc in enumerate(group, start=first):
            out.append([[float(t[0]) for t in next(rows)[0][1:]] for _ in enc.ending_ids])
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
