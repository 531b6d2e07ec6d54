"""A real local HTTP server that speaks the SGLang-native and OpenAI generation protocols.

It does no inference: it "generates" deterministic tokens on a clock (a prefill delay, then
one decode step per ``per_token_delay_s``, all prompts of a batched request stepping
together as in a batched engine), so the bench stages can be tested against real sockets,
real SSE streams and real timing. It records what it saw (peak concurrent requests, arrival
times) and exposes ``/get_server_info`` and a configurable ``/metrics`` page (NaN gauges,
several ``tp_rank`` label sets, 404, a malformed page).

Misbehaviours, for the gate's own fault tests (issue 11):

- ``api_key``: every route but ``/health*`` and ``/metrics`` answers 401 without
  ``Authorization: Bearer <key>``, as SGLang, vLLM and the embedded worker do;
- ``claim_factor``: lying token counts — native ``meta_info.completion_tokens`` and OpenAI
  ``usage.completion_tokens`` (per chunk and final) are that many times what was streamed
  (with ``stop_after_tokens``, a lie that stays under what the request asked for);
- ``drip_routes``: those paths answer 200 and then send one byte every ``drip_interval_s``,
  forever (a stalled server that never trips a per-read timeout);
- ``hang_routes``: those paths never answer at all;
- ``error_burst`` / ``generate_status`` / ``error_body``: server errors (a burst of 503s, every
  request failing, an HTML error page);
- ``garbage_stream``: streamed chunks that are not JSON; ``cut_stream_after_tokens``: streams that
  stop without ``[DONE]``; ``model``: any served model name (HTML included).

Run it in a thread: ``with SimServer(SimState(...)) as sim: sim.base_url``.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


MetricSamples = dict[str, list[tuple[dict[str, str], float]]]
"""Prometheus metric name -> [(labels, value), ...]; one entry per label set (rank)."""


@dataclass
class SimState:
    """What the simulated server does; tests may change fields while it runs."""

    prefill_delay_s: float = 0.01
    per_token_delay_s: float = 0.004
    token_capacity: int = 100_000
    """Per data-parallel rank (``internal_states[i].memory_usage.token_capacity``)."""
    max_running_requests: int = 256
    """``effective_max_running_requests_per_dp``."""
    dp_size: int = 1
    model: str = "sim-model"
    api_key: str | None = None
    """When set, every route but /health* and /metrics requires ``Authorization: Bearer <key>``."""
    claim_factor: int = 1
    """Reported completion tokens = this times the tokens actually streamed (1: honest)."""
    stop_after_tokens: int | None = None
    """When set, generation ends after this many tokens whatever was asked (as at an EOS)."""
    drip_routes: set[str] = field(default_factory=set)
    """Paths that answer 200, then one byte every ``drip_interval_s`` forever."""
    drip_interval_s: float = 1.0
    drips: int = 0
    """Drip responses started (read by tests)."""
    generate_status: int | None = None
    """When set, every generation request answers this HTTP status with an error body."""
    error_burst: tuple[int, int] | None = None
    """``(start, count)``: generation requests number start .. start+count-1 (0-based) answer 503, a
    burst of server errors in the middle of a run; the others serve."""
    generations: int = 0
    """Generation requests received (read by tests)."""
    error_body: str | None = None
    """Body of the error answers (default a JSON error); e.g. an HTML page a proxy would send."""
    garbage_stream: bool = False
    """Streamed chunks are ``data: <html>...`` lines, not JSON (a proxy's error page mid-stream)."""
    hang_routes: set[str] = field(default_factory=set)
    """Paths that never answer at all: not a status line, not a byte."""
    cut_stream_after_tokens: int | None = None
    """When set, streams stop (no [DONE]) after this many tokens: a worker dying mid-stream."""
    openai_continuous_usage: bool = True
    metrics_status: int = 200
    metrics_malformed: bool = False
    metrics: MetricSamples | Callable[[int], MetricSamples] = field(default_factory=dict)
    """Gauges to expose, or a function of the scrape number (0, 1, ...) returning them."""

    # What the server saw (read by tests).
    active: int = 0
    peak_active: int = 0
    arrivals: list[float] = field(default_factory=list)
    """time.perf_counter() at each generation request's arrival."""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    scrapes: int = 0

    def generated(self, asked: int) -> int:
        return asked if self.stop_after_tokens is None else min(asked, self.stop_after_tokens)

    def _enter(self) -> None:
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        self.arrivals.append(time.perf_counter())


def _render_metrics(samples: MetricSamples) -> str:
    lines = []
    for name, entries in samples.items():
        lines.append(f"# HELP {name} simulated gauge")
        lines.append(f"# TYPE {name} gauge")
        for labels, value in entries:
            lbl = ",".join(f'{k}="{v}"' for k, v in labels.items())
            text = "NaN" if math.isnan(value) else repr(float(value))
            lines.append(f"{name}{{{lbl}}} {text}" if lbl else f"{name} {text}")
    return "\n".join(lines) + "\n"


def _token(index: int, step: int) -> int:
    return 1000 + (index * 31 + step * 7) % 5000


def _batch_prompts(body: dict[str, Any], key_text: str, key_ids: str) -> tuple[list[int], bool]:
    """Prompt lengths (in simulated tokens) and whether the request is a batch."""
    if key_ids in body and body[key_ids] is not None:
        ids = body[key_ids]
        if isinstance(ids, str):  # before ids[0]: a string's first item is a string too
            return [max(1, len(ids.split()))], False
        if ids and isinstance(ids[0], list):
            return [len(x) for x in ids], True
        if ids and isinstance(ids[0], str):
            return [max(1, len(x.split())) for x in ids], True
        return [len(ids)], False
    text = body.get(key_text)
    if isinstance(text, list):
        return [max(1, len(t.split())) for t in text], True
    return [max(1, len(str(text or "").split()))], False


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _garbage(_obj: Any) -> bytes:
    return b"data: <html><body>502 Bad Gateway</body></html>\n\n"


_GENERATION_ROUTES = {"/generate", "/v1/completions", "/v1/models"}


def make_app(state: SimState) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def require_api_key(request: Request, call_next: Callable[[Request], Any]) -> Response:
        # As SGLang's and the embedded worker's middleware: health probes and metrics stay open.
        path = request.url.path
        if (state.api_key and not path.startswith("/health") and not path.startswith("/metrics")
                and request.headers.get("authorization") != f"Bearer {state.api_key}"):
            return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)
        # Control routes (health, flush, server info) drip here; generation routes call drip()
        # themselves, after reading the body, so that what they were asked is recorded.
        if path in state.drip_routes and path not in _GENERATION_ROUTES:
            return drip(request)
        if path in state.hang_routes:
            await asyncio.sleep(3600)
        return await call_next(request)

    def drip(request: Request, byte: bytes = b" ") -> Response | None:
        """A 200 whose body never ends: one ``byte`` (JSON or SSE whitespace) per interval."""
        if request.url.path not in state.drip_routes:
            return None
        state.drips += 1

        async def forever():
            while True:
                yield byte
                await asyncio.sleep(state.drip_interval_s)

        return StreamingResponse(forever(), media_type="text/event-stream")

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (resp := drip(request)) is not None:
            return resp
        return {"object": "list", "data": [{"id": state.model, "object": "model"}]}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        rank = {
            "memory_usage": {"weight": 0.3, "kvcache": 1.0, "token_capacity": state.token_capacity},
            "effective_max_running_requests_per_dp": state.max_running_requests,
            "last_gen_throughput": 0.0,
        }
        return {
            "version": "sim",
            "dp_size": state.dp_size,
            "max_total_num_tokens": state.token_capacity,
            "max_running_requests": state.max_running_requests * state.dp_size,
            "internal_states": [dict(rank) for _ in range(state.dp_size)],
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if (resp := drip(request, b"\n")) is not None:
            return resp
        n = state.scrapes
        state.scrapes += 1
        if state.metrics_status != 200:
            return PlainTextResponse("not found", status_code=state.metrics_status)
        if state.metrics_malformed:
            return PlainTextResponse('sglang:fwd_occupancy{tp_rank="0" 12 oops\n}}}\n')
        samples = state.metrics(n) if callable(state.metrics) else state.metrics
        return PlainTextResponse(_render_metrics(samples), media_type="text/plain; version=0.0.4")

    async def run_steps(prompt_lens: list[int], max_new: int, emit: Callable[[int, int, bool], list[bytes]],
                        done: Callable[[], list[bytes]]):
        """Yield SSE bytes: step 1 after the prefill delay, then one step per decode delay."""
        released = False
        state._enter()
        try:
            await asyncio.sleep(state.prefill_delay_s)
            for step in range(1, max_new + 1):
                if step > 1:
                    await asyncio.sleep(state.per_token_delay_s)
                if state.cut_stream_after_tokens is not None and step > state.cut_stream_after_tokens:
                    return
                for idx in range(len(prompt_lens)):
                    for chunk in emit(idx, step, step == max_new):
                        yield chunk
            # Leave the in-flight count before the final bytes reach the client, so a client
            # that starts its next request on [DONE] is never counted twice.
            state.active -= 1
            released = True
            for chunk in done():
                yield chunk
        finally:
            if not released:
                state.active -= 1

    async def run_blocking(max_new: int) -> None:
        state._enter()
        try:
            await asyncio.sleep(state.prefill_delay_s + (max_new - 1) * state.per_token_delay_s)
        finally:
            state.active -= 1

    def error_status() -> Response | None:
        status = state.generate_status
        n = state.generations
        state.generations += 1
        if status is None and state.error_burst is not None and 0 <= n - state.error_burst[0] < state.error_burst[1]:
            status = 503
        if status is None:
            return None
        if state.error_body is not None:
            return Response(state.error_body, status_code=status, media_type="text/html")
        return JSONResponse({"error": {"message": f"simulated failure {status}"}}, status_code=status)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state.bodies.append(body)
        if (resp := error_status()) is not None:
            return resp
        if (resp := drip(request, b"\n" if body.get("stream") else b" ")) is not None:
            return resp
        prompt_lens, is_batch = _batch_prompts(body, "text", "input_ids")
        sp = body.get("sampling_params") or {}
        max_new = state.generated(int(sp.get("max_new_tokens", 16)))
        start = time.perf_counter()

        def chunk(idx: int, step: int, last: bool) -> dict[str, Any]:
            out = {
                "text": "".join(f" t{_token(idx, s)}" for s in range(1, step + 1)),
                "output_ids": [_token(idx, s) for s in range(1, step + 1)],
                "meta_info": {
                    "id": f"req-{len(state.bodies)}-{idx}",
                    "finish_reason": {"type": "length", "length": max_new} if last else None,
                    "prompt_tokens": prompt_lens[idx],
                    "completion_tokens": step * state.claim_factor,
                    "cached_tokens": 0,
                    "e2e_latency": time.perf_counter() - start,
                },
            }
            if is_batch:
                out["index"] = idx
            return out

        if body.get("stream"):
            sse = _garbage if state.garbage_stream else _sse
            gen = run_steps(prompt_lens, max_new, lambda i, s, last: [sse(chunk(i, s, last))],
                            lambda: [b"data: [DONE]\n\n"])
            return StreamingResponse(gen, media_type="text/event-stream")
        await run_blocking(max_new)
        results = [chunk(i, max_new, True) for i in range(len(prompt_lens))]
        if body.get("return_logprob"):  # what the quality stage reads: [logprob, token_id, text] triples
            for res in results:
                res["meta_info"]["output_token_logprobs"] = [[-0.5, t, None] for t in res["output_ids"]]
        return JSONResponse(results if is_batch else results[0])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state.bodies.append(body)
        if (resp := error_status()) is not None:
            return resp
        if (resp := drip(request, b"\n" if body.get("stream") else b" ")) is not None:
            return resp
        prompt_lens, _ = _batch_prompts({"prompt": body.get("prompt")}, "text", "prompt")
        max_new = state.generated(int(body.get("max_tokens", 16)))
        created = int(time.time())
        opts = body.get("stream_options") or {}
        continuous = bool(opts.get("continuous_usage_stats")) and state.openai_continuous_usage
        total_prompt = sum(prompt_lens)

        def chunk(idx: int, step: int, last: bool) -> dict[str, Any]:
            out: dict[str, Any] = {
                "id": "cmpl-sim", "object": "text_completion", "created": created, "model": state.model,
                "choices": [{"index": idx, "text": f" t{_token(idx, step)}", "logprobs": None,
                             "finish_reason": "length" if last else None}],
            }
            if continuous and len(prompt_lens) == 1:
                claimed = step * state.claim_factor
                out["usage"] = {"prompt_tokens": total_prompt, "completion_tokens": claimed,
                                "total_tokens": total_prompt + claimed}
            return out

        def done() -> list[bytes]:
            tail = []
            if opts.get("include_usage"):
                n_out = max_new * len(prompt_lens) * state.claim_factor
                tail.append(_sse({"id": "cmpl-sim", "object": "text_completion", "created": created,
                                  "model": state.model, "choices": [],
                                  "usage": {"prompt_tokens": total_prompt, "completion_tokens": n_out,
                                            "total_tokens": total_prompt + n_out}}))
            tail.append(b"data: [DONE]\n\n")
            return tail

        if body.get("stream"):
            sse = _garbage if state.garbage_stream else _sse
            gen = run_steps(prompt_lens, max_new, lambda i, s, last: [sse(chunk(i, s, last))], done)
            return StreamingResponse(gen, media_type="text/event-stream")
        await run_blocking(max_new)
        n_out = max_new * len(prompt_lens) * state.claim_factor
        return JSONResponse({
            "id": "cmpl-sim", "object": "text_completion", "created": created, "model": state.model,
            "choices": [{"index": i, "text": "".join(f" t{_token(i, s)}" for s in range(1, max_new + 1)),
                         "finish_reason": "length"} for i in range(len(prompt_lens))],
            "usage": {"prompt_tokens": total_prompt, "completion_tokens": n_out,
                      "total_tokens": total_prompt + n_out},
        })

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return PlainTextResponse("Cache flushed.")

    return app


class SimServer:
    """The simulated server on 127.0.0.1 in a background thread (uvicorn, a pre-bound free port)."""

    def __init__(self, state: SimState | None = None) -> None:
        self.state = state or SimState()
        # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on sockets whose proto says TCP;
        # without it Nagle + delayed ACKs hold each SSE chunk back ~40 ms on a kept-alive
        # connection, and every timing measured against the sim would be wrong.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(make_app(self.state), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"sim-server-{self.port}", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "SimServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("sim server did not start within 10 s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving: close the listener and drop open connections (a worker going away)."""
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> "SimServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port() -> int:
    """A port nothing listens on (bound then released), for connection-refused tests."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
