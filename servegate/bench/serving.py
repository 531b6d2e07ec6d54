"""The serving load generator (SGLang's ``bench_serving``, trimmed to what the gate needs).

One event loop (uvloop when installed) and one ``http.StreamingClient`` (keep-alive
HTTP/1.1 connections, responses parsed by httptools) send every request as a stream. Body
bytes are handled in the socket callback by the protocol's ``TokenStream``
(``WireProtocol.token_stream``): SSE events are split at the bytes level, SGLang chunks are
not decoded (only their ``completion_tokens``; the last one in full), compact OpenAI token
chunks neither, other OpenAI chunks with orjson; per chunk only an arrival time and a
cumulative count are kept, and the latencies are computed once per request with numpy.
Output tokens come from the server's counters (native ``meta_info.completion_tokens``, OpenAI
``usage``), never from tokenizing chunks. A load generator that burns CPU per chunk measures itself: see
``benchmarks/loadgen_cost.py`` (issue 7).

The counters are checked before they feed TPOT and throughput (``TokenStream.count_error``,
by the rules in ``protocol``'s modules): a count above the request's output length
(``max_new_tokens`` / ``max_tokens``), a native count that disagrees with the ``output_ids`` streamed, or an OpenAI
final ``usage`` that contradicts its per-chunk ``usage`` fails the request (``error_kind``
``protocol``), so the gate's "no failed requests" check sees it. A native stream's ids are
read per chunk only until it shows it is not incremental (by its second chunk for SGLang's
default cumulative ids); then only its last chunk's are.

Each request has a deadline of ``request_timeout_s`` from sending it to its last byte
(``asyncio.timeout`` around the whole exchange, not per read: a server dripping a byte at a
time still ends there); its message is ``http.deadline_error``'s, like every other request's.

Arrivals follow a schedule computed up front from a seeded generator: ``poisson``
(exponential gaps at ``request_rate``), ``gamma`` (gamma gaps of shape ``burstiness`` and mean
``1/request_rate``, as SGLang's and vLLM's ``--burstiness``), ``constant`` (``1/request_rate`` gaps) or
``all-at-once`` (``request_rate=inf`` means all at once for any arrival kind); a trace dataset brings
its own schedule (its timestamps times ``trace_time_scale``), and arrival and rate are then unused. A dispatcher
thread releases each request to the loop at its scheduled time (sub-millisecond, unlike the
loop's 1 ms timers), so a slow request never delays the next send. The client's own health
is measured: the *dispatch lag* (release minus scheduled time; a run whose p99 exceeds
``max_dispatch_lag_p99_ms`` is flagged ``client_fell_behind``) and, for Poisson and gamma arrivals, a KS
test of the released gaps against their law (``arrival_fit_rejected`` below ``stats.ARRIVAL_KS_ALPHA``);
``client_valid`` is False when either failed, and the gate must not trust such a run.
Waiting for a ``max_concurrency`` slot is intended back-pressure, recorded separately as
``queue_wait_ms``.

Where the engine exposes them, the worker's own prompt-token and cached-token counters are scraped
from ``/metrics`` just before and just after the load (``occupancy.scrape_metrics``); their increases
give ``prompt_tokens_scraped``, ``cached_tokens`` and ``prefix_cache_hit_rate`` — the prefix cache's
share of the load's prompt tokens, the figure a shared-prefix workload is run for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import math
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
import orjson
import pandas as pd
import requests
from tqdm import tqdm

from servegate import console
from servegate.bench.datasets import (
    DatasetRow,
    as_text_prompts,
    load_jsonl_prompts,
    load_mooncake_trace,
    load_sharegpt,
    sample_random_requests,
    sample_shared_prefix_requests,
)
from servegate.bench.occupancy import scrape_metrics
from servegate.bench.protocol import WireProtocol, protocol_for
from servegate.bench.stats import ARRIVAL_KS_ALPHA, arrival_ks_pvalue, client_validity, summarize_serving
from servegate.config import ServingConfig
from servegate.engines.base import Engine
from servegate.errors import ConfigError, InfraError, InsufficientDataError, ServerUnreachableError, StageError
from servegate.http import StreamingClient, deadline_error, make_session
from servegate.tables import REQUEST_COLUMNS

try:  # uvloop roughly halves the event loop's cost per streamed chunk; optional
    import uvloop
except ImportError:  # pragma: no cover - depends on the environment
    uvloop = None

__all__ = ["ServingResult", "arrival_schedule", "build_requests", "prefix_cache_counters",
           "run_serving", "serve_until"]

# The arrival gaps get their own random stream, so that they are not the same bits the
# dataset drew its prompts from with the same seed.
_ARRIVAL_STREAM: Final = 0xA7
_REQUESTS_TABLE: Final = "serving_requests"



@dataclass
class ServingResult:
    """What the serving stage measured."""

    requests: pd.DataFrame
    """``serving_requests``: one row per request (see docs/contracts.md)."""
    summary: pd.DataFrame
    """``serving_summary``: one row."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The load as run: dataset, arrival, rate, concurrency, protocol, seed, notes."""


