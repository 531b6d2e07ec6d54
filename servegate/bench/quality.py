"""Quality stage: a multiple-choice accuracy floor and reference agreement.

Speed regressions are half of what a gate catches; the other half is an engine that answers
worse (a broken kernel, a wrong cache reuse, a sampling bug). Two measurements catch it:

1. **Multiple-choice accuracy**, HellaSwag-style. Each item of a JSONL file (``ctx``,
   ``endings``, ``label``; HellaSwag's format, so the real HellaSwag works too) is scored by
   asking the server for the log-probabilities of ``ctx + " " + ending`` for every ending and
   taking the argmax of the **token-length-normalised** log-likelihood of the ending:
   ``sum(logprob of the ending's tokens) / number of ending tokens``. (lm-eval-harness's
   ``acc_norm`` divides by the ending's length in *bytes* instead; tokens were chosen here
   because the server reports per-token values and the count is exact. The per-ending sums
   and lengths are kept in the items table, so either can be recomputed.) Accuracy comes with
   its standard error ``sqrt(p (1 - p) / n)``.
2. **Reference agreement**, like SGLang's ``bench_one_batch`` correctness mode but checked
   automatically: for fixed prompts the worker's greedy output ids and per-token output
   log-probabilities are compared with a reference — an in-process fp32 run of the same model
   with transformers, or a stored file recorded from a trusted run (:func:`record_reference`)
   where no in-process run is possible (SGLang on GPU). ``exact_match``: the first N tokens
   are identical. With the in-process reference, log-probabilities are compared
   *teacher-forced* — the reference model scores the worker's own output — at every one of the
   first N positions, together with the greedy gap (how far the worker's token is from the
   reference's top choice): a bf16 engine flipping a near-tie stays within tolerance, a broken
   one does not. With a stored reference, only the agreeing prefix can be compared (after a
   divergence the two outputs continue from different contexts).

Protocols: SGLang-native ``POST /generate`` with ``return_logprob`` / ``logprob_start_len``
(``meta_info.input_token_logprobs``, entry 0 None) and OpenAI ``POST /v1/completions`` with
``echo`` + ``logprobs`` (vLLM's ``choices[i].logprobs.token_logprobs``). Prompts are sent as
token ids so that the ending's token boundaries are known exactly.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import pandas as pd
import requests
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from servegate.config import QUALITY_DATA_DIR, QualityConfig
from servegate.engines.base import Engine
from servegate.errors import (
    ConfigError,
    InsufficientDataError,
    ModelUnavailableError,
    StageError,
)
from servegate.http import body_excerpt, join_url, json_body, make_session, request_within, served_model_name
from servegate.tables import ACCURACY_COLUMNS, AGREEMENT_COLUMNS, AGREEMENT_ROW_COLUMNS, ITEM_COLUMNS

__all__ = [
    "DATA_DIR",
    "DEFAULT_DATASET",
    "DEFAULT_REFERENCE_PROMPTS",
    "REFERENCE_SCHEMA_VERSION",
    "QualityConfig",
    "QualityResult",
    "MCItem",
    "EncodedItem",
    "ReferenceOutput",
    "load_mc_items",
    "load_reference_prompts",
    "encode_item",
    "score_items",
    "summarise_accuracy",
    "compare_outputs",
    "teacher_forced_reference",
    "summarise_agreement",
    "reference_generate",
    "record_reference",
    "load_reference",
    "score_items_in_process",
    "run_accuracy_in_process",
    "server_ending_logprobs",
    "server_greedy_outputs",
    "run_quality",
]

DATA_DIR: Final = QUALITY_DATA_DIR
DEFAULT_DATASET: Final = DATA_DIR / "commonsense_mc.jsonl"
DEFAULT_REFERENCE_PROMPTS: Final = DATA_DIR / "reference_prompts.json"
REFERENCE_SCHEMA_VERSION: Final = 1


@dataclass
class QualityResult:
    """What the quality stage produced: four tables (units and meaning in the column names)."""

    accuracy: pd.DataFrame
    """One row: ``ACCURACY_COLUMNS``."""
    items: pd.DataFrame
    """One row per scored item: ``ITEM_COLUMNS``."""
    agreement: pd.DataFrame
    """One row: ``AGREEMENT_COLUMNS``."""
    agreement_rows: pd.DataFrame
    """One row per reference prompt: ``AGREEMENT_ROW_COLUMNS``."""


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


@dataclass(frozen=True)
class ReferenceOutput:
    """One prompt's greedy output: ids and the log-probability of each (as generated)."""

    prompt_id: str
    prompt: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]


