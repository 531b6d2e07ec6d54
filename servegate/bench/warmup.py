"""Warmup: a few short requests before anything is measured; any failure fails the stage.

Nothing warmup produces is measured. SGLang's kits warm up with max_new_tokens=64.
"""

from __future__ import annotations

from typing import Any

import requests

from servegate.config import WarmupConfig
from servegate.engines.base import Engine
from servegate.errors import StageError
from servegate.http import body_excerpt, join_url, json_body, make_session, served_model_name, unreachable_as_error

__all__ = ["run_warmup"]


def _native_request(cfg: WarmupConfig) -> tuple[str, dict[str, Any]]:
    return "/generate", {"text": cfg.prompt,
                         "sampling_params": {"max_new_tokens": cfg.max_new_tokens, "temperature": 0}}


def _openai_request(cfg: WarmupConfig, model: str) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": model, "prompt": cfg.prompt, "max_tokens": cfg.max_new_tokens,
                               "temperature": 0}


def _generated_something(doc: Any, protocol: str) -> bool:
    if not isinstance(doc, dict):
        return False
    if protocol == "native":
        meta = doc.get("meta_info") or {}
        return bool(doc.get("text")) or bool(doc.get("output_ids")) or bool(meta.get("completion_tokens"))
    choices = doc.get("choices") or []
    usage = doc.get("usage") or {}
    return (bool(choices) and isinstance(choices[0], dict) and bool(choices[0].get("text"))) \
        or bool(usage.get("completion_tokens"))


def run_warmup(base_url: str, engine: Engine, cfg: WarmupConfig, api_key: str | None = None, *,
               session: requests.Session | None = None, model: str | None = None) -> int:
    """Send ``cfg.num_requests`` short greedy requests over the engine's protocol, one at a time.

    Native protocol: ``POST /generate``; OpenAI protocol: ``POST /v1/completions`` naming ``model``
    (default: the first id from ``GET /v1/models``). Returns the number of requests sent.
    Raises ``StageError`` on a non-200 answer or an empty output, ``ServerUnreachableError`` when
    the server does not answer.
    """
    own_session = session is None
    session = session or make_session(api_key)
    try:
        if engine.protocol == "native":
            path, body = _native_request(cfg)
        else:
            path, body = _openai_request(cfg, model or served_model_name(session, base_url))
        url = join_url(base_url, path)
        for i in range(cfg.num_requests):
            with unreachable_as_error(url, f"warmup request {i + 1}/{cfg.num_requests} got no answer; check "
                                           f"that the worker is alive, or raise warmup.request_timeout_s"):
                response = session.post(url, json=body, timeout=cfg.request_timeout_s)
            if response.status_code != 200:
                raise StageError(f"warmup failed: request {i + 1}/{cfg.num_requests} POST {url} -> "
                                 f"{response.status_code}: {body_excerpt(response)!r}; read the worker log")
            doc = json_body(response, "warmup")
            if not _generated_something(doc, engine.protocol):
                raise StageError(f"warmup failed: request {i + 1}/{cfg.num_requests} POST {url} -> 200 with no "
                                 f"generated output: {body_excerpt(response)!r}; the worker answers but does "
                                 f"not generate — read its log")
        return cfg.num_requests
    finally:
        if own_session:
            session.close()
