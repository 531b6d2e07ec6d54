"""The embedded worker's HTTP app on FastAPI: the API-key check, SGLang's native routes, and
OpenAI's (``servegate.worker.openai_routes``) over one ``WorkerState``.

Native: ``POST /generate``, ``GET /health``, ``GET /health_generate``,
``GET /get_server_info`` (and ``/server_info``), ``GET|POST /flush_cache``, ``GET /metrics``, and
with ``--profiler-dir`` vLLM's ``POST /start_profile`` and ``POST /stop_profile``
(:mod:`servegate.worker.profiler`; 404 without the option, as vLLM without a profiler).
What the two surfaces share (readiness, fault injection, submitting requests, waiting for or
streaming their tokens) is ``servegate.worker.http_plumbing``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import threading
import time
from typing import Any

import orjson
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import PlainTextResponse, Response

from servegate.errors import ConfigError
from servegate.worker.http_plumbing import RequestPlumbing, WorkerState
from servegate.worker.metrics import CONTENT_TYPE
from servegate.worker.openai_routes import register_openai_routes
from servegate.worker.request import Request
from servegate.worker.sampling import SamplingParams
from servegate.worker.scheduler import Scheduler

__all__ = ["build_app", "authorized", "install_crash_fault"]

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 60.0
PROFILE_TIMEOUT_S = 300.0
"""Longest wait for the scheduler to start the profiler or write its trace (a step in progress ends first)."""
FLUSH_POLL_S = 0.05


def authorized(header: str | None, expected: bytes) -> bool:
    """The ``Authorization`` header equals ``expected`` (``b"Bearer KEY"``), compared in constant
    time: an early-exit ``!=`` tells a client, by timing, how many leading bytes of its guess match.

    Starlette decodes header bytes as latin-1; encoding back gives the bytes the client sent, so a
    non-ASCII header is compared (and refused) like any other instead of raising.
    """
    return hmac.compare_digest((header or "").encode("latin-1"), expected)


def build_app(state: WorkerState) -> FastAPI:
    """The FastAPI application over one ``WorkerState``: the native routes and the OpenAI ones."""
    app = FastAPI(title="servegate embedded worker", docs_url=None, redoc_url=None, openapi_url=None)
    plumbing = RequestPlumbing(state)

    if state.api_key:
        expected = f"Bearer {state.api_key}".encode()

        @app.middleware("http")
        async def _check_api_key(request: HttpRequest, call_next: Any) -> Any:
            # As SGLang: health probes and metrics stay open; everything else needs the key.
            path = request.url.path
            if request.method == "OPTIONS" or path.startswith("/health") or path.startswith("/metrics"):
                return await call_next(request)
            if not authorized(request.headers.get("authorization"), expected):
                return plumbing.json({"error": "Unauthorized"}, 401)
            return await call_next(request)

    # ------------------------------------------------------------------ native helpers
    def meta_of(req: Request, ids: list[int]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason if req.finished else None,
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": req.cached_tokens,
            "e2e_latency": req.e2e_latency(),
        }
        if req.spec_verify_ct is not None or (state.scheduler is not None and state.scheduler.speculative):
            meta["spec_verify_ct"] = req.spec_verify_ct or 0
        if req.return_logprob:
            def triples(items: list[tuple[Any, int]]) -> list[list[Any]]:
                return [[lp, tok, None] for lp, tok in items]

            meta["input_token_logprobs"] = triples(req.input_token_logprobs)
            meta["output_token_logprobs"] = triples(req.output_token_logprobs[:len(ids)])
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [None if t is None else triples(t) for t in req.input_top_logprobs]
                meta["output_top_logprobs"] = [triples(t) for t in req.output_top_logprobs[:len(ids)]]
        return meta

    def result_of(req: Request, index: int | None) -> dict[str, Any]:
        # One snapshot: the scheduler thread appends to output_ids while this chunk is built, and a
        # chunk whose text, ids and completion_tokens disagree reads as a lying server.
        ids = list(req.output_ids)
        out: dict[str, Any] = {"text": plumbing.text_of(req, ids), "output_ids": ids, "meta_info": meta_of(req, ids)}
        if index is not None:
            out["index"] = index
        return out

    # ------------------------------------------------------------------ native routes
    @app.get("/health")
    async def health() -> Response:
        if state.ready.is_set():
            return PlainTextResponse("", status_code=200)
        return PlainTextResponse("starting", status_code=503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        scheduler = plumbing.scheduler_or_none()
        if scheduler is None:
            return plumbing.not_ready()
        ids = state.tokenizer.encode("Hi") or [0]
        req = Request(list(ids), SamplingParams(max_new_tokens=1, temperature=0.0), user_request=False)
        try:
            waiter = plumbing.submit_all(scheduler, [req])
            await asyncio.wait_for(plumbing.wait_all(scheduler, [req], waiter), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, ConfigError) as exc:
            scheduler.abort(req)
            return plumbing.error(f"health generate did not finish: {exc!r}", 503)
        if plumbing.failed(req):
            return plumbing.error(f"health generate failed: {plumbing.failed(req)}", 503)
        return PlainTextResponse("", status_code=200)

    def parse_generate(body: dict[str, Any]) -> tuple[list[Request], bool]:
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise ConfigError("give exactly one of 'text' or 'input_ids'")
        if text is not None:
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not all(isinstance(t, str) for t in texts):
                raise ConfigError("'text' must be a string or a list of strings")
            prompts = [list(state.tokenizer.encode(t)) for t in texts]
        else:
            batched = bool(input_ids) and isinstance(input_ids[0], list)
            prompts = input_ids if batched else [input_ids]
            if not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
                raise ConfigError("'input_ids' must be a list of ints or a list of lists of ints")
        raw_params = body.get("sampling_params") or {}
        if isinstance(raw_params, list):
            if len(raw_params) != len(prompts):
                raise ConfigError(f"{len(raw_params)} sampling_params for {len(prompts)} prompts; give one or one each")
            params = [SamplingParams.from_dict(p) for p in raw_params]
        else:
            params = [SamplingParams.from_dict(raw_params)] * len(prompts)
        top_n = int(body.get("top_logprobs_num") or 0)
        start = body.get("logprob_start_len")
        # As SGLang: one start for every prompt, or (a batch) one per prompt, so that one request
        # can score prompts whose scored parts begin at different positions (several items' endings).
        if isinstance(start, list):
            if len(start) != len(prompts) or not all(isinstance(s, int) and not isinstance(s, bool) for s in start):
                raise ConfigError(f"logprob_start_len is a list of {len(start)} for {len(prompts)} prompts; give "
                                  f"one integer, or one integer per prompt")
            starts = list(start)
        else:
            starts = [-1 if start is None else int(start)] * len(prompts)
        return_logprob = bool(body.get("return_logprob", False))
        reqs = [Request(list(p), sp, return_logprob=return_logprob, logprob_start_len=st,
                        top_logprobs_num=top_n if return_logprob else 0)
                for p, sp, st in zip(prompts, params, starts)]
        rid = body.get("rid")
        if isinstance(rid, str) and len(reqs) == 1:
            reqs[0].rid = rid
        return reqs, batched

    @app.post("/generate")
    async def generate(http: HttpRequest) -> Response:
        scheduler = plumbing.scheduler_or_none()
        if scheduler is None:
            return plumbing.not_ready()
        try:
            body = await plumbing.json_object(http)
            reqs, batched = parse_generate(body)
            if (fault := plumbing.injected_error()) is not None:
                return fault
            waiter = plumbing.submit_all(scheduler, reqs)
        except orjson.JSONDecodeError as exc:
            return plumbing.error(f"the request body is not valid JSON: {exc}", 400)
        except ConfigError as exc:
            return plumbing.error(str(exc), 400)

        if body.get("stream"):
            def render(req: Request, index: int, _sent: int) -> bytes:
                return plumbing.sse(result_of(req, index if batched else None))

            return plumbing.streamed(scheduler, reqs, waiter, render)

        if (failure := await plumbing.finished_or_error(scheduler, reqs, waiter)) is not None:
            return failure
        results = [result_of(r, None) for r in reqs]
        return plumbing.json(results if batched else results[0])

    def server_info() -> dict[str, Any]:
        scheduler = state.scheduler
        internal: dict[str, Any] = {
            "memory_usage": {
                "weight": round(state.weight_bytes / 2**30, 4),
                "kvcache": round(state.token_capacity * state.kv_bytes_per_token / 2**30, 4),
                "token_capacity": state.token_capacity,
            },
            "effective_max_running_requests_per_dp": state.max_running_requests,
            "last_gen_throughput": scheduler.last_gen_throughput if scheduler else 0.0,
        }
        if scheduler is not None and scheduler.speculative:
            value = scheduler.avg_spec_accept_length
            internal["avg_spec_accept_length"] = None if math.isnan(value) else value
        if scheduler is not None:
            internal.update(scheduler.load())
        return {
            **state.server_args,
            "max_total_num_tokens": state.token_capacity,
            "max_running_requests": state.max_running_requests,
            "version": state.version,
            "ready": state.ready.is_set(),
            "internal_states": [internal],
        }

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        return plumbing.json(server_info())

    @app.get("/server_info")
    async def server_info_route() -> Response:
        return plumbing.json(server_info())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(http: HttpRequest) -> Response:
        scheduler = plumbing.scheduler_or_none()
        if scheduler is None:
            return plumbing.not_ready()
        raw = http.query_params.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            return plumbing.error(f"timeout={raw!r} is not a number of seconds", 400)
        if math.isnan(timeout) or timeout < 0:
            return plumbing.error(f"timeout must be a number of seconds >= 0, got {raw!r}", 400)
        arrived = time.monotonic()
        busy_until = arrived + state.faults.flush_busy_s
        deadline = arrived + timeout
        while True:
            t = time.monotonic()
            if t >= busy_until and scheduler.flush_cache():
                return PlainTextResponse("Cache flushed.\n", status_code=200)
            if t >= deadline:
                return PlainTextResponse(
                    f"Cache not flushed: the worker is busy (running or waiting requests) and stayed busy for "
                    f"the {timeout:g} s timeout. Retry with a larger ?timeout= or wait for the load to end.\n",
                    status_code=400)
            await asyncio.sleep(min(FLUSH_POLL_S, max(0.0, deadline - t)))

    @app.get("/metrics")
    async def metrics() -> Response:
        if not state.metrics.enabled:
            return PlainTextResponse("metrics are disabled; start the worker with --enable-metrics\n",
                                     status_code=404)
        return Response(content=state.metrics.render(), media_type=CONTENT_TYPE)

    async def profile_command(command: str) -> Any:
        if not state.server_args.get("profiler_dir"):
            return PlainTextResponse("profiling is off; start the worker with --profiler-dir DIR\n", status_code=404)
        scheduler = plumbing.scheduler_or_none()
        if scheduler is None:
            return plumbing.not_ready()
        try:
            future = scheduler.profile(command)  # type: ignore[arg-type]
            return await asyncio.wait_for(asyncio.wrap_future(future), PROFILE_TIMEOUT_S)
        except ConfigError as exc:
            return plumbing.error(str(exc), 400)
        except asyncio.TimeoutError:
            return plumbing.error(f"the profiler did not {command} within {PROFILE_TIMEOUT_S:g} s", 503)
        except (OSError, RuntimeError) as exc:
            return plumbing.error(f"the profiler failed to {command}: {exc}", 500)

    @app.post("/start_profile")
    async def start_profile() -> Response:
        answer = await profile_command("start")
        return answer if isinstance(answer, Response) else PlainTextResponse("Profiler started.\n")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        answer = await profile_command("stop")
        return answer if isinstance(answer, Response) else plumbing.json({"trace": answer})

    register_openai_routes(app, plumbing)
    return app


def install_crash_fault(scheduler: Scheduler, after: int) -> None:
    """``os._exit(1)`` shortly after the N-th completed user request (its answer gets out first)."""
    def on_done(count: int) -> None:
        if count >= after:
            log.warning("fault injection: crashing after %d completed requests", count)
            timer = threading.Timer(0.3, os._exit, args=(1,))
            timer.daemon = True
            timer.start()

    scheduler.on_user_request_done = on_done
