"""The embedded worker's HTTP surface: SGLang's native routes plus OpenAI's, on FastAPI.

Native: ``POST /generate``, ``GET /health``, ``GET /health_generate``,
``GET /get_server_info`` (and ``/server_info``), ``GET|POST /flush_cache``, ``GET /metrics``.
OpenAI: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

The scheduler runs in its own thread; each HTTP request registers a callback that wakes
its handler on the event loop (``call_soon_threadsafe``) whenever the scheduler produced
tokens, so a streaming response sends whatever arrived since its last chunk.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from servegate.errors import ConfigError, InfraError
from servegate.worker.request import Request
from servegate.worker.sampling import SamplingParams
from servegate.worker.scheduler import STEP_ERROR_PREFIX, Scheduler
from servegate.worker.faults import FaultConfig
from servegate.worker.metrics import CONTENT_TYPE, WorkerMetrics

__all__ = ["WorkerState", "build_app", "authorized"]

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 60.0
FLUSH_POLL_S = 0.05
OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass
class WorkerState:
    """Everything the routes need; ``scheduler`` is None until the model has loaded."""

    model_name: str
    server_args: dict[str, Any]
    metrics: WorkerMetrics
    faults: FaultConfig
    token_capacity: int
    max_running_requests: int
    context_length: int
    weight_bytes: int
    kv_bytes_per_token: int
    version: str
    api_key: str | None = None
    scheduler: Scheduler | None = None
    tokenizer: Any = None
    ready: threading.Event = field(default_factory=threading.Event)
    error_rng: random.Random = field(default_factory=random.Random)


def _json(obj: Any, status: int = 200) -> Response:
    # orjson writes NaN/inf as null, so a NaN gauge copy never produces invalid JSON.
    return Response(content=orjson.dumps(obj), status_code=status, media_type="application/json")


def _error(message: str, status: int) -> Response:
    return _json({"error": {"message": message, "code": status}}, status)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _Waiter:
    """Wakes an async handler from the scheduler thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


def authorized(header: str | None, expected: bytes) -> bool:
    """The ``Authorization`` header equals ``expected`` (``b"Bearer KEY"``), compared in constant
    time: an early-exit ``!=`` tells a client, by timing, how many leading bytes of its guess match.

    Starlette decodes header bytes as latin-1; encoding back gives the bytes the client sent, so a
    non-ASCII header is compared (and refused) like any other instead of raising.
    """
    return hmac.compare_digest((header or "").encode("latin-1"), expected)