def arrival_schedule(n: int, arrival: str, rate: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """Send times (s from the start) of ``n`` requests; the first is sent at 0.

    Poisson gaps are ``exponential(1/rate)`` draws, as SGLang samples them; gamma gaps are
    ``gamma(shape=burstiness, scale=1/(rate*burstiness))`` draws, as vLLM's and SGLang's
    ``get_request`` (mean ``1/rate`` whatever the burstiness; shape 1 is the exponential). Both are
    seeded and drawn up front, so the schedule does not depend on the client's speed.
    """
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate) or arrival == "all-at-once":
        return np.zeros(n)
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM])
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    elif arrival == "gamma":
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    elif arrival == "constant":
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        raise StageError(f"unknown arrival {arrival!r}; choose poisson, gamma, constant or all-at-once")
    return np.concatenate([[0.0], np.cumsum(gaps)])


def build_requests(cfg: ServingConfig, tokenizer: Any | None = None, *, text_prompts: bool = False) -> list[DatasetRow]:
    """The requests of a run, by ``cfg.dataset`` (docs/workloads.md): seeded random token ids, a
    ShareGPT-format file, SGLang's generated shared-prefix groups (``gsp_num_groups *
    gsp_prompts_per_group`` requests; ``num_prompts`` is not used), the first ``num_prompts`` requests
    of a Mooncake trace (each with its ``send_at_s``, already scaled by ``trace_time_scale``), or the
    first ``num_prompts`` lines of a JSONL prompt file. ``tokenizer`` (the model's) encodes the text
    datasets; with ``text_prompts`` (a protocol that takes text only) every token-id prompt is decoded
    by it."""
    if cfg.dataset == "random":
        rows = sample_random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                                      cfg.random_range_ratio, cfg.seed)
    elif cfg.dataset == "sharegpt":
        rows = load_sharegpt(cfg.dataset_path or "", cfg.num_prompts, cfg.seed, cfg.random_output_len, tokenizer)
    elif cfg.dataset == "generated-shared-prefix":
        rows = sample_shared_prefix_requests(cfg.gsp_num_groups, cfg.gsp_prompts_per_group, cfg.gsp_system_prompt_len,
                                             cfg.gsp_question_len, cfg.gsp_output_len, cfg.seed)
    elif cfg.dataset == "trace":
        rows = [replace(r, send_at_s=r.send_at_s * cfg.trace_time_scale)
                for r in load_mooncake_trace(cfg.dataset_path or "", cfg.num_prompts, cfg.seed)]
    elif cfg.dataset == "jsonl":
        rows = load_jsonl_prompts(cfg.dataset_path or "", cfg.num_prompts, tokenizer, keep_text=text_prompts)
    else:
        raise ConfigError(f"unknown serving.dataset {cfg.dataset!r}; choose random, sharegpt, "
                          f"generated-shared-prefix, trace or jsonl")
    return as_text_prompts(rows, tokenizer) if text_prompts else rows


def _scrape_counters(http: requests.Session, base_url: str, engine: Engine, notes: list[str],
                     when: str) -> dict[str, float] | None:
    """The engine's prefix-cache counters (summed over label sets), or None with a note saying why not."""
    names = engine.prefix_cache_counters if engine.has_metrics else None
    if not names:
        return None
    try:
        page = scrape_metrics(http, base_url, engine)
    except InfraError as exc:
        notes.append(f"prefix-cache counters not scraped {when} the load: {exc}")
        return None
    missing = sorted({name for name in names.values() if name not in page})
    if missing:
        notes.append(f"prefix-cache counters not on {base_url}/metrics {when} the load: {', '.join(missing)}")
        return None
    return {key: float(np.nansum(page[name])) for key, name in names.items()}