# ----------------------------------------------------------------------------- loading


def _file_sha256(path: Path) -> str:
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


def _sample(items: list[MCItem], max_items: int | None, seed: int) -> list[MCItem]:
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


def _load_tokenizer(model: str) -> Any:
    """The model's tokenizer: a servegate alias or a local directory, else a Hugging Face id in the cache."""
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


# ----------------------------------------------------------------------------- scoring


def score_items(encoded: Sequence[EncodedItem], ending_logprobs: Sequence[Sequence[Sequence[float]]]) -> pd.DataFrame:
    """Per-item table from each ending's per-token log-probabilities.

    ``ending_logprobs[i][j]`` lists the log-probabilities of item ``i``'s ending ``j`` tokens.
    An ending scores ``sum / n_tokens``; the prediction is the best-scoring ending (a NaN score
    — a broken server — counts as the worst, never as a win; ties go to the first).
    """
    if len(encoded) != len(ending_logprobs):
        raise StageError(f"{len(ending_logprobs)} scored items for {len(encoded)} asked; the server dropped answers")
    rows = []
    for enc, per_ending in zip(encoded, ending_logprobs):
        if len(per_ending) != len(enc.ending_ids):
            raise StageError(f"item {enc.item.index}: {len(per_ending)} scored endings for {len(enc.ending_ids)}")
        sums = [float(np.sum(lps)) for lps in per_ending]
        lengths = [len(lps) for lps in per_ending]
        scores = [s / n for s, n in zip(sums, lengths)]
        ranked = [s if not math.isnan(s) else -math.inf for s in scores]
        predicted = int(np.argmax(ranked))
        rows.append({
            "item_index": enc.item.index, "label": enc.item.label, "predicted": predicted,
            "correct": predicted == enc.item.label, "scores": scores, "sum_logprobs": sums,
            "n_ending_tokens": lengths,
            "n_ending_bytes": [len(e.encode("utf-8")) for e in enc.item.endings],
        })
    return pd.DataFrame(rows, columns=ITEM_COLUMNS)


def summarise_accuracy(items: pd.DataFrame, *, dataset: str = "", dataset_sha256: str = "", protocol: str = "",
                       duration_s: float = math.nan) -> pd.DataFrame:
    """One row: accuracy ``p`` and its standard error ``sqrt(p (1 - p) / n)``; no items is an error.

    ``accuracy_unnormalised`` (argmax of the plain sum) is kept beside it: a gap that moves
    between runs points at the length handling rather than the model.
    """
    n = len(items)
    if n == 0:
        raise InsufficientDataError("no multiple-choice item was scored; the accuracy is undefined, not 0 — "
                                    "check the dataset and the server's answers")
    p = float(items["correct"].mean())
    unnormalised = float(np.mean([
        int(np.argmax([s if not math.isnan(s) else -math.inf for s in sums])) == label
        for sums, label in zip(items["sum_logprobs"], items["label"])]))
    return pd.DataFrame([{
        "n_items": n, "n_correct": int(items["correct"].sum()), "accuracy": p,
        "accuracy_stderr": math.sqrt(p * (1.0 - p) / n), "accuracy_unnormalised": unnormalised,
        "normalisation": "token", "dataset": dataset, "dataset_sha256": dataset_sha256, "protocol": protocol,
        "duration_s": duration_s,
    }], columns=ACCURACY_COLUMNS)


