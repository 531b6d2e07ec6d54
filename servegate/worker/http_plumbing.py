"""The state and request plumbing that the embedded worker's two HTTP surfaces share.

``WorkerState`` is everything the routes read; ``RequestPlumbing`` is what the native routes
(``servegate.worker.server``) and the OpenAI ones (``servegate.worker.openai_routes``) do alike:
answer 503 until the model has loaded, read a JSON body, inject configured faults, submit
requests, and wait for or stream their tokens, with JSON and SSE responses.

The scheduler runs in its own thread; each HTTP request registers a callback that wakes
its handler on the event loop (``call_soon_threadsafe``) whenever the scheduler produced
tokens, so a streaming response sends whatever arrived since its last chunk.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from servegate.errors import ConfigError, InfraError
from servegate.worker.faults import FaultConfig
from servegate.worker.metrics import WorkerMetrics
from servegate.worker.request import Request
from servegate.worker.scheduler import STEP_ERROR_PREFIX, Scheduler

__all__ = ["WorkerState", "RequestPlumbing"]


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


class RequestPlumbing:
    """What the native and the OpenAI routes share over one ``WorkerState``."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    # ---- responses
    @staticmethod
    def json(obj: Any, status: int = 200) -> Response:
        # orjson writes NaN/inf as null, so a NaN gauge copy never produces invalid JSON.
        return Response(content=orjson.dumps(obj), status_code=status, media_type="application/json")

    @classmethod
    def error(cls, message: str, status: int) -> Response:
        return cls.json({"error": {"message": message, "code": status}}, status)

    @staticmethod
    def sse(obj: Any) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    # ---- before a request is submitted
    def scheduler_or_none(self) -> Scheduler | None:
        return self.state.scheduler if self.state.ready.is_set() else None

    def not_ready(self) -> Response:
        return self.error("the worker is starting (model loading); retry when GET /health answers 200", 503)

    @staticmethod
    async def json_object(http: HttpRequest) -> dict[str, Any]:
        body = orjson.loads(await http.body())
        if not isinstance(body, dict):
            raise ConfigError("the request body must be a JSON object")
        return body

    def injected_error(self) -> Response | None:
        faults = self.state.faults
        if faults.error_rate and self.state.error_rng.random() < faults.error_rate:
            return self.error("fault injection: --fault-error-rate answered this request with 500", 500)
        return None

    # ---- a request's answer
    def text_of(self, req: Request, ids: list[int]) -> str:
        text = self.state.tokenizer.decode(ids, skip_special_tokens=True)
        reason = req.finish_reason or {}
        matched = reason.get("matched")
        if reason.get("type") == "stop" and isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    @staticmethod
    def failed(req: Request) -> str | None:
        reason = req.finish_reason or {}
        if reason.get("type") == "abort" and str(reason.get("message", "")).startswith(STEP_ERROR_PREFIX):
            return str(reason["message"])
        return None

    # ---- submitting, waiting, streaming
    @staticmethod
    def submit_all(scheduler: Scheduler, reqs: list[Request]) -> _Waiter:
        """Check every request is admissible, then submit them all; the waiter wakes on their tokens."""
        waiter = _Waiter()
        for req in reqs:
            req.notify = waiter.notify
        scheduler.submit_batch(reqs)
        return waiter

    @staticmethod
    async def wait_all(scheduler: Scheduler, reqs: list[Request], waiter: _Waiter) -> None:
        try:
            while not all(r.finished for r in reqs):
                await waiter.wait()
        except asyncio.CancelledError:
            for r in reqs:
                scheduler.abort(r)
            raise

    async def finished_or_error(self, scheduler: Scheduler, reqs: list[Request], waiter: _Waiter) -> Response | None:
        """Wait for every request; the 500 answer for the first that the engine aborted, else None."""
        await self.wait_all(scheduler, reqs, waiter)
        errors = [m for m in (self.failed(r) for r in reqs) if m]
        return self.error(errors[0], 500) if errors else None

    def streamed(self, scheduler: Scheduler, reqs: list[Request], waiter: _Waiter, render: Any) -> Response:
        """An SSE response of ``render``ed chunks as tokens arrive (``stream_chunks``)."""
        return StreamingResponse(self.stream_chunks(scheduler, reqs, waiter, render), media_type="text/event-stream")

    async def stream_chunks(self, scheduler: Scheduler, reqs: list[Request], waiter: _Waiter,
                            render: Any, done_line: bool = True) -> AsyncIterator[bytes]:
        """Yield rendered chunks as tokens arrive; ``render(req, index, sent_tokens)`` -> bytes | None."""
        sent = [0] * len(reqs)
        closed = [False] * len(reqs)
        cut_after = self.state.faults.cut_stream_after_tokens
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
