"""The OpenAI completions protocol: ``POST /v1/completions`` (vLLM, any OpenAI-compatible server).

Requests: ``model`` (the served model's id, from ``GET /v1/models``), ``prompt`` as text,
token ids, or a list of either (one choice per prompt); ``max_tokens``; ``ignore_eos`` as vLLM
and SGLang accept it. Streams carry ``choices[*].index``; token counts come from ``usage``
(``stream_options.include_usage``, and per chunk with ``continuous_usage_stats`` where the
server supports it). Log-probabilities: ``echo`` + ``logprobs`` (prompt tokens) and
``return_tokens_as_token_ids`` (vLLM: output tokens as ``token_id:<id>``), in
``choices[i].logprobs.token_logprobs``.

Token counts are checked (``base``'s docstring says why). A chunk may carry several tokens
(vLLM groups them under speculative decoding or a stream interval) and only its text, which
the client does not tokenize, so the number of chunks bounds nothing. What is checked: the
shared bound, and that the final ``usage`` agrees with the last per-chunk cumulative
``usage`` (``continuous_usage_stats``) when the server sends both. An OpenAI server that
claims no more than was asked but streams fewer tokens cannot be caught without a tokenizer
(or logprobs, which cost the server time).

``OpenAITextProtocol`` ("openai-text") is the dialect of servers that follow OpenAI's schema
strictly (transformers serve 5.23): one text prompt per request (token ids and lists are refused:
400), no ``ignore_eos`` (an unknown field is 422), no ``continuous_usage_stats``, and a stream that
may end at its finish chunk, which carries ``usage``, without ``data: [DONE]``. Without
``ignore_eos`` a request's output is *up to* ``max_tokens`` (EOS may end it sooner): fewer tokens
are a measurement, more are still a lie (``check_count_within``). Token-id prompts are decoded to
text with the model's tokenizer before any clock starts (``needs_text_prompts``;
``servegate.bench.datasets.as_text_prompts``), as SGLang's bench_serving does for OpenAI backends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Final

import orjson
import requests

from servegate.bench.protocol.base import (
    BatchTally,
    Prompt,
    StreamEvent,
    TokenStream,
    WireProtocol,
    check_count_within,
    chunk_error,
    last_completion_tokens,
)
from servegate.bench.protocol.sse import SSE_DONE, parse_sse_payload
from servegate.errors import ConfigError, StageError
from servegate.http import served_model_name

__all__ = [
    "COMPLETIONS_PATH",
    "OpenAIProtocol",
    "OpenAITextProtocol",
    "OpenAITokenStream",
    "OpenAITextTokenStream",
    "OpenAIBatchTally",
    "openai_completions_body",
    "openai_events",
    "openai_usage",
]

COMPLETIONS_PATH: Final = "/v1/completions"

# A chunk with exactly one unfinished choice (compact JSON, as vLLM and SGLang send).
# Neither key can occur inside a JSON string (its quotes would be escaped).
_TOKEN_CHUNK: Final = b'"finish_reason":null'
_FINISH_KEY: Final = b'"finish_reason"'


def openai_completions_body(model: str, prompt: Prompt | list[Prompt], max_tokens: int, *, stream: bool | None,
                            ignore_eos: bool | None = True, temperature: float = 0.0,
                            continuous_usage: bool = True) -> dict[str, Any]:
    """Body of ``POST /v1/completions``; a list of prompts is one request with one choice per prompt.

    ``continuous_usage_stats`` (``continuous_usage``) asks vLLM/SGLang for a cumulative ``usage``
    on every chunk, so that a chunk carrying several tokens (speculative decoding) spreads its gap
    over them; it is not OpenAI's. ``stream``/``ignore_eos`` None: left out.
    """
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    if ignore_eos is not None:
        body["ignore_eos"] = ignore_eos
    if stream is not None:
        body["stream"] = stream
    if stream:
        body["stream_options"] = ({"include_usage": True, "continuous_usage_stats": True} if continuous_usage
                                  else {"include_usage": True})
    return body


def openai_events(data: dict[str, Any]) -> list[StreamEvent]:
    """One ``/v1/completions`` stream chunk -> one event per choice it carries.

    A choice counts as progress even when its text is empty (a token can decode to nothing),
    except a finish-only choice (empty text with a ``finish_reason``), which carries no token.
    The per-choice count comes from ``usage`` only when the chunk has exactly one choice and a
    cumulative usage (``continuous_usage_stats``); otherwise it is None (one token per chunk).
    """
    chunk_error(data)
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


class OpenAITokenStream(TokenStream):
    """A ``/v1/completions`` stream: token chunks read at the bytes level when compact, else decoded."""

    __slots__ = ("usage_total", "chunk_usage")

    ends_at_final_usage: ClassVar[bool] = False
    """Whether the stream is complete once a chunk gave the final ``usage`` with no choice left
    unfinished (the dialect without ``[DONE]``); False: only ``[DONE]`` ends it."""

    def __init__(self) -> None:
        super().__init__()
        self.usage_total: int | None = None
        """The final ``usage`` (include_usage summary or finish-only chunk)."""
        self.chunk_usage = False
        """Whether token chunks carried a cumulative ``usage`` (continuous_usage_stats)."""

    def _take(self, payloads: list[bytes], ts: float) -> bool:
        # The hot path: runs once per streamed chunk, in the socket callback.
        count = self.count
        self.end_ts = ts
        for payload in payloads:
            if payload == b"[DONE]":
                self.done = True
                break
            if _TOKEN_CHUNK in payload and payload.count(_FINISH_KEY) == 1:
                # One choice, not finished: a token chunk; its count is the cumulative usage
                # when the server sends one, else one more. Read without decoding the chunk.
                reported = last_completion_tokens(payload)
                if reported is not None:
                    new_count = reported
                    self.chunk_usage = True
                else:
                    new_count = count + 1
                self.last_payload = payload
            else:
                new_count = self._decoded(payload, count)
            if new_count > count:
                count = new_count
        if count > self.count:
            self._arrived(ts, count)  # one arrival per read (TokenStream._arrived)
        self.count = count
        return self.done

    def _decoded(self, payload: bytes, count: int) -> int:
        """Cumulative output tokens after a chunk the bytes-level path does not read.

        The include_usage summary chunk (no choices) and a finish-only chunk carry no token;
        their ``usage`` is the request's final count. Anything but one choice (an error chunk,
        a batch) goes through ``openai_events``, which raises on an error.
        """
        try:
            data = orjson.loads(payload)
            usage = data.get("usage")
            completion = None
            if usage:
                completion = usage.get("completion_tokens")
                prompt = usage.get("prompt_tokens")
                if prompt is not None:
                    self.prompt_tokens = int(prompt)
                if completion is not None:
                    completion = int(completion)
            choices = data.get("choices")
            finished = False
            if choices and len(choices) == 1:
                ch = choices[0]
                finished = ch.get("finish_reason") is not None
                # A finish chunk carries the last token when it has text, token ids, or a per-chunk usage
                # beyond the count so far in a stream that sends one (vLLM's continuous_usage_stats): the
                # last token's text may be empty (bytes of a character held back by the detokenizer).
                has_token = (ch.get("text") or ch.get("token_ids") or not finished
                             or (self.chunk_usage and completion is not None and completion > count))
            else:
                has_token = bool(openai_events(data))
        except orjson.JSONDecodeError:
            parse_sse_payload(payload)  # raises StageError naming the chunk
            raise AssertionError("unreachable") from None  # pragma: no cover
        except (AttributeError, TypeError, KeyError, ValueError) as exc:
            raise StageError(f"malformed /v1/completions stream chunk ({exc}): {payload[:200]!r}") from exc
        if not has_token:
            if completion is not None:
                self.usage_total = completion
                # A finish-only or usage-only chunk: no choice in it is still generating.
                self.done = self.done or self.ends_at_final_usage
            return count
        if completion is None:
            return count + 1
        self.done = self.done or (finished and self.ends_at_final_usage)  # the last token with the final usage
        self.chunk_usage = True
        return completion

    @property
    def output_tokens(self) -> int:
        return self.usage_total if self.usage_total is not None else self.count

    def final_prompt_tokens(self) -> int | None:
        # A usage chunk told it already, else the last token chunk's (per-chunk) usage does.
        if self.prompt_tokens is not None or not self.last_payload:
            return self.prompt_tokens
        last = parse_sse_payload(self.last_payload)
        return None if last is SSE_DONE else openai_usage(last)[0]  # type: ignore[arg-type]

    def count_error(self, max_tokens: int) -> str | None:
        reported = self.output_tokens
        if self.usage_total is not None and self.chunk_usage and self.usage_total != self.count:
            return (f"the server's final usage says {self.usage_total} completion tokens but its "
                    f"per-chunk usage reached {self.count}: it contradicts itself, so TPOT and "
                    f"throughput from its counts would be false — the request is failed")
        try:
            check_count_within(reported, max_tokens, f"a request of max tokens {max_tokens}")
        except StageError as exc:
            return str(exc)
        return None


class OpenAITextTokenStream(OpenAITokenStream):
    """A stream that ends at its finish chunk with ``usage`` (transformers serve sends no ``[DONE]``);
    a ``[DONE]`` that does come is taken too. A stream cut before that chunk stays not done."""

    __slots__ = ()
    ends_at_final_usage: ClassVar[bool] = True


class OpenAIBatchTally(BatchTally):
    """A streamed ``/v1/completions`` with a list of prompts: one choice per prompt ``index``;
    the batch's count is the final ``usage``, held to ``batch_size * max_tokens``."""

    def __init__(self, protocol: WireProtocol, batch_size: int, max_tokens: int) -> None:
        super().__init__(protocol, batch_size, max_tokens)
        self.usage_completion: int | None = None

    def _without_events(self, chunk: dict[str, Any]) -> None:
        self.usage_completion = openai_usage(chunk)[1]

    def check(self, case: str) -> None:
        super().check(case)
        if self.usage_completion is not None:
            check_count_within(self.usage_completion, self.batch_size * self.max_tokens, f"the batch {case}")

    def _counted_total(self) -> int | None:
        return self.usage_completion