# ----------------------------------------------------------------------------- agreement


def compare_outputs(worker_ids: Sequence[int], worker_logprobs: Sequence[float | None],
                    reference_ids: Sequence[int], reference_logprobs: Sequence[float],
                    n_tokens: int, tolerance: float, *, prompt_id: str = "",
                    teacher_forced: Sequence[tuple[float, float]] | None = None) -> dict[str, Any]:
    """One prompt's agreement row over the first ``n_tokens`` output tokens.

    ``exact_match``: both outputs have at least ``n_tokens`` tokens and the first ``n_tokens``
    are identical (``first_mismatch_index`` is -1 then).

    Without ``teacher_forced`` (a stored reference), log-probabilities are compared on the
    agreeing prefix only (before the first mismatch — after it the two outputs continue from
    different contexts). With ``teacher_forced`` (the in-process reference), entry ``k`` is
    ``(reference logprob of the worker's token k, reference top-1 logprob)`` given the
    *worker's* prefix, so every one of the first ``n_tokens`` positions is compared:
    ``|worker - reference|`` and the greedy gap ``top-1 - reference logprob of the worker's
    token`` (0 when the worker chose the reference's argmax; a bf16 engine flipping a near-tie
    gives a small gap, a broken one a gap of several nats).

    ``within_tolerance``: at least one position compared, every diff and every greedy gap
    ``<= tolerance``; a missing or NaN worker value fails it.
    """
    w = [int(t) for t in worker_ids[:n_tokens]]
    r = [int(t) for t in reference_ids[:n_tokens]]
    mismatch = next((k for k, (a, b) in enumerate(zip(w, r)) if a != b), -1)
    if mismatch == -1 and len(w) != len(r):
        mismatch = min(len(w), len(r))  # one output stopped early: it diverges where it ends
    if mismatch == -1 and len(w) < n_tokens:
        mismatch = len(w)
    if teacher_forced is not None:
        positions = min(len(w), len(teacher_forced))
        reference = [teacher_forced[k][0] for k in range(positions)]
        gaps = np.asarray([teacher_forced[k][1] - teacher_forced[k][0] for k in range(positions)], dtype=float)
    else:
        positions = len(w) if mismatch == -1 else mismatch
        reference = [reference_logprobs[k] if k < len(reference_logprobs) else None for k in range(positions)]
        gaps = np.zeros(positions)
    diffs = []
    for k in range(positions):
        a = worker_logprobs[k] if k < len(worker_logprobs) else None
        b = reference[k]
        diffs.append(math.inf if a is None or b is None else abs(float(a) - float(b)))
    arr = np.asarray(diffs, dtype=float)
    arr = np.where(np.isnan(arr), math.inf, arr)
    gaps = np.where(np.isnan(gaps), math.inf, gaps)
    return {
        "prompt_id": prompt_id,
        "n_compared": min(len(w), len(r)),
        "first_mismatch_index": mismatch,
        "exact_match": mismatch == -1,
        "logprob_comparison": "agreeing-prefix" if teacher_forced is None else "teacher-forced",
        "n_logprobs_compared": int(arr.size),
        "mean_abs_logprob_diff": float(arr.mean()) if arr.size else math.nan,
        "max_abs_logprob_diff": float(arr.max()) if arr.size else math.nan,
        "max_greedy_gap": float(gaps.max()) if gaps.size else math.nan,
        "within_tolerance": bool(arr.size) and bool((arr <= tolerance).all()) and bool((gaps <= tolerance).all()),
        "worker_output_ids": [int(t) for t in worker_ids],
        "reference_output_ids": [int(t) for t in reference_ids],
    }


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


