"""The serving load generator (SGLang's ``bench_serving``, trimmed to what the gate needs).

One asyncio event loop and one ``aiohttp.ClientSession`` (keep-alive connections, a
``TCPConnector`` sized to the concurrency) send every request as a stream; SSE lines are
parsed with orjson, and output tokens come from the server's counters (native
``meta_info.completion_tokens``, OpenAI ``usage``), never from tokenizing chunks — a load
generator that burns CPU per chunk measures itself.

Arrivals follow a schedule computed up front from a seeded generator: ``poisson``
(exponential gaps at ``request_rate``), ``constant`` (``1/request_rate`` gaps) or
``all-at-once`` (``request_rate=inf`` means all at once for any arrival kind). Each request
sleeps until its scheduled time, so a slow request never delays the next send; the client's
own health is measured as the *dispatch lag* (actual minus scheduled send) and a run whose
p99 lag exceeds ``max_dispatch_lag_p99_ms`` is flagged ``client_fell_behind``. Waiting for a
``max_concurrency`` slot is intended back-pressure, recorded separately as ``queue_wait_ms``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import numpy as np
import orjson
import pandas as pd
import requests
from tqdm import tqdm

from servegate.bench import protocol as proto
from servegate.bench.datasets import DatasetRow, load_sharegpt, sample_random_requests
from servegate.bench.stats import arrival_ks_pvalue, summarize_serving
from servegate.config import ServingConfig
from servegate.engines.base import Engine
from servegate.errors import InfraError, InsufficientDataError, ServerUnreachableError, StageError

__all__ = ["REQUEST_COLUMNS", "ServingResult", "arrival_schedule", "build_requests", "run_serving"]

REQUEST_COLUMNS: Final = [
    "request_id", "input_tokens", "planned_input_tokens", "output_tokens", "planned_output_tokens",
    "scheduled_send_s", "dispatched_s", "actual_send_s", "dispatch_lag_ms", "queue_wait_ms",
    "ttft_ms", "e2e_latency_ms", "tpot_ms", "itls_ms", "finished_s", "success", "error", "error_kind",
]

# The arrival gaps get their own random stream, so that they are not the same bits the
# dataset drew its prompts from with the same seed.
_ARRIVAL_STREAM: Final = 0xA7
_READ_BUFSIZE: Final = 10 * 1024**2  # as SGLang: a full 64 KiB buffer stalls big streams


@dataclass
class ServingResult:
    """What the serving stage measured."""

    requests: pd.DataFrame
    """``serving_requests``: one row per request (see docs/contracts.md)."""
    summary: pd.DataFrame
    """``serving_summary``: one row (empty in a partial result attached to an exception)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The load as run: dataset, arrival, rate, concurrency, protocol, seed, notes."""


def arrival_schedule(n: int, arrival: str, rate: float, seed: int) -> np.ndarray:
    """Send times (s from the start) of ``n`` requests; the first is sent at 0.

    Poisson gaps are ``exponential(1/rate)`` draws, as SGLang samples them, but seeded and drawn
    up front so the schedule does not depend on the client's speed.
    """
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate) or arrival == "all-at-once":
        return np.zeros(n)
    if arrival == "poisson":
        gaps = np.random.default_rng([seed, _ARRIVAL_STREAM]).exponential(1.0 / rate, size=n - 1)
    elif arrival == "constant":
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        raise StageError(f"unknown arrival {arrival!r}; choose poisson, constant or all-at-once")
    return np.concatenate([[0.0], np.cumsum(gaps)])


def build_requests(cfg: ServingConfig, tokenizer: Any | None = None) -> list[DatasetRow]:
    """The requests of a run: seeded random token ids, or a ShareGPT-format file."""
    if cfg.dataset == "random":
        return sample_random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                                      cfg.random_range_ratio, cfg.seed)
    return load_sharegpt(cfg.dataset_path or "", cfg.num_prompts, cfg.seed, cfg.random_output_len, tokenizer)


@dataclass
class _Outcome:
    ttft_s: float = math.nan
    latency_s: float = math.nan
    itls_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    success: bool = False
    error: str | None = None
    error_kind: str | None = None
    """connection | timeout | http | stream | protocol."""


async def _stream_one(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                      protocol: str, timeout: aiohttp.ClientTimeout) -> _Outcome:
    out = _Outcome()
    st = time.perf_counter()
    last_ts = st
    count = 0  # cumulative output tokens seen so far
    usage_total: int | None = None
    saw_done = False
    try:
        async with session.post(url, data=body, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                text = await resp.text()
                out.error, out.error_kind = f"HTTP {resp.status}: {text[:500]}", "http"
                return out
            async for line in resp.content:
                data = proto.parse_sse_line(line)
                if data is None:
                    continue
                if data is proto.SSE_DONE:
                    saw_done = True
                    break
                if protocol == "native":
                    ev = proto.native_event(data)
                    new_count = ev.completion_tokens if ev.completion_tokens is not None else count + 1
                    if ev.prompt_tokens is not None:
                        out.prompt_tokens = int(ev.prompt_tokens)
                else:
                    events = proto.openai_events(data)
                    prompt_tokens, completion = proto.openai_usage(data)
                    if prompt_tokens is not None:
                        out.prompt_tokens = int(prompt_tokens)
                    if not events:  # the include_usage summary chunk, or a finish-only chunk
                        if completion is not None:
                            usage_total = completion
                        continue
                    new_count = completion if completion is not None else count + 1
                n_new = new_count - count
                if n_new <= 0:
                    continue  # a chunk without new tokens (e.g. a finish-only chunk)
                ts = time.perf_counter()
                if count == 0:
                    out.ttft_s = ts - st
                else:
                    # Several tokens in one chunk (speculative decoding, stream_interval>1):
                    # spread the gap over them, as SGLang's bench_serving does.
                    out.itls_s.extend([(ts - last_ts) / n_new] * n_new)
                last_ts = ts
                count = new_count
        out.latency_s = time.perf_counter() - st
    except asyncio.TimeoutError:
        out.error, out.error_kind = f"no complete answer within {timeout.total} s", "timeout"
        return out
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        out.error, out.error_kind = f"{type(exc).__name__}: {exc}", "connection"
        return out
    except aiohttp.ClientError as exc:
        out.error, out.error_kind = f"{type(exc).__name__}: {exc}", "http"
        return out
    except StageError as exc:
        out.error, out.error_kind = str(exc), "protocol"
        return out
    out.output_tokens = int(usage_total) if usage_total is not None else count
    if not saw_done:
        out.error, out.error_kind = f"stream ended before [DONE] after {count} tokens", "stream"
    elif count == 0:
        out.error, out.error_kind = "stream finished without any output token", "stream"
    else:
        out.success = True
    return out


def _body(protocol: str, model: str | None, row: DatasetRow) -> bytes:
    if protocol == "native":
        return orjson.dumps(proto.native_generate_body(row.prompt, row.output_len, stream=True))
    return orjson.dumps(proto.openai_completions_body(model or "", row.prompt, row.output_len, stream=True))


async def _run_load(rows: list[DatasetRow], schedule: np.ndarray, url: str, protocol: str, model: str | None,
                    cfg: ServingConfig, api_key: str | None) -> tuple[list[dict[str, Any]], float]:
    headers = {"Content-Type": "application/json", **proto.auth_headers(api_key)}
    bodies = [_body(protocol, model, r) for r in rows]  # serialized before the clock starts
    concurrency = cfg.max_concurrency or len(rows)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    records: list[dict[str, Any]] = [{} for _ in rows]
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=_READ_BUFSIZE) as session:
        with tqdm(total=len(rows), desc="serving", unit="req", file=sys.stderr,
                  disable=not cfg.progress) as pbar:
            t0 = time.perf_counter()

            async def one(i: int) -> None:
                delay = t0 + schedule[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                dispatched = time.perf_counter()
                if semaphore is None:
                    sent = time.perf_counter()
                    outcome = await _stream_one(session, url, bodies[i], headers, protocol, timeout)
                else:
                    async with semaphore:
                        sent = time.perf_counter()
                        outcome = await _stream_one(session, url, bodies[i], headers, protocol, timeout)
                finished = time.perf_counter()
                records[i] = _record(i, rows[i], float(schedule[i]), dispatched - t0, sent - t0,
                                     finished - t0, outcome)
                pbar.update(1)

            await asyncio.gather(*(one(i) for i in range(len(rows))))
    return records, t0


def _record(i: int, row: DatasetRow, scheduled: float, dispatched: float, sent: float, finished: float,
            o: _Outcome) -> dict[str, Any]:
    ttft_ms = o.ttft_s * 1000.0
    e2e_ms = o.latency_s * 1000.0
    out_tokens = o.output_tokens if o.success else 0
    # TPOT needs a decode phase: undefined (NaN, not 0) for a one-token output.
    tpot_ms = (e2e_ms - ttft_ms) / (out_tokens - 1) if o.success and out_tokens > 1 else math.nan
    return {
        "request_id": i,
        "input_tokens": o.prompt_tokens if o.prompt_tokens is not None else row.prompt_len,
        "planned_input_tokens": row.prompt_len,
        "output_tokens": out_tokens,
        "planned_output_tokens": row.output_len,
        "scheduled_send_s": scheduled,
        "dispatched_s": dispatched,
        "actual_send_s": sent,
        "dispatch_lag_ms": (dispatched - scheduled) * 1000.0,
        "queue_wait_ms": (sent - dispatched) * 1000.0,
        "ttft_ms": ttft_ms if o.success else math.nan,
        "e2e_latency_ms": e2e_ms if o.success else math.nan,
        "tpot_ms": tpot_ms,
        "itls_ms": [x * 1000.0 for x in o.itls_s] if o.success else [],
        "finished_s": finished,
        "success": o.success,
        "error": o.error,
        "error_kind": o.error_kind,
    }


def _run_coroutine(coro: Any) -> Any:
    """asyncio.run, also from a thread that already runs an event loop (e.g. a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run_serving(base_url: str, engine: Engine, cfg: ServingConfig, api_key: str | None = None, *,
                tokenizer: Any | None = None, session: requests.Session | None = None) -> ServingResult:
    """Run the serving load and return per-request rows, the one-row summary and the run's meta.

    ``tokenizer`` (anything with ``encode``) is used only for ShareGPT files; see
    ``datasets.load_sharegpt``. When every request failed on a connection error the server
    is gone: ``ServerUnreachableError`` with the partial ``ServingResult`` as ``exc.partial``.
    When no request succeeded for another reason: ``InsufficientDataError``, same partial.
    """
    base_url = base_url.rstrip("/")
    protocol = cfg.protocol or engine.protocol
    rows = build_requests(cfg, tokenizer)
    schedule = arrival_schedule(len(rows), cfg.arrival, cfg.request_rate, cfg.seed)
    model = None
    if protocol == "openai":
        http = session or requests.Session()
        try:
            model = proto.fetch_model_name(http, base_url, api_key)
        finally:
            if session is None:
                http.close()
    meta: dict[str, Any] = {
        "dataset": cfg.dataset, "dataset_path": cfg.dataset_path, "num_prompts": len(rows),
        "arrival": cfg.arrival, "request_rate": cfg.request_rate, "max_concurrency": cfg.max_concurrency,
        "protocol": protocol, "seed": cfg.seed, "model": model, "notes": [],
    }
    records, _ = _run_coroutine(_run_load(rows, schedule, proto.generate_url(base_url, protocol), protocol,
                                          model, cfg, api_key))
    requests_df = pd.DataFrame(records, columns=REQUEST_COLUMNS)
    for col in ("input_tokens", "planned_input_tokens", "output_tokens", "planned_output_tokens"):
        requests_df[col] = requests_df[col].astype("Int64")
    requests_df["success"] = requests_df["success"].astype(bool)

    failed = requests_df[~requests_df["success"]]
    if len(failed) == len(requests_df) and (failed["error_kind"] == "connection").all():
        exc = ServerUnreachableError(
            f"all {len(requests_df)} serving requests to {base_url} failed to connect "
            f"(first: {failed['error'].iloc[0]}); the server is gone — check the worker's log")
        exc.partial = ServingResult(requests_df, pd.DataFrame(), meta)  # type: ignore[attr-defined]
        raise exc

    duration = float(requests_df["finished_s"].max())
    try:
        summary = summarize_serving(
            requests_df, duration, slo_ttft_ms=cfg.slo_ttft_ms, slo_tpot_ms=cfg.slo_tpot_ms,
            slo_e2e_ms=cfg.slo_e2e_ms, max_dispatch_lag_p99_ms=cfg.max_dispatch_lag_p99_ms)
    except InfraError as exc:
        exc.partial = ServingResult(requests_df, pd.DataFrame(), meta)  # type: ignore[attr-defined]
        raise
    summary["connection_errors"] = int((failed["error_kind"] == "connection").sum())
    summary["arrival_ks_pvalue"] = math.nan
    if cfg.arrival == "poisson" and math.isfinite(cfg.request_rate):
        try:
            summary["arrival_ks_pvalue"] = arrival_ks_pvalue(requests_df["dispatched_s"].to_numpy(),
                                                             cfg.request_rate)
        except InsufficientDataError as exc:
            meta["notes"].append(f"arrival KS test not run: {exc}")
    summary.update(arrival=cfg.arrival, request_rate=cfg.request_rate,
                   max_concurrency=cfg.max_concurrency if cfg.max_concurrency else math.nan,
                   protocol=protocol, num_prompts=len(rows))
    if not summary["tpot_itl_applicable"]:
        meta["notes"].append("TPOT/ITL not applicable: no request produced more than one token")
    return ServingResult(requests=requests_df, summary=pd.DataFrame([summary]), meta=meta)
