"""The serving load generator (SGLang's ``bench_serving``, trimmed to what the gate needs).

One event loop (uvloop when installed) and one ``protocol.StreamingClient`` (keep-alive
HTTP/1.1 connections, responses parsed by httptools) send every request as a stream. Body
bytes are handled in the socket callback: SSE events are split at the bytes level, SGLang
chunks are not decoded (only their ``completion_tokens``; the last one in full), OpenAI
chunks with orjson; per chunk only an arrival time and a cumulative count are kept, and
the latencies are computed once per request with numpy. Output tokens come from the
server's counters (native ``meta_info.completion_tokens``, OpenAI ``usage``), never from
tokenizing chunks. A load generator that burns CPU per chunk measures itself: see
``benchmarks/loadgen_cost.py`` (issue 7).

The counters are checked before they feed TPOT and throughput, by the rules in
``protocol``'s docstring: a count above the request's output length (``max_new_tokens`` /
``max_tokens``), a native count that disagrees with the ``output_ids`` streamed, or an OpenAI
final ``usage`` that contradicts its per-chunk ``usage`` fails the request (``error_kind``
``protocol``), so the gate's "no failed requests" check sees it. A native stream's ids are
read per chunk only until it shows it is not incremental (by its second chunk for SGLang's
default cumulative ids); then only its last chunk's are.

Each request has a deadline of ``request_timeout_s`` from sending it to its last byte
(``asyncio.timeout`` around the whole exchange, not per read: a server dripping a byte at a
time still ends there).

Arrivals follow a schedule computed up front from a seeded generator: ``poisson``
(exponential gaps at ``request_rate``), ``constant`` (``1/request_rate`` gaps) or
``all-at-once`` (``request_rate=inf`` means all at once for any arrival kind). A dispatcher
thread releases each request to the loop at its scheduled time (sub-millisecond, unlike the
loop's 1 ms timers), so a slow request never delays the next send. The client's own health
is measured: the *dispatch lag* (release minus scheduled time; a run whose p99 exceeds
``max_dispatch_lag_p99_ms`` is flagged ``client_fell_behind``) and, for Poisson arrivals, a KS
test of the released gaps (``arrival_fit_rejected`` below ``stats.ARRIVAL_KS_ALPHA``);
``client_valid`` is False when either failed, and the gate must not trust such a run.
Waiting for a ``max_concurrency`` slot is intended back-pressure, recorded separately as
``queue_wait_ms``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import math
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import orjson
import pandas as pd
import requests
from tqdm import tqdm

from servegate.bench import protocol as proto
from servegate.bench.datasets import DatasetRow, load_sharegpt, sample_random_requests
from servegate.bench.stats import ARRIVAL_KS_ALPHA, arrival_ks_pvalue, client_validity, summarize_serving
from servegate.config import ServingConfig
from servegate.engines.base import Engine
from servegate.errors import InfraError, InsufficientDataError, ServerUnreachableError, StageError
from servegate.http import make_session
from servegate.tables import REQUEST_COLUMNS

try:  # uvloop roughly halves the event loop's cost per streamed chunk; optional
    import uvloop
except ImportError:  # pragma: no cover - depends on the environment
    uvloop = None

__all__ = ["ServingResult", "arrival_schedule", "build_requests", "run_serving"]

# The arrival gaps get their own random stream, so that they are not the same bits the
# dataset drew its prompts from with the same seed.
_ARRIVAL_STREAM: Final = 0xA7
# proto.native_completion_tokens, inlined in the per-chunk path.
_COMPLETION_KEY: Final = b'"completion_tokens":'
_COMPLETION_KEY_LEN: Final = len(_COMPLETION_KEY)
_INT_AFTER_KEY: Final = re.compile(rb"\s*(\d+)")
# An OpenAI chunk with exactly one unfinished choice (compact JSON, as vLLM and SGLang send).
# Neither key can occur inside a JSON string (its quotes would be escaped).
_OPENAI_TOKEN_CHUNK: Final = b'"finish_reason":null'
_FINISH_KEY: Final = b'"finish_reason"'


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
    itls_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    prompt_tokens: int | None = None
    output_tokens: int = 0
    success: bool = False
    error: str | None = None
    error_kind: str | None = None
    """connection | timeout | http | stream | protocol."""


class _Sink:
    """Per-request stream state: fed body bytes straight from the socket callback.

    Per token-bearing chunk it keeps only when its bytes arrived and the cumulative count
    after it; latencies are computed once at the end, not per chunk.
    """

    __slots__ = ("native", "out", "decoder", "times", "counts", "count", "usage_total", "last_payload",
                 "end_ts", "done", "ids", "chunk_usage")

    def __init__(self, native: bool, out: _Outcome) -> None:
        self.native = native
        self.out = out
        self.decoder = proto.SSEDecoder()
        self.times: list[float] = []
        self.counts: list[int] = []
        self.count = 0
        self.usage_total: int | None = None
        """OpenAI: the final ``usage`` (include_usage summary or finish-only chunk)."""
        self.chunk_usage = False
        """OpenAI: whether token chunks carried a cumulative ``usage`` (continuous_usage_stats)."""
        self.ids = proto.NativeCountCheck()
        self.last_payload = b""
        self.end_ts = math.nan
        """When the last byte that mattered arrived: the [DONE] event, else the last body bytes."""
        self.done = False

    def feed(self, data: bytes, ts: float) -> bool:
        return self._take(self.decoder.feed(data), ts)

    def close(self) -> None:
        """Take an event the server ended without its blank line."""
        if not self.done:
            self._take(self.decoder.close(), self.end_ts)

    def _take(self, payloads: list[bytes], ts: float) -> bool:
        # The hot path of the load generator: runs once per streamed chunk, in the socket
        # callback. Keep it to a few bytes operations (native) or one orjson.loads (OpenAI).
        count = self.count
        self.end_ts = ts
        for payload in payloads:
            if payload == b"[DONE]":
                self.done = True
                break
            if self.native:
                k = payload.rfind(_COMPLETION_KEY)
                m = _INT_AFTER_KEY.match(payload, k + _COMPLETION_KEY_LEN) if k >= 0 else None
                new_count = int(m.group(1)) if m else _native_slow(payload, count)
                if self.ids.wants_ids:
                    self.ids.chunk(new_count, proto.native_output_id_count(payload))
                self.last_payload = payload
            elif _OPENAI_TOKEN_CHUNK in payload and payload.count(_FINISH_KEY) == 1:
                # One choice, not finished: a token chunk; its count is the cumulative usage
                # when the server sends one, else one more. Read without decoding the chunk.
                k = payload.rfind(_COMPLETION_KEY)
                m = _INT_AFTER_KEY.match(payload, k + _COMPLETION_KEY_LEN) if k >= 0 else None
                if m:
                    new_count = int(m.group(1))
                    self.chunk_usage = True
                else:
                    new_count = count + 1
                self.last_payload = payload
            else:
                new_count = self._openai(payload, count)
            if new_count > count:
                self.times.append(ts)
                self.counts.append(new_count)
                count = new_count
        self.count = count
        return self.done

    def _openai(self, payload: bytes, count: int) -> int:
        """Cumulative output tokens after one ``/v1/completions`` chunk.

        The include_usage summary chunk (no choices) and a finish-only chunk carry no token;
        their ``usage`` is the request's final count. Anything but one choice (an error chunk,
        a batch) goes through ``protocol.openai_events``, which raises on an error.
        """
        try:
            data = orjson.loads(payload)
            usage = data.get("usage")
            completion = None
            if usage:
                completion = usage.get("completion_tokens")
                prompt = usage.get("prompt_tokens")
                if prompt is not None:
                    self.out.prompt_tokens = int(prompt)
                if completion is not None:
                    completion = int(completion)
            choices = data.get("choices")
            if choices and len(choices) == 1:
                ch = choices[0]
                has_token = ch.get("text") or ch.get("finish_reason") is None
            else:
                has_token = bool(proto.openai_events(data))
        except orjson.JSONDecodeError:
            proto.parse_sse_payload(payload)  # raises StageError naming the chunk
            raise AssertionError("unreachable") from None  # pragma: no cover
        except (AttributeError, TypeError, KeyError, ValueError) as exc:
            raise StageError(f"malformed /v1/completions stream chunk ({exc}): {payload[:200]!r}") from exc
        if not has_token:
            if completion is not None:
                self.usage_total = completion
            return count
        if completion is None:
            return count + 1
        self.chunk_usage = True
        return completion

    def count_error(self, max_tokens: int) -> str | None:
        """Why the server's token count cannot be trusted (see the module docstring), or None."""
        try:
            if self.native:
                last_ids = proto.native_output_id_count(self.last_payload) if self.last_payload else None
                self.ids.finish(self.count, last_ids)
                reported = self.count
            else:
                reported = self.usage_total if self.usage_total is not None else self.count
                if self.usage_total is not None and self.chunk_usage and self.usage_total != self.count:
                    return (f"the server's final usage says {self.usage_total} completion tokens but its "
                            f"per-chunk usage reached {self.count}: it contradicts itself, so TPOT and "
                            f"throughput from its counts would be false — the request is failed")
            proto.check_count_within(reported, max_tokens, f"a request of max tokens {max_tokens}")
        except StageError as exc:
            return str(exc)
        return None