def build_app(state: WorkerState) -> FastAPI:
    """The FastAPI application over one ``WorkerState``."""
    app = FastAPI(title="servegate embedded worker", docs_url=None, redoc_url=None, openapi_url=None)

    if state.api_key:
        expected = f"Bearer {state.api_key}".encode()

        @app.middleware("http")
        async def _check_api_key(request: HttpRequest, call_next: Any) -> Any:
            # As SGLang: health probes and metrics stay open; everything else needs the key.
            path = request.url.path
            if request.method == "OPTIONS" or path.startswith("/health") or path.startswith("/metrics"):
                return await call_next(request)
            if not authorized(request.headers.get("authorization"), expected):
                return _json({"error": "Unauthorized"}, 401)
            return await call_next(request)

    def scheduler_or_none() -> Scheduler | None:
        return state.scheduler if state.ready.is_set() else None

    def not_ready() -> Response:
        return _error("the worker is starting (model loading); retry when GET /health answers 200", 503)

    async def json_object(http: HttpRequest) -> dict[str, Any]:
        body = orjson.loads(await http.body())
        if not isinstance(body, dict):
            raise ConfigError("the request body must be a JSON object")
        return body

    def injected_error() -> Response | None:
        if state.faults.error_rate and state.error_rng.random() < state.faults.error_rate:
            return _error("fault injection: --fault-error-rate answered this request with 500", 500)
        return None

    # ------------------------------------------------------------------ helpers
    def text_of(req: Request, ids: list[int]) -> str:
        text = state.tokenizer.decode(ids, skip_special_tokens=True)
        reason = req.finish_reason or {}
        matched = reason.get("matched")
        if reason.get("type") == "stop" and isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

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
        out: dict[str, Any] = {"text": text_of(req, ids), "output_ids": ids, "meta_info": meta_of(req, ids)}
        if index is not None:
            out["index"] = index
        return out

    def failed(req: Request) -> str | None:
        reason = req.finish_reason or {}
        if reason.get("type") == "abort" and str(reason.get("message", "")).startswith(STEP_ERROR_PREFIX):
            return str(reason["message"])
        return None

    def submit_all(scheduler: Scheduler, reqs: list[Request], waiter: _Waiter) -> None:
        for req in reqs:
            scheduler.check_admissible(req.input_ids, req.params)
        for req in reqs:
            req.notify = waiter.notify
            scheduler.submit(req)

    async def wait_all(scheduler: Scheduler, reqs: list[Request], waiter: _Waiter, http: HttpRequest | None) -> None:
        try:
            while not all(r.finished for r in reqs):
                await waiter.wait()
        except asyncio.CancelledError:
            for r in reqs:
                scheduler.abort(r)
            raise

    async def stream_chunks(scheduler: Scheduler, reqs: list[Request], waiter: _Waiter,
                            render: Any, done_line: bool = True) -> AsyncIterator[bytes]:
        """Yield rendered chunks as tokens arrive; ``render(req, index, sent_tokens)`` -> bytes | None."""
        sent = [0] * len(reqs)
        closed = [False] * len(reqs)
        cut_after = state.faults.cut_stream_after_tokens
        try:
            while True:
                for i, req in enumerate(reqs):
                    if closed[i]:
                        continue
                    finished = req.finished
                    n = len(req.output_ids)
                    if n > sent[i] or finished:
                        chunk = render(req, i, sent[i])
                        sent[i] = n
                        closed[i] = finished
                        if chunk:
                            yield chunk
                    if cut_after is not None and sum(sent) >= cut_after:
                        for r in reqs:
                            scheduler.abort(r)
                        raise InfraError(f"fault injection: stream cut after {sum(sent)} tokens "
                                         f"(--fault-cut-stream-after-tokens {cut_after})")
                if all(closed):
                    break
                await waiter.wait()
            if done_line:
                yield b"data: [DONE]\n\n"
        finally:
            for r in reqs:
                if not r.finished:
                    scheduler.abort(r)

    # ------------------------------------------------------------------ native routes
    @app.get("/health")
    async def health() -> Response:
        if state.ready.is_set():
            return PlainTextResponse("", status_code=200)
        return PlainTextResponse("starting", status_code=503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        scheduler = scheduler_or_none()
        if scheduler is None:
            return not_ready()
        ids = state.tokenizer.encode("Hi") or [0]
        req = Request(list(ids), SamplingParams(max_new_tokens=1, temperature=0.0), user_request=False)
        waiter = _Waiter()
        try:
            submit_all(scheduler, [req], waiter)
            await asyncio.wait_for(wait_all(scheduler, [req], waiter, None), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, ConfigError) as exc:
            scheduler.abort(req)
            return _error(f"health generate did not finish: {exc!r}", 503)
        if failed(req):
            return _error(f"health generate failed: {failed(req)}", 503)
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
        return_logprob = bool(body.get("return_logprob", False))
        reqs = [Request(list(p), sp, return_logprob=return_logprob,
                        logprob_start_len=-1 if start is None else int(start),
                        top_logprobs_num=top_n if return_logprob else 0)
                for p, sp in zip(prompts, params)]
        rid = body.get("rid")
        if isinstance(rid, str) and len(reqs) == 1:
            reqs[0].rid = rid
        return reqs, batched

    @app.post("/generate")
    async def generate(http: HttpRequest) -> Response:
        scheduler = scheduler_or_none()
        if scheduler is None:
            return not_ready()
        try:
            body = await json_object(http)
            reqs, batched = parse_generate(body)
            if (fault := injected_error()) is not None:
                return fault
            waiter = _Waiter()
            submit_all(scheduler, reqs, waiter)
        except orjson.JSONDecodeError as exc:
            return _error(f"the request body is not valid JSON: {exc}", 400)
        except ConfigError as exc:
            return _error(str(exc), 400)

        if body.get("stream"):
            def render(req: Request, index: int, _sent: int) -> bytes:
                return _sse(result_of(req, index if batched else None))

            return StreamingResponse(stream_chunks(scheduler, reqs, waiter, render), media_type="text/event-stream")

        await wait_all(scheduler, reqs, waiter, http)
        errors = [m for m in (failed(r) for r in reqs) if m]
        if errors:
            return _error(errors[0], 500)
        results = [result_of(r, None) for r in reqs]
        return _json(results if batched else results[0])

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
        return _json(server_info())

    @app.get("/server_info")
    async def server_info_route() -> Response:
        return _json(server_info())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(http: HttpRequest) -> Response:
        scheduler = scheduler_or_none()
        if scheduler is None:
            return not_ready()
        raw = http.query_params.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            return _error(f"timeout={raw!r} is not a number of seconds", 400)
        if math.isnan(timeout) or timeout < 0:
            return _error(f"timeout must be a number of seconds >= 0, got {raw!r}", 400)
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

    # ------------------------------------------------------------------ OpenAI routes
    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "servegate",
            "root": state.model_name, "max_model_len": state.context_length}]})

    def openai_params(body: dict[str, Any], default_max: int | None) -> SamplingParams:
        if int(body.get("n") or 1) != 1:
            raise ConfigError("only n=1 is supported by the embedded worker")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = default_max
        raw = {"max_new_tokens": max_tokens, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
               "top_k": body.get("top_k"), "ignore_eos": body.get("ignore_eos", False), "stop": body.get("stop"),
               "stop_token_ids": body.get("stop_token_ids")}
        return SamplingParams.from_dict(raw)

    def usage_of(reqs: list[Request]) -> dict[str, Any]:
        prompt = sum(r.prompt_tokens for r in reqs)
        completion = sum(len(r.output_ids) for r in reqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in reqs)}}

    def openai_finish(req: Request) -> str | None:
        if not req.finished:
            return None
        kind = (req.finish_reason or {}).get("type")
        return {"length": "length", "stop": "stop"}.get(kind, "abort")

    def openai_logprobs(req: Request, echo: bool) -> dict[str, Any]:
        """OpenAI's legacy completions ``logprobs`` object (prompt first when ``echo``, as vLLM)."""
        pairs: list[tuple[float | None, int]] = list(req.input_token_logprobs) if echo else []
        tops: list[Any] = list(req.input_top_logprobs) if echo else []
        pairs += list(req.output_token_logprobs[:len(req.output_ids)])
        tops += list(req.output_top_logprobs[:len(req.output_ids)])
        tokens = [state.tokenizer.decode([tok]) for _, tok in pairs]
        offsets, pos = [], 0
        for text in tokens:
            offsets.append(pos)
            pos += len(text)
        top = None
        if req.top_logprobs_num > 0:
            top = [None if t is None else {state.tokenizer.decode([tok]): lp for lp, tok in t} for t in tops]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs], "top_logprobs": top,
                "text_offset": offsets}

    async def openai_run(http: HttpRequest, chat: bool) -> Response:
        scheduler = scheduler_or_none()
        if scheduler is None:
            return not_ready()
        try:
            body = await json_object(http)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ConfigError("'messages' must be a non-empty list of {role, content} objects")
                encoded = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
                prompts = [list(ids)]
                params = openai_params(body, None)  # None: SGLang's default max_new_tokens
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    prompts = [list(state.tokenizer.encode(prompt))]
                elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                    prompts = [list(prompt)]
                elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                    prompts = [list(state.tokenizer.encode(p)) for p in prompt]
                elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
                    prompts = [list(p) for p in prompt]
                else:
                    raise ConfigError("'prompt' must be a string, a list of token ids, or a list of either")
                params = openai_params(body, OPENAI_DEFAULT_MAX_TOKENS)
            if (fault := injected_error()) is not None:
                return fault
            echo = bool(body.get("echo")) and not chat
            n_logprobs = None if chat or body.get("logprobs") is None else int(body["logprobs"])
            reqs = [Request(p, params, return_logprob=n_logprobs is not None,
                            logprob_start_len=0 if echo and n_logprobs is not None else -1,
                            top_logprobs_num=n_logprobs or 0) for p in prompts]
            waiter = _Waiter()
            submit_all(scheduler, reqs, waiter)
        except orjson.JSONDecodeError as exc:
            return _error(f"the request body is not valid JSON: {exc}", 400)
        except ConfigError as exc:
            return _error(str(exc), 400)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = body.get("model") or state.model_name
        obj = "chat.completion" if chat else "text_completion"

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            texts = [""] * len(reqs)

            def render(req: Request, index: int, _sent: int) -> bytes:
                text = text_of(req, list(req.output_ids))
                delta, texts[index] = text[len(texts[index]):], text
                finish = openai_finish(req)
                if chat:
                    d: dict[str, Any] = {"content": delta}
                    if _sent == 0:
                        d["role"] = "assistant"
                    choice: dict[str, Any] = {"index": index, "delta": d, "finish_reason": finish}
                else:
                    choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}
                out = _sse({"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                            "model": model, "choices": [choice]})
                if finish is not None and include_usage and all(r.finished for r in reqs):
                    out += _sse({"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                 "model": model, "choices": [], "usage": usage_of(reqs)})
                return out

            return StreamingResponse(stream_chunks(scheduler, reqs, waiter, render), media_type="text/event-stream")

        await wait_all(scheduler, reqs, waiter, http)
        errors = [m for m in (failed(r) for r in reqs) if m]
        if errors:
            return _error(errors[0], 500)
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text_of(r, list(r.output_ids))},
                        "finish_reason": openai_finish(r)} for i, r in enumerate(reqs)]
        else:
            choices = [{"index": i,
                        "text": (state.tokenizer.decode(r.input_ids) if echo else "") + text_of(r, list(r.output_ids)),
                        "logprobs": openai_logprobs(r, echo) if r.return_logprob else None,
                        "finish_reason": openai_finish(r)} for i, r in enumerate(reqs)]
        return _json({"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                      "usage": usage_of(reqs)})

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await openai_run(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await openai_run(http, chat=True)

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
