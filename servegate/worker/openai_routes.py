"""The embedded worker's OpenAI-compatible routes, registered on the app that ``servegate.worker.server`` builds.

``POST /v1/completions`` (a string, token ids, or a list of either; ``echo`` and legacy ``logprobs``),
``POST /v1/chat/completions`` (the tokenizer's chat template), ``GET /v1/models``; each answers as
one JSON object or, with ``stream``, as SSE chunks ending in ``data: [DONE]``. This module owns
turning OpenAI request bodies into scheduler requests and results into OpenAI's shapes; readiness,
fault injection, submitting, waiting and streaming are ``servegate.worker.http_plumbing``'s, shared
with the native routes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import Response

from servegate.errors import ConfigError
from servegate.worker.http_plumbing import RequestPlumbing
from servegate.worker.request import Request
from servegate.worker.sampling import SamplingParams

__all__ = ["register_openai_routes"]

OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


def _sampling_params(body: dict[str, Any], default_max: int | None) -> SamplingParams:
    if int(body.get("n") or 1) != 1:
        raise ConfigError("only n=1 is supported by the embedded worker")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max
    raw = {"max_new_tokens": max_tokens, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
           "top_k": body.get("top_k"), "ignore_eos": body.get("ignore_eos", False), "stop": body.get("stop"),
           "stop_token_ids": body.get("stop_token_ids")}
    return SamplingParams.from_dict(raw)


def _usage(reqs: list[Request]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in reqs)
    completion = sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in reqs)}}


def _finish_reason(req: Request) -> str | None:
    if not req.finished:
        return None
    kind = (req.finish_reason or {}).get("type")
    return {"length": "length", "stop": "stop"}.get(kind, "abort")


def _legacy_logprobs(tokenizer: Any, req: Request, echo: bool) -> dict[str, Any]:
    """OpenAI's legacy completions ``logprobs`` object (prompt first when ``echo``, as vLLM)."""
    pairs: list[tuple[float | None, int]] = list(req.input_token_logprobs) if echo else []
    tops: list[Any] = list(req.input_top_logprobs) if echo else []
    pairs += list(req.output_token_logprobs[:len(req.output_ids)])
    tops += list(req.output_top_logprobs[:len(req.output_ids)])
    tokens = [tokenizer.decode([tok]) for _, tok in pairs]
    offsets, pos = [], 0
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top = None
    if req.top_logprobs_num > 0:
        top = [None if t is None else {tokenizer.decode([tok]): lp for lp, tok in t} for t in tops]
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs], "top_logprobs": top,
            "text_offset": offsets}


def register_openai_routes(app: FastAPI, plumbing: RequestPlumbing) -> None:
    """Add ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` to ``app``."""
    state = plumbing.state

    @app.get("/v1/models")
    async def models() -> Response:
        return plumbing.json({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "servegate",
            "root": state.model_name, "max_model_len": state.context_length}]})

    async def openai_run(http: HttpRequest, chat: bool) -> Response:
        scheduler = plumbing.scheduler_or_none()
        if scheduler is None:
            return plumbing.not_ready()
        try:
            body = await plumbing.json_object(http)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ConfigError("'messages' must be a non-empty list of {role, content} objects")
                encoded = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
                prompts = [list(ids)]
                params = _sampling_params(body, None)  # None: SGLang's default max_new_tokens
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
                params = _sampling_params(body, OPENAI_DEFAULT_MAX_TOKENS)
            if (fault := plumbing.injected_error()) is not None:
                return fault
            echo = bool(body.get("echo")) and not chat
            n_logprobs = None if chat or body.get("logprobs") is None else int(body["logprobs"])
            reqs = [Request(p, params, return_logprob=n_logprobs is not None,
                            logprob_start_len=0 if echo and n_logprobs is not None else -1,
                            top_logprobs_num=n_logprobs or 0) for p in prompts]
            waiter = plumbing.submit_all(scheduler, reqs)
        except orjson.JSONDecodeError as exc:
            return plumbing.error(f"the request body is not valid JSON: {exc}", 400)
        except ConfigError as exc:
            return plumbing.error(str(exc), 400)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = body.get("model") or state.model_name
        obj = "chat.completion" if chat else "text_completion"

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            texts = [""] * len(reqs)

            def render(req: Request, index: int, _sent: int) -> bytes:
                text = plumbing.text_of(req, list(req.output_ids))
                delta, texts[index] = text[len(texts[index]):], text
                finish = _finish_reason(req)
                if chat:
                    d: dict[str, Any] = {"content": delta}
                    if _sent == 0:
                        d["role"] = "assistant"
                    choice: dict[str, Any] = {"index": index, "delta": d, "finish_reason": finish}
                else:
                    choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}
                out = plumbing.sse({"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                    "model": model, "choices": [choice]})
                if finish is not None and include_usage and all(r.finished for r in reqs):
                    out += plumbing.sse({"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                         "model": model, "choices": [], "usage": _usage(reqs)})
                return out

            return plumbing.streamed(scheduler, reqs, waiter, render)

        if (failure := await plumbing.finished_or_error(scheduler, reqs, waiter)) is not None:
            return failure
        if chat:
            choices = [{"index": i, "message": {"role": "assistant",
                                                "content": plumbing.text_of(r, list(r.output_ids))},
                        "finish_reason": _finish_reason(r)} for i, r in enumerate(reqs)]
        else:
            choices = [{"index": i,
                        "text": ((state.tokenizer.decode(r.input_ids) if echo else "")
                                 + plumbing.text_of(r, list(r.output_ids))),
                        "logprobs": _legacy_logprobs(state.tokenizer, r, echo) if r.return_logprob else None,
                        "finish_reason": _finish_reason(r)} for i, r in enumerate(reqs)]
        return plumbing.json({"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                              "usage": _usage(reqs)})

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await openai_run(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await openai_run(http, chat=True)