def summarise_agreement(rows: pd.DataFrame, *, n_tokens: int, tolerance: float, reference_source: str,
                        reference_model: str = "", duration_s: float = math.nan) -> pd.DataFrame:
    """One row over all prompts; token-weighted mean diff, max over every compared token."""
    if len(rows) == 0:
        raise InsufficientDataError("no reference prompt was compared; agreement is undefined — check the "
                                    "reference prompts file")
    compared = int(rows["n_logprobs_compared"].sum())
    weighted = rows["mean_abs_logprob_diff"].fillna(0.0) * rows["n_logprobs_compared"]
    return pd.DataFrame([{
        "n_prompts": len(rows), "exact_match_tokens": n_tokens,
        "exact_match_rate": float(rows["exact_match"].mean()),
        "n_tokens_compared": compared,
        "mean_abs_logprob_diff": float(weighted.sum() / compared) if compared else math.nan,
        "max_abs_logprob_diff": float(rows["max_abs_logprob_diff"].max()) if compared else math.nan,
        "logprob_tolerance": tolerance,
        "within_tolerance_rate": float(rows["within_tolerance"].mean()),
        "reference_source": reference_source, "reference_model": reference_model, "duration_s": duration_s,
    }], columns=AGREEMENT_COLUMNS)


# ----------------------------------------------------------------------------- in-process reference


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


