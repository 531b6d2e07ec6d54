"""Scoring: length-normalised log-prob accuracy with its standard error, and reference agreement.

Accuracy, HellaSwag-style: an item's prediction is the argmax over its endings of the
**token-length-normalised** log-likelihood of the ending, ``sum(logprob of the ending's
tokens) / number of ending tokens``. (lm-eval-harness's ``acc_norm`` divides by the ending's
length in *bytes* instead; tokens were chosen here because the server reports per-token
values and the count is exact. The per-ending sums and lengths are kept in the items table,
so either can be recomputed.) Accuracy comes with its standard error ``sqrt(p (1 - p) / n)``.

Agreement: a worker's greedy output ids and per-token log-probabilities against a reference
(``reference``), over the first N tokens. Pure functions of their inputs: no model, no server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from servegate.bench.quality.data import EncodedItem
from servegate.errors import InsufficientDataError, StageError
from servegate.tables import ACCURACY_COLUMNS, AGREEMENT_COLUMNS, ITEM_COLUMNS

__all__ = ["score_items", "summarise_accuracy", "compare_outputs", "summarise_agreement"]


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
