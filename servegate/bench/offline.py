"""Offline one-batch benchmark of the embedded engine, like SGLang's ``bench_one_batch``.

No server: the model is loaded in this process and each grid case runs one static batch
of random prompts: one prefill forward over the whole batch (its time is the prefill
latency and the TTFT), then ``output_len - 1`` decode steps of one token per sequence
through the KV cache, each timed on its own. Sampling is greedy and is timed with the
forward it follows, as in SGLang. A warm-up case runs first and is not recorded.

Column definitions follow SGLang: ``prefill_throughput = bs*input_len / prefill_latency``,
``median_decode_throughput = bs / median_decode_latency``, ``overall_throughput =
bs*(input_len+output_len) / latency``; ``input_throughput`` and ``output_throughput``
use the server-mode (``bench_one_batch_server``) definitions ``bs*input_len / ttft`` and
``bs*output_len / (latency - ttft)`` so that offline and server rows compare. A case with
``output_len == 1`` has no decode step: its decode columns and output throughput are NaN.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from transformers import DynamicCache

from servegate.config import OneBatchConfig
from servegate.tables import OFFLINE_ONE_BATCH_COLUMNS
from servegate.models import ensure_model, load_model

__all__ = ["run_offline_one_batch"]

log = logging.getLogger(__name__)

_NUMERIC = OFFLINE_ONE_BATCH_COLUMNS[OFFLINE_ONE_BATCH_COLUMNS.index("prefill_latency"):]

# SGLang draws random prompt ids below 10000; kept so that rows compare with its runs.
_MAX_RANDOM_TOKEN_ID = 10000
# SGLang's warm-up decodes at most 32 tokens: enough to settle allocators and kernels.
_WARMUP_MAX_OUTPUT_LEN = 32


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize()


def _random_input_ids(seed: int, batch_size: int, input_len: int, vocab_size: int, repeat: int = 0) -> torch.Tensor:
    # Seeded per case (and repeat), so that re-running one case alone feeds it the same prompts.
    rng = np.random.default_rng([seed, batch_size, input_len] + ([repeat] if repeat else []))
    ids = rng.integers(0, min(_MAX_RANDOM_TOKEN_ID, vocab_size), size=(batch_size, input_len))
    return torch.from_numpy(ids).to(torch.long)


def _run_case(model: Any, input_ids: torch.Tensor, output_len: int) -> tuple[float, list[float]]:
    """One static batch: (prefill latency, per-step decode latencies), all in seconds."""
    device = model.device
    input_ids = input_ids.to(device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        _synchronize(device)
        tic = time.perf_counter()
        logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        next_ids = logits[:, -1].argmax(dim=-1, keepdim=True)
        _synchronize(device)
        prefill_latency = time.perf_counter() - tic
        decode_latencies: list[float] = []
        for _ in range(output_len - 1):
            tic = time.perf_counter()
            logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
            next_ids = logits[:, -1].argmax(dim=-1, keepdim=True)
            _synchronize(device)
            decode_latencies.append(time.perf_counter() - tic)
    return prefill_latency, decode_latencies


def _measured_row(batch_size: int, input_len: int, output_len: int, prefill_latency: float,
                  decode_latencies: list[float]) -> dict[str, Any]:
    latency = prefill_latency + math.fsum(decode_latencies)
    median_decode = float(np.median(decode_latencies)) if decode_latencies else math.nan
    decode_time = latency - prefill_latency
    return {
        "status": "measured",
        "prefill_latency": prefill_latency,
        "prefill_throughput": batch_size * input_len / prefill_latency,
        "median_decode_latency": median_decode,
        "median_decode_throughput": batch_size / median_decode if decode_latencies else math.nan,
        "latency": latency,
        "last_ttft": prefill_latency,
        "ttft_ms": prefill_latency * 1000.0,
        "input_throughput": batch_size * input_len / prefill_latency,
        "output_throughput": batch_size * output_len / decode_time if decode_latencies else math.nan,
        "overall_throughput": batch_size * (input_len + output_len) / latency,
    }


def _capacity_skip_reason(cfg: OneBatchConfig, max_total_tokens: int | None, batch_size: int,
                          input_len: int, output_len: int) -> str | None:
    if max_total_tokens is None or cfg.skip_token_capacity_check:
        return None
    needed = batch_size * (input_len + output_len)
    if needed <= max_total_tokens:
        return None
    return (f"batch_size*(input_len+output_len) = {needed} tokens exceeds the KV token capacity "
            f"max_total_tokens={max_total_tokens}; shrink the case or raise max_total_tokens "
            f"(or set one_batch.skip_token_capacity_check to run it anyway)")


def run_offline_one_batch(model: str, cfg: OneBatchConfig, *, max_total_tokens: int | None = None,
                          dtype: str = "bfloat16", partial: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Run the batch_size x input_len x output_len grid in-process; one row per case.

    ``model`` is a name from ``servegate.models.MODEL_ALIASES`` or a local model
    directory. ``max_total_tokens`` is the KV token capacity the embedded worker would
    have; a case needing more is a ``skipped`` row with its reason (unless
    ``cfg.skip_token_capacity_check``). A case whose forward fails (e.g. out of memory) is a
    ``failed`` row carrying the error; the remaining cases still run. ``cfg.mode`` is
    not consulted: this function is the offline mode. ``partial`` (when given) holds
    ``{"one_batch": rows so far}`` however the run ends.
    """
    lm, _tokenizer = load_model(ensure_model(model), dtype=dtype)
    run_name = Path(model).name
    vocab_size = int(lm.config.vocab_size)
    cases = list(itertools.product(cfg.batch_sizes, cfg.input_lens, cfg.output_lens))

    rows: list[dict[str, Any]] = []
    warmed_up = False
    try:
        for batch_size, input_len, output_len in cases:
            row: dict[str, Any] = {
                "run_name": run_name, "mode": "offline", "batch_size": batch_size, "input_len": input_len,
                "output_len": output_len, "repeat": 0, "status": "skipped", "skip_reason": None, "error": None,
            }
            reason = _capacity_skip_reason(cfg, max_total_tokens, batch_size, input_len, output_len)
            if reason is not None:
                log.info("skipping (bs=%d, in=%d, out=%d): %s", batch_size, input_len, output_len, reason)
                rows.append(row | {"skip_reason": reason})
                continue
            for repeat in range(cfg.repeats):
                warmed_up = _offline_case(lm, cfg, vocab_size, batch_size, input_len, output_len,
                                          row | {"repeat": repeat}, rows, warmed_up)
    finally:
        if partial is not None:
            partial["one_batch"] = _table(rows)
    return _table(rows)