def _native_slow(payload: bytes, count: int) -> int:
    data = proto.parse_sse_payload(payload)
    if data is proto.SSE_DONE:
        return count
    ev = proto.native_event(data)  # type: ignore[arg-type]  # raises StageError on an error chunk
    return ev.completion_tokens if ev.completion_tokens is not None else count + 1


async def _stream_one(client: proto.StreamingClient, request: bytes, protocol: str, timeout_s: float,
                      request_id: int, max_tokens: int) -> _Outcome:
    out = _Outcome()
    native = protocol == "native"
    sink = _Sink(native, out)
    st = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            status, error_body, _ = await client.post_stream(request, sink)
        if status != 200:
            text = error_body.decode("utf-8", "replace")
            out.error, out.error_kind = f"HTTP {status}: {text[:500]}", "http"
            return out
        sink.close()
        saw_done = sink.done
        if sink.last_payload and (native or out.prompt_tokens is None):
            # Only the last token chunk is decoded in full, for the prompt length (native
            # meta_info; OpenAI usage when no include_usage summary chunk gave it).
            last = proto.parse_sse_payload(sink.last_payload)
            if last is not proto.SSE_DONE:
                out.prompt_tokens = (proto.native_event(last).prompt_tokens if native  # type: ignore[arg-type]
                                     else proto.openai_usage(last)[0])  # type: ignore[arg-type]
    except TimeoutError:
        out.error = (f"request {request_id} did not complete within its deadline of {timeout_s:g} s (from "
                     f"sending it to its last byte): the server stalled or is sending too slowly — read the "
                     f"worker log; raise serving.request_timeout_s if the server is only slow")
        out.error_kind = "timeout"
        return out
    except ServerUnreachableError as exc:
        out.error, out.error_kind = str(exc), "connection"
        return out
    except StageError as exc:
        out.error, out.error_kind = str(exc), "protocol"
        return out
    out.latency_s = (sink.end_ts if not math.isnan(sink.end_ts) else time.perf_counter()) - st
    times, counts, count = sink.times, sink.counts, sink.count
    if times:
        out.ttft_s = times[0] - st
    if len(times) > 1:
        # Several tokens in one chunk (speculative decoding, stream_interval>1): spread the
        # gap over them, as SGLang's bench_serving does.
        n_new = np.diff(np.asarray(counts))
        out.itls_s = np.repeat(np.diff(np.asarray(times)) / n_new, n_new)
    out.output_tokens = int(sink.usage_total) if sink.usage_total is not None else count
    if not saw_done:
        out.error, out.error_kind = f"stream ended before [DONE] after {count} tokens", "stream"
    elif count == 0:
        out.error, out.error_kind = "stream finished without any output token", "stream"
    elif (lie := sink.count_error(max_tokens)) is not None:
        out.error, out.error_kind = lie, "protocol"
    else:
        out.success = True
    return out