def prefix_cache_counters(before: dict[str, float] | None, after: dict[str, float] | None,
                          notes: list[str]) -> dict[str, float]:
    """``prompt_tokens_scraped``, ``cached_tokens`` and ``prefix_cache_hit_rate`` over the load from two
    counter scrapes; NaN when either is missing, a counter went down (the worker restarted), or no
    token was queried."""
    out = {"prompt_tokens_scraped": math.nan, "cached_tokens": math.nan, "prefix_cache_hit_rate": math.nan}
    if before is None or after is None:
        return out
    delta = {key: after[key] - before[key] for key in after}
    if any(v < 0 for v in delta.values()):
        notes.append(f"prefix-cache counters went down during the load ({delta}): the worker restarted")
        return out
    out["prompt_tokens_scraped"] = delta["prompt"]
    out["cached_tokens"] = delta["cached"]
    out["prefix_cache_hit_rate"] = delta["cached"] / delta["queried"] if delta["queried"] > 0 else math.nan
    return out


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


async def _stream_one(client: StreamingClient, request: bytes, wire: WireProtocol, timeout_s: float,
                      request_id: int, max_tokens: int) -> _Outcome:
    out = _Outcome()
    stream = wire.token_stream()
    st = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            status, error_body, _ = await client.post_stream(request, stream)
        if status != 200:
            text = error_body.decode("utf-8", "replace")
            out.error, out.error_kind = f"HTTP {status}: {text[:500]}", "http"
            return out
        stream.close()
        out.prompt_tokens = stream.final_prompt_tokens()
    except TimeoutError:
        out.error = str(deadline_error(f"request {request_id}", timeout_s, time.perf_counter() - st,
                                       "serving.request_timeout_s"))
        out.error_kind = "timeout"
        return out
    except ServerUnreachableError as exc:
        out.error, out.error_kind = str(exc), "connection"
        return out
    except StageError as exc:
        out.error, out.error_kind = str(exc), "protocol"
        return out
    finally:
        if out.prompt_tokens is None:
            out.prompt_tokens = stream.prompt_tokens  # what a usage chunk said before the request failed
    out.latency_s = (stream.end_ts if not math.isnan(stream.end_ts) else time.perf_counter()) - st
    times, counts, count = stream.times, stream.counts, stream.count
    if times:
        out.ttft_s = times[0] - st
    if len(times) > 1:
        # Several tokens in one arrival (speculative decoding, stream_interval>1, or several events in
        # one read of a busy client): spread the gap over them, as SGLang's bench_serving does.
        n_new = np.diff(np.asarray(counts))
        out.itls_s = np.repeat(np.diff(np.asarray(times)) / n_new, n_new)
    out.output_tokens = stream.output_tokens
    if not stream.done:
        out.error, out.error_kind = f"stream ended before [DONE] after {count} tokens", "stream"
    elif count == 0:
        out.error, out.error_kind = "stream finished without any output token", "stream"
    elif (lie := stream.count_error(max_tokens)) is not None:
        out.error, out.error_kind = lie, "protocol"
    else:
        out.success = True
    return out


def _request_bytes(client: StreamingClient, wire: WireProtocol, model: str | None,
                   rows: list[DatasetRow]) -> list[bytes]:
    """Each row's whole streamed HTTP request, serialized once."""
    return [client.request_bytes(wire.path, orjson.dumps(wire.body(r.prompt, r.output_len, model=model, stream=True)))
            for r in rows]


