"""Warmup: a few short requests before anything is measured; any failure fails the stage.

Nothing warmup produces is measured. SGLang's kits warm up with max_new_tokens=64.
Each request must end, last byte included, within ``warmup.request_timeout_s`` (a server
that drips its answer a byte at a time fails here instead of holding the gate), and must
answer with output whose token count is believable: no more than ``max_new_tokens``, and
native ``completion_tokens`` equal to the ``output_ids`` returned — a server whose counters
lie would make every later measurement false, so it fails the gate before them.
"""

from __future__ import annotations

from typing import Any

import requests

from servegate.config import WarmupConfig
from servegate.engines.base import Engine
from servegate.bench.protocol import check_count_within
from servegate.errors import StageError
from servegate.http import body_excerpt, join_url, json_body, make_session, request_within, served_model_name

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


def _check_counts(doc: dict[str, Any], protocol: str, max_new_tokens: int, what: str) -> None:
    """``StageError`` when the answer's completion-token count is not believable (module docstring)."""
    if protocol == "native":
        reported = (doc.get("meta_info") or {}).get("completion_tokens")
        ids = doc.get("output_ids")
        if isinstance(reported, int) and isinstance(ids, list) and reported != len(ids):
            raise StageError(f"the server reported {reported} completion tokens for {what} but returned "
                             f"{len(ids)} output ids; its token accounting is broken")
    else:
        reported = (doc.get("usage") or {}).get("completion_tokens")
    if isinstance(reported, int):
        check_count_within(reported, max_new_tokens, what)


def run_warmup(base_url: str, engine: Engine, cfg: WarmupConfig, api_key: str | None = None, *,
               session: requests.Session | None = None, model: str | None = None) -> int:
    """Send ``cfg.num_requests`` short greedy requests over the engine's protocol, one at a time.

    Native protocol: ``POST /generate``; OpenAI protocol: ``POST /v1/completions`` naming ``model``
    (default: the first id from ``GET /v1/models``). Returns the number of requests sent.
    Raises ``StageError`` on a non-200 answer, an empty output, an unbelievable token count or a
    request that outlasts ``cfg.request_timeout_s``; ``ServerUnreachableError`` when the server
    cannot be reached.
    """
    own_session = session is None
    session = session or make_session(api_key)
    try:
        if engine.protocol == "native":
            path, body = _native_request(cfg)
        else:
            path, body = _openai_request(cfg, model or served_model_name(
                session, base_url, timeout_s=min(cfg.request_timeout_s, 30.0), setting="warmup.request_timeout_s"))
        url = join_url(base_url, path)
        for i in range(cfg.num_requests):
            what = f"warmup request {i + 1}/{cfg.num_requests} (POST {url})"
            response = request_within(session, "POST", url, limit_s=cfg.request_timeout_s, what=what,
                                      setting="warmup.request_timeout_s", json=body,
                                      hint="check that the worker is alive")
            if response.status_code != 200:
                raise StageError(f"warmup failed: request {i + 1}/{cfg.num_requests} POST {url} -> "
                                 f"{response.status_code}: {body_excerpt(response)!r}; read the worker log")
            doc = json_body(response, "warmup")
            if not _generated_something(doc, engine.protocol):
                raise StageError(f"warmup failed: request {i + 1}/{cfg.num_requests} POST {url} -> 200 with no "
                                 f"generated output: {body_excerpt(response)!r}; the worker answers but does "
                                 f"not generate — read its log")
            _check_counts(doc, engine.protocol, cfg.max_new_tokens, what)
        return cfg.num_requests
    finally:
        if own_session:
            session.close()