def _body(protocol: str, model: str | None, row: DatasetRow) -> bytes:
    if protocol == "native":
        return orjson.dumps(proto.native_generate_body(row.prompt, row.output_len, stream=True))
    return orjson.dumps(proto.openai_completions_body(model or "", row.prompt, row.output_len, stream=True))


async def _run_load(rows: list[DatasetRow], schedule: np.ndarray, base_url: str, protocol: str,
                    model: str | None, cfg: ServingConfig, api_key: str | None) -> tuple[list[dict[str, Any]], float]:
    path = proto.GENERATE_PATH if protocol == "native" else proto.COMPLETIONS_PATH
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    records: list[dict[str, Any]] = [{} for _ in rows]
    async with proto.StreamingClient(base_url, proto.auth_headers(api_key)) as client:
        # Whole HTTP requests, serialized before the clock starts.
        requests_bytes = [client.request_bytes(path, _body(protocol, model, r)) for r in rows]
        with tqdm(total=len(rows), desc="serving", unit="req", file=sys.stderr,
                  disable=not cfg.progress) as pbar:

            async def one(i: int, dispatched: float) -> None:
                if semaphore is None:
                    sent = time.perf_counter()
                    outcome = await _stream_one(client, requests_bytes[i], protocol, cfg.request_timeout_s, i,
                                                  rows[i].output_len)
                else:
                    async with semaphore:
                        sent = time.perf_counter()
                        outcome = await _stream_one(client, requests_bytes[i], protocol, cfg.request_timeout_s, i,
                                                  rows[i].output_len)
                finished = time.perf_counter()
                records[i] = _record(i, rows[i], float(schedule[i]), dispatched - t0, sent - t0,
                                     finished - t0, outcome)
                pbar.update(1)

            # A dispatcher thread walks the schedule and hands each request to the loop when
            # it is due. Event-loop timers have 1 ms resolution (uvloop's fire up to ~1 ms
            # early, asyncio's up to ~1 ms late) and a late timer sends every request due in
            # the meantime as one burst, so the sub-millisecond gaps of a Poisson process
            # vanish and the arrival fit is rejected; a thread's sleep is precise to ~0.1 ms
            # and costs nothing while it waits (no spinning next to the engine).
            loop = asyncio.get_running_loop()
            tasks: list[asyncio.Task[None]] = []
            all_sent = loop.create_future()
            stop = threading.Event()
            plan = schedule.tolist()

            def start(i: int) -> None:
                tasks.append(loop.create_task(one(i, time.perf_counter())))
                if len(tasks) == len(plan) and not all_sent.done():
                    all_sent.set_result(None)

            def dispatch() -> None:
                for i, at in enumerate(plan):
                    delay = t0 + at - time.perf_counter()
                    if delay > 0 and stop.wait(delay):
                        return
                    try:
                        loop.call_soon_threadsafe(start, i)
                    except RuntimeError:  # the loop closed: the run was cancelled or failed
                        return

            t0 = time.perf_counter()
            if plan and plan[-1] == 0.0:
                for i in range(len(plan)):  # all at once: no thread needed
                    start(i)
            else:
                threading.Thread(target=dispatch, name="serving-dispatch", daemon=True).start()
            try:
                if plan:
                    await all_sent
                await asyncio.gather(*tasks)
            finally:
                stop.set()
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
        "itls_ms": (o.itls_s * 1000.0).tolist() if o.success else [],
        "finished_s": finished,
        "success": o.success,
        "error": o.error,
        "error_kind": o.error_kind,
    }