async def _run_load(rows: list[DatasetRow], schedule: np.ndarray, base_url: str, wire: WireProtocol,
                    model: str | None, cfg: ServingConfig, api_key: str | None) -> tuple[list[dict[str, Any]], float]:
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    records: list[dict[str, Any]] = [{} for _ in rows]
    async with StreamingClient(base_url, api_key) as client:
        # Whole HTTP requests, serialized before the clock starts.
        requests_bytes = _request_bytes(client, wire, model, rows)
        with tqdm(total=len(rows), desc="serving", unit="req", file=sys.stderr,
                  disable=not cfg.progress) as pbar:

            finished_count = [0]

            async def one(i: int, dispatched: float) -> None:
                if semaphore is None:
                    sent = time.perf_counter()
                    outcome = await _stream_one(client, requests_bytes[i], wire, cfg.request_timeout_s, i,
                                                rows[i].output_len)
                else:
                    async with semaphore:
                        sent = time.perf_counter()
                        outcome = await _stream_one(client, requests_bytes[i], wire, cfg.request_timeout_s, i,
                                                rows[i].output_len)
                finished = time.perf_counter()
                records[i] = _record(i, rows[i], float(schedule[i]), dispatched - t0, sent - t0,
                                     finished - t0, outcome)
                pbar.update(1)
                finished_count[0] += 1
                console.progress(finished_count[0], len(rows))

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


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = True


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Freeze and pause the garbage collector while a load runs; loads that overlap (the paired
    stage's duet mode runs two, one per thread) share one pause, lifted when the last one ends."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.freeze()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0:
                gc.unfreeze()
                if _gc_was_enabled:
                    gc.enable()


def run_serving(base_url: str, engine: Engine, cfg: ServingConfig, api_key: str | None = None, *,
                tokenizer: Any | None = None, session: requests.Session | None = None,
                partial: dict[str, pd.DataFrame] | None = None) -> ServingResult:
    """Run the serving load and return per-request rows, the one-row summary and the run's meta.

    ``tokenizer`` (the model's) encodes ShareGPT and JSONL prompt files (without it they are sent as
    text; ``datasets.dataset_needs_tokenizer``) and, when the protocol takes text only
    (``needs_text_prompts``), decodes token-id prompts to text — all before the clock starts; such a
    protocol needs it for the token-id datasets (random, generated-shared-prefix, trace). A trace is
    sent on its own schedule and recorded with ``arrival="trace"`` and its mean offered rate as
    ``request_rate``. The prefix-cache counters are scraped around the load where the engine has
    them (``Engine.prefix_cache_counters``); a scrape that fails leaves them NaN with a note in
    ``meta["notes"]``, never fails the load. ``partial`` (when given) receives ``{"serving_requests": rows}``
    as soon as the load has run, so that the caller keeps them when the run then fails: when
    every request failed on a connection error the server is gone (``ServerUnreachableError``);
    when no request succeeded for another reason, ``InsufficientDataError``. A ``session`` given
    by the caller (used to ask an OpenAI server its model) must carry the API key.
    """
    base_url = base_url.rstrip("/")
    wire = protocol_for(engine, cfg.protocol)
    rows = build_requests(cfg, tokenizer, text_prompts=wire.needs_text_prompts)
    traced = cfg.dataset == "trace"
    if traced:
        schedule = np.array([r.send_at_s for r in rows], dtype=float)
        span = float(schedule[-1]) if len(schedule) else 0.0
        arrival, rate = "trace", ((len(rows) - 1) / span if span > 0 else math.inf)
    else:
        schedule = arrival_schedule(len(rows), cfg.arrival, cfg.request_rate, cfg.seed, cfg.burstiness)
        arrival, rate = cfg.arrival, cfg.request_rate
    notes: list[str] = []
    http = session or make_session(api_key)
    try:
        model = wire.served_model(http, base_url, limit_s=min(cfg.request_timeout_s, 30.0),
                                  setting="serving.request_timeout_s")
        counters_before = _scrape_counters(http, base_url, engine, notes, "before")
        meta: dict[str, Any] = {
            "dataset": cfg.dataset, "dataset_path": cfg.dataset_path, "num_prompts": len(rows),
            "arrival": arrival, "request_rate": rate, "max_concurrency": cfg.max_concurrency,
            "protocol": wire.name, "seed": cfg.seed, "model": model, "notes": notes,
            "event_loop": "uvloop" if uvloop is not None else "asyncio",
        }
        if cfg.arrival == "gamma" and not traced:
            meta["burstiness"] = cfg.burstiness
        if traced:
            meta["trace_time_scale"] = cfg.trace_time_scale
        # A full garbage collection walks every object the process holds (pandas, scipy, torch
        # when in-process: hundreds of thousands) and stalls the event loop for tens of ms, which
        # shows as dispatch lag and bursty arrivals. Freeze what exists into the permanent
        # generation and pause the collector for the run; the run itself makes few cycles.
        with _gc_paused():
            records, _ = _run_coroutine(_run_load(rows, schedule, base_url, wire, model, cfg, api_key))
        requests_df = pd.DataFrame(records, columns=REQUEST_COLUMNS)
        for col in ("input_tokens", "planned_input_tokens", "output_tokens", "planned_output_tokens"):
            requests_df[col] = requests_df[col].astype("Int64")
        requests_df["success"] = requests_df["success"].astype(bool)
        if partial is not None:
            partial[_REQUESTS_TABLE] = requests_df

        failed = requests_df[~requests_df["success"]]
        if len(failed) == len(requests_df) and (failed["error_kind"] == "connection").all():
            raise ServerUnreachableError(
                f"all {len(requests_df)} serving requests to {base_url} failed to connect "
                f"(first: {failed['error'].iloc[0]}); the server is gone — check the worker's log")
        counters_after = _scrape_counters(http, base_url, engine, notes, "after") if counters_before else None
    finally:
        if session is None:
            http.close()

    duration = float(requests_df["finished_s"].max())
    summary = summarize_serving(
        requests_df, duration, slo_ttft_ms=cfg.slo_ttft_ms, slo_tpot_ms=cfg.slo_tpot_ms,
        slo_e2e_ms=cfg.slo_e2e_ms, max_dispatch_lag_p99_ms=cfg.max_dispatch_lag_p99_ms)
    summary["connection_errors"] = int((failed["error_kind"] == "connection").sum())
    summary["arrival_ks_pvalue"] = math.nan
    summary["scheduled_arrival_ks_pvalue"] = math.nan
    if arrival in ("poisson", "gamma") and math.isfinite(rate):
        shape = cfg.burstiness if arrival == "gamma" else 1.0
        try:
            summary["arrival_ks_pvalue"] = arrival_ks_pvalue(requests_df["dispatched_s"].to_numpy(), rate, shape)
            # The seeded plan itself, so that a rejection can be told apart from a client fault.
            summary["scheduled_arrival_ks_pvalue"] = arrival_ks_pvalue(schedule, rate, shape)
        except InsufficientDataError as exc:
            notes.append(f"arrival KS test not run: {exc}")
    summary.update(client_validity(summary["client_fell_behind"], summary["arrival_ks_pvalue"]))
    if not summary["client_valid"]:
        notes.append(
            f"client not valid: dispatch lag p99 {summary['dispatch_lag_p99_ms']:.2f} ms "
            f"(limit {cfg.max_dispatch_lag_p99_ms} ms), arrival KS p-value {summary['arrival_ks_pvalue']:.3g} "
            f"(rejected below {ARRIVAL_KS_ALPHA}); the load was not the one asked for")
    summary.update(arrival=arrival, request_rate=rate,
                   max_concurrency=cfg.max_concurrency if cfg.max_concurrency else math.nan,
                   protocol=wire.name, num_prompts=len(rows), dataset=cfg.dataset,
                   burstiness=cfg.burstiness if arrival == "gamma" else math.nan,
                   **prefix_cache_counters(counters_before, counters_after, notes))
    if not summary["tpot_itl_applicable"]:
        notes.append("TPOT/ITL not applicable: no request produced more than one token")
    return ServingResult(requests=requests_df, summary=pd.DataFrame([summary]), meta=meta)


async def _keep_busy(base_url: str, wire: WireProtocol, model: str | None, cfg: ServingConfig,
                     api_key: str | None, tokenizer: Any | None, until: threading.Event, poll_s: float) -> int:
    served = 0
    async with StreamingClient(base_url, api_key) as client:
        for k in itertools.count(1):
            rows = build_requests(cfg.model_copy(update={"seed": cfg.seed + k}), tokenizer,
                                  text_prompts=wire.needs_text_prompts)
            tasks = [asyncio.create_task(_stream_one(client, request, wire, cfg.request_timeout_s, i, r.output_len))
                     for i, (r, request) in enumerate(zip(rows, _request_bytes(client, wire, model, rows)))]
            try:
                while tasks and not until.is_set():
                    done, _ = await asyncio.wait(tasks, timeout=poll_s)
                    for task in done:
                        tasks.remove(task)
                        outcome = task.result()
                        if not outcome.success:
                            raise StageError(f"a request keeping {base_url} busy failed: {outcome.error}")
                        served += 1
            finally:
                for task in tasks:  # what is in flight when ``until`` is set: its connection is dropped
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if until.is_set():
                return served
    raise AssertionError("unreachable")  # pragma: no cover


def serve_until(base_url: str, engine: Engine, cfg: ServingConfig, until: threading.Event, *,
                api_key: str | None = None, tokenizer: Any | None = None, poll_s: float = 0.005) -> int:
    """Keep the server busy with ``cfg``'s load until ``until`` is set, and measure nothing: its
    requests all at once, again and again (each time with the next seed: fresh prompts), the ones
    in flight when ``until`` is set cancelled (their connections dropped: the engine aborts them).
    Returns how many requests completed; a request that fails raises :class:`StageError` (a server
    that stopped serving is not keeping anything busy).

    The paired stage's duet runs this on the side whose block ended first, so that the other side's
    block shares the CPU to its end, as it did from its start."""
    base_url = base_url.rstrip("/")
    wire = protocol_for(engine, cfg.protocol)
    with make_session(api_key) as http:
        model = wire.served_model(http, base_url, limit_s=min(cfg.request_timeout_s, 30.0),
                                  setting="serving.request_timeout_s")
    return _run_coroutine(_keep_busy(base_url, wire, model, cfg, api_key, tokenizer, until, poll_s))
