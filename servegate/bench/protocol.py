"""Request bodies and stream parsing for the two generation protocols the gate speaks.

- ``native``: SGLang's ``POST /generate`` (``input_ids`` or ``text``, single or a list;
  ``sampling_params``; ``stream``). A streamed batch sends one SSE chunk per request
  ``index``; each chunk's ``meta_info.completion_tokens`` is cumulative.
- ``openai``: ``POST /v1/completions`` (``prompt`` as text, token ids, or a list of either;
  ``max_tokens``; ``ignore_eos`` as vLLM and SGLang accept it). Streams carry
  ``choices[*].index``; token counts come from ``usage`` (``stream_options.include_usage``,
  and per chunk with ``continuous_usage_stats`` where the server supports it).

Both stream as Server-Sent Events: ``data: {json}`` lines ending with ``data: [DONE]``.
Output tokens are always counted from the server's own counters, never by tokenizing
chunks on the client (which would cost CPU in the load generator and disagree with the
server's tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson
import requests

from servegate.errors import ServerUnreachableError, StageError

__all__ = [
    "Prompt",
    "SSE_DONE",
    "GENERATE_PATH",
    "COMPLETIONS_PATH",
    "auth_headers",
    "native_generate_body",
    "openai_completions_body",
    "generate_url",
    "parse_sse_line",
    "StreamEvent",
    "native_event",
    "openai_events",
    "openai_usage",
    "fetch_model_name",
]

Prompt = list[int] | str
"""One prompt: token ids (no tokenizer needed on the client) or text."""

GENERATE_PATH: Final = "/generate"
COMPLETIONS_PATH: Final = "/v1/completions"


class _Done:
    """Sentinel type for the ``data: [DONE]`` line."""

    def __repr__(self) -> str:
        return "SSE_DONE"


SSE_DONE: Final = _Done()


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer`` when an API key is set (SGLang ``--api-key``, vLLM ``--api-key``)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def generate_url(base_url: str, protocol: Literal["native", "openai"]) -> str:
    return base_url.rstrip("/") + (GENERATE_PATH if protocol == "native" else COMPLETIONS_PATH)


def native_generate_body(prompt: Prompt | list[Prompt], max_new_tokens: int, *, stream: bool,
                         ignore_eos: bool = True, temperature: float = 0.0) -> dict[str, Any]:
    """Body of SGLang's ``POST /generate`` for one prompt or a batch (a list of prompts).

    Token ids go in ``input_ids`` (a list of ints, or a list of lists for a batch); text in
    ``text``. A batch of text and ids cannot be mixed.
    """
    key = "text" if _is_text(prompt) else "input_ids"
    return {
        key: prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature,
                            "ignore_eos": ignore_eos},
        "stream": stream,
    }


def openai_completions_body(model: str, prompt: Prompt | list[Prompt], max_tokens: int, *, stream: bool,
                            ignore_eos: bool = True, temperature: float = 0.0) -> dict[str, Any]:
    """Body of ``POST /v1/completions``; a list of prompts is one request with one choice per prompt.

    ``continuous_usage_stats`` asks vLLM/SGLang for a cumulative ``usage`` on every chunk, so
    that a chunk carrying several tokens (speculative decoding) spreads its gap over them.
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _is_text(prompt: Prompt | list[Prompt]) -> bool:
    if isinstance(prompt, str):
        return True
    return bool(prompt) and isinstance(prompt[0], str)


def parse_sse_line(line: bytes) -> dict[str, Any] | _Done | None:
    """Parse one SSE line: a JSON dict, ``SSE_DONE``, or None for blank/comment/other fields.

    A ``data:`` line whose payload is not JSON raises ``StageError`` (the server broke the
    protocol; the caller records it as a failed request).
    """
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return SSE_DONE
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise StageError(f"server sent a stream chunk that is not JSON: {payload[:200]!r}; "
                         f"check that the server speaks this protocol") from exc
    if not isinstance(data, dict):
        raise StageError(f"server sent a stream chunk that is not a JSON object: {payload[:200]!r}")
    return data