def _reference_outputs(model_name: str, prompts: Sequence[tuple[str, str]], max_new_tokens: int,
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
    outputs, identity, _ = _reference_outputs(model, prompts, max_new_tokens, dtype)
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


# ----------------------------------------------------------------------------- in-process accuracy


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
    items = _sample(load_mc_items(dataset), cfg.max_items, cfg.seed)
    lm, tokenizer = load_model(ensure_model(model), dtype=dtype)
    encoded = [encode_item(tokenizer, it) for it in items]
    started = time.perf_counter()
    logprobs = score_items_in_process(lm, encoded, pad_token_id=tokenizer.pad_token_id or 0)
    duration = time.perf_counter() - started
    table = score_items(encoded, logprobs)
    return summarise_accuracy(table, dataset=dataset.name, dataset_sha256=_file_sha256(dataset),
                              protocol=f"in-process-{dtype}", duration_s=duration), table


# ----------------------------------------------------------------------------- talking to the server


class _Client:
    """POSTs JSON over one ``requests.Session`` per thread (sessions are not thread-safe), each
    request bounded from send to last byte by ``timeout_s`` (``quality.request_timeout_s``)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url, self.api_key, self.timeout_s = base_url, api_key, timeout_s
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = make_session(self.api_key)
            with self._lock:
                self._sessions.append(session)
        return session

    def post(self, path: str, body: dict[str, Any], what: str) -> Any:
        url = join_url(self.base_url, path)
        response = request_within(self._session(), "POST", url, limit_s=self.timeout_s, what=f"{what} (POST {url})",
                                  setting="quality.request_timeout_s", json=body,
                                  hint="check that the worker is alive")
        if response.status_code != 200:
            raise StageError(f"{what}: POST {url} -> {response.status_code}: {body_excerpt(response)!r}; "
                             f"read the worker log")
        return json_body(response, what)

    def close(self) -> None:
        with self._lock:
            for session in self._sessions:
                session.close()
            self._sessions.clear()


def _parallel(fn: Callable[[Any], Any], work: Sequence[Any], concurrency: int) -> list[Any]:
    """``[fn(w) for w in work]`` on ``concurrency`` threads; the first error cancels the rest and is raised."""
    if concurrency <= 1 or len(work) <= 1:
        return [fn(w) for w in work]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="servegate-quality") as pool:
        futures = [pool.submit(fn, w) for w in work]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


_NO_LOGPROBS_HINT: Final = {
    "native": "the server must support SGLang's return_logprob / logprob_start_len on /generate "
              "(meta_info.input_token_logprobs)",
    "openai": "the server must support echo + logprobs on /v1/completions (choices[i].logprobs.token_logprobs, "
              "as vLLM)",
}


def _native_ending_logprobs(client: _Client, enc: EncodedItem) -> list[list[float]]:
    body = {
        "input_ids": [enc.ctx_ids + e for e in enc.ending_ids],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        # Entry 0 of input_token_logprobs is always None (SGLang), so start one before the ending.
        "logprob_start_len": len(enc.ctx_ids) - 1,
    }
    doc = client.post("/generate", body, f"scoring item {enc.item.index}")
    if not isinstance(doc, list) or len(doc) != len(enc.ending_ids):
        raise StageError(f"scoring item {enc.item.index}: /generate with {len(enc.ending_ids)} input_ids answered "
                         f"{type(doc).__name__} of length {len(doc) if isinstance(doc, list) else '-'}; a batched "
                         f"request must answer a list with one result per prompt")
    per_ending = []
    for result, ending in zip(doc, enc.ending_ids):
        meta = result.get("meta_info") if isinstance(result, dict) else None
        triples = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(triples, list) or len(triples) < len(ending):
            raise StageError(f"scoring item {enc.item.index}: no usable meta_info.input_token_logprobs in "
                             f"{str(result)[:300]!r}; {_NO_LOGPROBS_HINT['native']}")
        tail = triples[len(triples) - len(ending):]
        try:
            ids = [int(t[1]) for t in tail]
            values = [math.nan if t[0] is None else float(t[0]) for t in tail]
        except (TypeError, ValueError, IndexError) as exc:
            raise StageError(f"scoring item {enc.item.index}: malformed input_token_logprobs {tail!r}; expected "
                             f"[logprob, token_id, text] triples") from exc
        if ids != ending:
            raise StageError(f"scoring item {enc.item.index}: the server scored tokens {ids} where the ending is "
                             f"{ending}; it must honour input_ids and logprob_start_len as SGLang does")
        per_ending.append(values)
    return per_ending


def _openai_choices(doc: Any, n: int, what: str) -> list[dict[str, Any]]:
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
        raise StageError(f"{what}: expected {n} choices from /v1/completions, got {str(doc)[:300]!r}")
    return sorted(choices, key=lambda c: int(c.get("index", 0)))


def _openai_ending_logprobs(client: _Client, enc: EncodedItem, model: str) -> list[list[float]]:
    # max_tokens=1 as lm-eval-harness does: some servers reject 0 with echo.
    body = {"model": model, "prompt": [enc.ctx_ids + e for e in enc.ending_ids], "max_tokens": 1,
            "temperature": 0.0, "echo": True, "logprobs": 1}
    what = f"scoring item {enc.item.index}"
    choices = _openai_choices(client.post("/v1/completions", body, what), len(enc.ending_ids), what)
    start = len(enc.ctx_ids)
    per_ending = []
    for choice, ending in zip(choices, enc.ending_ids):
        lp = choice.get("logprobs")
        values = lp.get("token_logprobs") if isinstance(lp, dict) else None
        if not isinstance(values, list) or len(values) < start + len(ending):
            raise StageError(f"{what}: no prompt log-probabilities in {str(choice)[:300]!r}; "
                             f"{_NO_LOGPROBS_HINT['openai']}")
        per_ending.append([math.nan if v is None else float(v) for v in values[start:start + len(ending)]])
    return per_ending


def server_ending_logprobs(base_url: str, protocol: Literal["native", "openai"], encoded: Sequence[EncodedItem],
                           *, api_key: str | None = None, model: str | None = None, timeout_s: float = 300.0,
                           concurrency: int = 4) -> list[list[list[float]]]:
    """Each ending's token log-probabilities as the server computes them (one request per item).

    Native: one batched ``/generate`` per item (the endings share ``logprob_start_len``).
    OpenAI: one ``/v1/completions`` per item with a list of token-id prompts, ``echo`` and
    ``logprobs`` (``model`` is required).
    """
    client = _Client(base_url, api_key, timeout_s)
    try:
        if protocol == "native":
            return _parallel(lambda enc: _native_ending_logprobs(client, enc), encoded, concurrency)
        if not model:
            raise ConfigError("the OpenAI protocol needs the served model's name; pass model=")
        return _parallel(lambda enc: _openai_ending_logprobs(client, enc, model), encoded, concurrency)
    finally:
        client.close()


def _parse_token_id(token: Any, what: str) -> int:
    if isinstance(token, int):
        return token
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token.removeprefix("token_id:"))
    raise StageError(f"{what}: the server named an output token {token!r} instead of its id; it must support "
                     f"vLLM's return_tokens_as_token_ids (tokens as 'token_id:<id>')")


def server_greedy_outputs(base_url: str, protocol: Literal["native", "openai"], prompts: Sequence[Sequence[int]],
                          max_new_tokens: int, *, api_key: str | None = None, model: str | None = None,
                          timeout_s: float = 300.0) -> list[tuple[list[int], list[float | None]]]:
    """The server's greedy output ids and per-token log-probabilities for each prompt (one batched request).

    EOS is ignored so that every output has ``max_new_tokens`` tokens, as the reference does.
    """
    client = _Client(base_url, api_key, timeout_s)
    what = "reference agreement"
    batch = [[int(t) for t in p] for p in prompts]
    try:
        if protocol == "native":
            doc = client.post("/generate", {
                "input_ids": batch, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            }, what)
            if not isinstance(doc, list) or len(doc) != len(batch):
                raise StageError(f"{what}: /generate with {len(batch)} prompts answered {str(doc)[:300]!r}; "
                                 f"a batched request must answer one result per prompt")
            outputs = []
            for result in doc:
                meta = result.get("meta_info") if isinstance(result, dict) else None
                triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
                ids = result.get("output_ids") if isinstance(result, dict) else None
                if not isinstance(triples, list) or not isinstance(ids, list):
                    raise StageError(f"{what}: no output_ids / meta_info.output_token_logprobs in "
                                     f"{str(result)[:300]!r}; {_NO_LOGPROBS_HINT['native']}")
                try:
                    lps = [None if t[0] is None else float(t[0]) for t in triples]
                except (TypeError, ValueError, IndexError) as exc:
                    raise StageError(f"{what}: malformed output_token_logprobs {triples[:3]!r}...") from exc
                outputs.append(([int(t) for t in ids], lps))
            return outputs
        if not model:
            raise ConfigError("the OpenAI protocol needs the served model's name; pass model=")
        doc = client.post("/v1/completions", {
            "model": model, "prompt": batch, "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 1, "return_tokens_as_token_ids": True,
        }, what)
        outputs = []
        for choice in _openai_choices(doc, len(batch), what):
            lp = choice.get("logprobs")
            tokens = lp.get("tokens") if isinstance(lp, dict) else None
            values = lp.get("token_logprobs") if isinstance(lp, dict) else None
            if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
                raise StageError(f"{what}: no output log-probabilities in {str(choice)[:300]!r}; "
                                 f"{_NO_LOGPROBS_HINT['openai']}")
            outputs.append(([_parse_token_id(t, what) for t in tokens],
                            [None if v is None else float(v) for v in values]))
        return outputs
    finally:
        client.close()


# ----------------------------------------------------------------------------- the stage


def _run_accuracy(base_url: str, protocol: Literal["native", "openai"], cfg: QualityConfig, tokenizer: Any,
                  api_key: str | None, served_model: str | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    dataset = Path(cfg.dataset_path).expanduser()
    items = _sample(load_mc_items(dataset), cfg.max_items, cfg.seed)
    encoded = [encode_item(tokenizer, it) for it in items]
    started = time.perf_counter()
    logprobs = server_ending_logprobs(base_url, protocol, encoded, api_key=api_key, model=served_model,
                                      timeout_s=cfg.request_timeout_s, concurrency=cfg.concurrency)
    duration = time.perf_counter() - started
    table = score_items(encoded, logprobs)
    return summarise_accuracy(table, dataset=dataset.name, dataset_sha256=_file_sha256(dataset), protocol=protocol,
                              duration_s=duration), table


def _run_agreement(base_url: str, protocol: Literal["native", "openai"], cfg: QualityConfig, model_name: str,
                   api_key: str | None, served_model: str | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    started = time.perf_counter()
    prompts = load_reference_prompts(cfg.reference_prompts_path)
    model = None
    if cfg.reference == "in-process":
        reference, identity, model = _reference_outputs(model_name, prompts, cfg.reference_max_new_tokens)
        source = "in-process"
    else:
        reference, identity, stored_tokens = load_reference(cfg.reference)
        source = str(Path(cfg.reference).expanduser())
        if stored_tokens < cfg.exact_match_tokens:
            raise ConfigError(f"stored reference {source} holds {stored_tokens} tokens per prompt but "
                              f"exact_match_tokens is {cfg.exact_match_tokens}; record it with more tokens")
        wanted = dict(prompts)
        stored = {r.prompt_id: r.prompt for r in reference}
        if stored != wanted:
            raise ConfigError(f"stored reference {source} was recorded for other prompts than "
                              f"{cfg.reference_prompts_path}; record it again from these prompts")
    n_generate = cfg.reference_max_new_tokens
    if source != "in-process":
        n_generate = min(n_generate, stored_tokens)
    outputs = server_greedy_outputs(base_url, protocol, [r.input_ids for r in reference], n_generate,
                                    api_key=api_key, model=served_model, timeout_s=cfg.request_timeout_s)
    rows = []
    for ref, (ids, lps) in zip(reference, outputs):
        forced = (teacher_forced_reference(model, ref.input_ids, ids, cfg.exact_match_tokens)
                  if model is not None else None)
        rows.append(compare_outputs(ids, lps, ref.output_ids, ref.output_logprobs, cfg.exact_match_tokens,
                                    cfg.logprob_tolerance, prompt_id=ref.prompt_id, teacher_forced=forced))
    table = pd.DataFrame(rows, columns=AGREEMENT_ROW_COLUMNS)
    model_label = str(identity.get("name") or identity.get("model") or model_name)
    summary = summarise_agreement(table, n_tokens=cfg.exact_match_tokens, tolerance=cfg.logprob_tolerance,
                                  reference_source=source, reference_model=model_label,
                                  duration_s=time.perf_counter() - started)
    return summary, table


def run_quality(base_url: str, engine: Engine, cfg: QualityConfig, api_key: str | None = None, *,
                model_for_reference: str | None = None, tokenizer: Any | None = None) -> QualityResult:
    """Run both quality measurements against a flushed, idle worker.

    ``model_for_reference``: the model (servegate alias, local directory, or cached Hugging Face
    id) whose tokenizer splits contexts from endings and which the in-process reference runs;
    default: the first id the server lists under ``/v1/models``. ``tokenizer`` overrides the
    tokenizer only. Raises ``StageError`` when the server answers without log-probabilities,
    ``ConfigError`` for an unusable dataset, prompts file or stored reference.
    """
    protocol = engine.protocol
    served_model: str | None = None
    if protocol == "openai" or model_for_reference is None:
        session = make_session(api_key)
        try:
            served_model = served_model_name(session, base_url, timeout_s=min(cfg.request_timeout_s, 30.0),
                                             setting="quality.request_timeout_s")
        finally:
            session.close()
    model_name = model_for_reference or served_model or ""
    if tokenizer is None:
        tokenizer = _load_tokenizer(model_name)
    accuracy, items = _run_accuracy(base_url, protocol, cfg, tokenizer, api_key, served_model)
    agreement, agreement_rows = _run_agreement(base_url, protocol, cfg, model_name, api_key, served_model)
    return QualityResult(accuracy=accuracy, items=items, agreement=agreement, agreement_rows=agreement_rows)