def _new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def _run_coroutine(coro: Any) -> Any:
    """Run ``coro`` on a fresh event loop (uvloop when installed), also from a thread that
    already runs an event loop (e.g. a notebook)."""

    def run() -> Any:
        # A signal handler's exception (Prefect's TerminationSignal on SIGTERM, KeyboardInterrupt)
        # raised while the loop runs a callback is caught by the loop and logged, and the load
        # went on to a verdict of pass. Such an exception (a BaseException that is not an
        # Exception) now stops the load and is raised again here.
        interrupted: list[BaseException] = []
        main: asyncio.Task | None = None

        async def guarded() -> Any:
            nonlocal main
            main = asyncio.current_task()
            return await coro

        def on_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if exc is not None and not isinstance(exc, Exception):
                interrupted.append(exc)
                if main is not None:
                    main.cancel()
                return
            loop.default_exception_handler(context)

        with asyncio.Runner(loop_factory=_new_event_loop) as runner:
            runner.get_loop().set_exception_handler(on_error)
            try:
                result = runner.run(guarded())
            except asyncio.CancelledError:
                if interrupted:
                    raise interrupted[0] from None
                raise
            if interrupted:
                raise interrupted[0]
            return result

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


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
        http = session or make_session(api_key)
        try:
            model = proto.fetch_model_name(http, base_url, api_key, timeout_s=min(cfg.request_timeout_s, 30.0),
                                           setting="serving.request_timeout_s")
        finally:
            if session is None:
                http.close()
    meta: dict[str, Any] = {
        "dataset": cfg.dataset, "dataset_path": cfg.dataset_path, "num_prompts": len(rows),
        "arrival": cfg.arrival, "request_rate": cfg.request_rate, "max_concurrency": cfg.max_concurrency,
        "protocol": protocol, "seed": cfg.seed, "model": model, "notes": [],
        "event_loop": "uvloop" if uvloop is not None else "asyncio",
    }
    # A full garbage collection walks every object the process holds (pandas, scipy, torch
    # when in-process: hundreds of thousands) and stalls the event loop for tens of ms, which
    # shows as dispatch lag and bursty arrivals. Freeze what exists into the permanent
    # generation and pause the collector for the run; the run itself makes few cycles.
    gc_was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        records, _ = _run_coroutine(_run_load(rows, schedule, base_url, protocol, model, cfg, api_key))
    finally:
        gc.unfreeze()
        if gc_was_enabled:
            gc.enable()
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
    summary["scheduled_arrival_ks_pvalue"] = math.nan
    if cfg.arrival == "poisson" and math.isfinite(cfg.request_rate):
        try:
            summary["arrival_ks_pvalue"] = arrival_ks_pvalue(requests_df["dispatched_s"].to_numpy(),
                                                             cfg.request_rate)
            # The seeded plan itself, so that a rejection can be told apart from a client fault.
            summary["scheduled_arrival_ks_pvalue"] = arrival_ks_pvalue(schedule, cfg.request_rate)
        except InsufficientDataError as exc:
            meta["notes"].append(f"arrival KS test not run: {exc}")
    summary.update(client_validity(summary["client_fell_behind"], summary["arrival_ks_pvalue"]))
    if not summary["client_valid"]:
        meta["notes"].append(
            f"client not valid: dispatch lag p99 {summary['dispatch_lag_p99_ms']:.2f} ms "
            f"(limit {cfg.max_dispatch_lag_p99_ms} ms), arrival KS p-value {summary['arrival_ks_pvalue']:.3g} "
            f"(rejected below {ARRIVAL_KS_ALPHA}); the load was not the one asked for")
    summary.update(arrival=cfg.arrival, request_rate=cfg.request_rate,
                   max_concurrency=cfg.max_concurrency if cfg.max_concurrency else math.nan,
                   protocol=protocol, num_prompts=len(rows))
    if not summary["tpot_itl_applicable"]:
        meta["notes"].append("TPOT/ITL not applicable: no request produced more than one token")
    return ServingResult(requests=requests_df, summary=pd.DataFrame([summary]), meta=meta)