@dataclass(frozen=True)
class StreamEvent:
    """Progress of one request (``index`` within a batch) seen in one stream chunk."""

    index: int
    completion_tokens: int | None
    """Cumulative output tokens as the server reports them; None when the chunk has no count."""
    prompt_tokens: int | None
    finished: bool


def _chunk_error(data: dict[str, Any]) -> None:
    err = data.get("error")
    if err:
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise StageError(f"server reported an error in the stream: {msg}")


def native_event(data: dict[str, Any]) -> StreamEvent:
    """One SGLang ``/generate`` stream chunk -> its request index and cumulative token count."""
    _chunk_error(data)
    try:
        meta = data.get("meta_info") or {}
        completion = meta.get("completion_tokens")
        if completion is None and isinstance(data.get("output_ids"), list):
            completion = len(data["output_ids"])
        prompt = meta.get("prompt_tokens")
        return StreamEvent(
            index=int(data.get("index", 0)),
            completion_tokens=int(completion) if completion is not None else None,
            prompt_tokens=int(prompt) if prompt is not None else None,
            finished=meta.get("finish_reason") is not None,
        )
    except (AttributeError, TypeError, ValueError) as exc:
        raise StageError(f"malformed /generate stream chunk ({exc}): {str(data)[:200]}") from exc


def openai_events(data: dict[str, Any]) -> list[StreamEvent]:
    """One ``/v1/completions`` stream chunk -> one event per choice it carries.

    A choice counts as progress even when its text is empty (a token can decode to nothing),
    except a finish-only choice (empty text with a ``finish_reason``), which carries no token.
    The per-choice count comes from ``usage`` only when the chunk has exactly one choice and a
    cumulative usage (``continuous_usage_stats``); otherwise it is None (one token per chunk).
    """
    _chunk_error(data)
    try:
        choices = data.get("choices") or []
        usage = data.get("usage") or {}
        single = len(choices) == 1
        events = []
        for ch in choices:
            finished = ch.get("finish_reason") is not None
            if finished and not ch.get("text"):
                continue
            completion = usage.get("completion_tokens") if single else None
            prompt = usage.get("prompt_tokens") if single else None
            events.append(StreamEvent(
                index=int(ch.get("index", 0)),
                completion_tokens=int(completion) if completion is not None else None,
                prompt_tokens=int(prompt) if prompt is not None else None,
                finished=finished,
            ))
        return events
    except (AttributeError, TypeError, ValueError) as exc:
        raise StageError(f"malformed /v1/completions stream chunk ({exc}): {str(data)[:200]}") from exc


def openai_usage(data: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a chunk's ``usage``, or (None, None)."""
    usage = data.get("usage") or {}
    try:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        return (int(prompt) if prompt is not None else None,
                int(completion) if completion is not None else None)
    except (AttributeError, TypeError, ValueError) as exc:
        raise StageError(f"malformed usage in a stream chunk ({exc}): {str(usage)[:200]}") from exc


def fetch_model_name(session: requests.Session, base_url: str, api_key: str | None = None,
                     timeout_s: float = 30.0) -> str:
    """The served model's id from ``GET /v1/models`` (the OpenAI protocol needs it in every body)."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = session.get(url, headers=auth_headers(api_key), timeout=timeout_s)
    except requests.RequestException as exc:
        raise ServerUnreachableError(f"GET {url} failed: {exc}; check that the server is running "
                                     f"and the URL is right") from exc
    if resp.status_code != 200:
        raise StageError(f"GET {url} answered {resp.status_code}: {resp.text[:300]}; the OpenAI "
                         f"protocol needs /v1/models to name the model")
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise StageError(f"GET {url} returned no model id ({resp.text[:300]!r}); "
                         f"the server must list its model under data[0].id") from exc