def _table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=OFFLINE_ONE_BATCH_COLUMNS)
    table[_NUMERIC] = table[_NUMERIC].astype(float)
    return table


def _offline_case(lm: Any, cfg: OneBatchConfig, vocab_size: int, batch_size: int, input_len: int, output_len: int,
                  row: dict[str, Any], rows: list[dict[str, Any]], warmed_up: bool) -> bool:
    """Measure one repeat of one case into ``rows``; returns whether the model is warmed up."""
    input_ids = _random_input_ids(cfg.seed, batch_size, input_len, vocab_size, row["repeat"])
    try:
        if not warmed_up:
            # Like bench_one_batch: the first runnable case, shorter, unrecorded; first calls
            # pay for allocator growth and kernel selection.
            _run_case(lm, input_ids, min(_WARMUP_MAX_OUTPUT_LEN, output_len))
            warmed_up = True
        prefill_latency, decode_latencies = _run_case(lm, input_ids, output_len)
    except (RuntimeError, MemoryError) as exc:
        # torch reports out-of-memory and shape/kernel failures as RuntimeError; the row says
        # which case failed and why, and the other cases still get measured.
        log.warning("case (bs=%d, in=%d, out=%d) failed: %s", batch_size, input_len, output_len, exc)
        rows.append(row | {"status": "failed",
                           "error": f"{type(exc).__name__}: {exc}; the case needs "
                                    f"{batch_size * (input_len + output_len)} KV tokens on {lm.device}: "
                                    f"shrink it or give the machine more memory"})
        return warmed_up
    measured = _measured_row(batch_size, input_len, output_len, prefill_latency, decode_latencies)
    log.info("case (bs=%d, in=%d, out=%d): prefill %.4f s, median decode %.4f s, total %.3f s",
             batch_size, input_len, output_len, measured["prefill_latency"],
             measured["median_decode_latency"], measured["latency"])
    rows.append(row | measured)
    return warmed_up