def _choices(doc: Any, n: int, what: str) -> list[dict[str, Any]]:
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
        raise StageError(f"{what}: expected {n} choices from /v1/completions, got {str(doc)[:300]!r}")
    return sorted(choices, key=lambda c: int(c.get("index", 0)))


def _token_id(token: Any, what: str) -> int:
    if isinstance(token, int):
        return token
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token.removeprefix("token_id:"))
    raise StageError(f"{what}: the server named an output token {token!r} instead of its id; it must support "
                     f"vLLM's return_tokens_as_token_ids (tokens as 'token_id:<id>')")


def _require_model(model: str | None) -> str:
    if not model:
        raise ConfigError("the OpenAI protocol needs the served model's name; pass model=")
    return model


class OpenAIProtocol(WireProtocol):
    """OpenAI ``POST /v1/completions`` (vLLM, external OpenAI-compatible servers)."""

    name: ClassVar[str] = "openai"
    path: ClassVar[str] = COMPLETIONS_PATH
    needs_model: ClassVar[bool] = True
    no_logprobs_hint: ClassVar[str] = ("the server must support echo + logprobs on /v1/completions "
                                       "(choices[i].logprobs.token_logprobs, as vLLM)")

    def served_model(self, session: requests.Session, base_url: str, *, limit_s: float,
                     setting: str | None) -> str | None:
        return served_model_name(session, base_url, timeout_s=limit_s, setting=setting)

    def body(self, prompt: Prompt | list[Prompt], max_tokens: int, *, model: str | None = None,
             stream: bool | None, ignore_eos: bool | None = True, temperature: float = 0.0) -> dict[str, Any]:
        return openai_completions_body(_require_model(model), prompt, max_tokens, stream=stream,
                                       ignore_eos=ignore_eos, temperature=temperature)

    def has_output(self, doc: Any) -> bool:
        if not isinstance(doc, dict):
            return False
        choices = doc.get("choices") or []
        usage = doc.get("usage") or {}
        return (bool(choices) and isinstance(choices[0], dict) and bool(choices[0].get("text"))) \
            or bool(usage.get("completion_tokens"))

    def check_counts(self, doc: dict[str, Any], max_tokens: int, what: str) -> None:
        reported = (doc.get("usage") or {}).get("completion_tokens")
        if isinstance(reported, int):
            check_count_within(reported, max_tokens, what)

    def events(self, chunk: dict[str, Any]) -> list[StreamEvent]:
        return openai_events(chunk)

    def batch_tally(self, batch_size: int, max_tokens: int) -> BatchTally:
        return OpenAIBatchTally(self, batch_size, max_tokens)

    def token_stream(self) -> TokenStream:
        return OpenAITokenStream()

    def scoring_body(self, ctx_ids: Sequence[int], ending_ids: Sequence[Sequence[int]],
                     model: str | None = None) -> dict[str, Any]:
        # max_tokens=1 as lm-eval-harness does: some servers reject 0 with echo.
        return {"model": _require_model(model), "prompt": [list(ctx_ids) + list(e) for e in ending_ids],
                "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 1}

    def ending_logprobs(self, doc: Any, ctx_ids: Sequence[int], ending_ids: Sequence[Sequence[int]],
                        what: str) -> list[list[float]]:
        start = len(ctx_ids)
        per_ending = []
        for choice, ending in zip(_choices(doc, len(ending_ids), what), ending_ids):
            lp = choice.get("logprobs")
            values = lp.get("token_logprobs") if isinstance(lp, dict) else None
            if not isinstance(values, list) or len(values) < start + len(ending):
                raise StageError(f"{what}: no prompt log-probabilities in {str(choice)[:300]!r}; "
                                 f"{self.no_logprobs_hint}")
            per_ending.append([math.nan if v is None else float(v) for v in values[start:start + len(ending)]])
        return per_ending

    def greedy_body(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    model: str | None = None) -> dict[str, Any]:
        return {"model": _require_model(model), "prompt": [[int(t) for t in p] for p in prompts],
                "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 1,
                "return_tokens_as_token_ids": True}

    def greedy_outputs(self, doc: Any, n_prompts: int, what: str) -> list[tuple[list[int], list[float | None]]]:
        outputs = []
        for choice in _choices(doc, n_prompts, what):
            lp = choice.get("logprobs")
            tokens = lp.get("tokens") if isinstance(lp, dict) else None
            values = lp.get("token_logprobs") if isinstance(lp, dict) else None
            if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
                raise StageError(f"{what}: no output log-probabilities in {str(choice)[:300]!r}; "
                                 f"{self.no_logprobs_hint}")
            outputs.append(([_token_id(t, what) for t in tokens], [None if v is None else float(v) for v in values]))
        return outputs


def _text_prompt(prompt: Prompt | list[Prompt]) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise ConfigError("the openai-text protocol sends one prompt per request: its servers refuse a list of "
                          "prompts (400); the one-batch stage needs an engine with takes_prompt_batches")
    raise ConfigError("the openai-text protocol sends text prompts only (its servers refuse token ids: 400); "
                      "decode token-id prompts with the model's tokenizer before the clock starts "
                      "(servegate.bench.datasets.as_text_prompts)")


class OpenAITextProtocol(OpenAIProtocol):
    """``POST /v1/completions`` as servers that follow OpenAI's schema strictly serve it
    (transformers serve): one text prompt per request, no ``ignore_eos`` (outputs are *up to*
    ``max_tokens``), no ``continuous_usage_stats``, and a stream that ends at its finish chunk with
    ``usage`` (a ``[DONE]`` is taken too). The module's docstring says what that changes."""

    name: ClassVar[str] = "openai-text"
    needs_text_prompts: ClassVar[bool] = True

    def body(self, prompt: Prompt | list[Prompt], max_tokens: int, *, model: str | None = None,
             stream: bool | None, ignore_eos: bool | None = True, temperature: float = 0.0) -> dict[str, Any]:
        # ignore_eos is not sent whatever is asked: the server refuses the field (422).
        return openai_completions_body(_require_model(model), _text_prompt(prompt), max_tokens, stream=stream,
                                       ignore_eos=None, temperature=temperature, continuous_usage=False)

    def batch_tally(self, batch_size: int, max_tokens: int) -> BatchTally:
        raise ConfigError("the openai-text protocol sends one prompt per request: no batched request to tally; "
                          "the one-batch stage needs an engine with takes_prompt_batches")

    def token_stream(self) -> TokenStream:
        return OpenAITextTokenStream()
