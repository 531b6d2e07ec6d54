"""What every wire protocol provides (``WireProtocol``) and what the two share.

A stage never asks which protocol it speaks: it asks the ``WireProtocol`` of its engine
(``protocol_for``) for the URL, a request body, the meaning of a streamed chunk, a checked
token count or a log-probability. The per-request objects a protocol hands out —
``TokenStream`` (the serving load generator's byte-level stream reader) and ``BatchTally``
(the one-batch stage's per-prompt progress) — keep the protocol's state for one request.

Token counts are the server's own, and they are checked, not trusted (issue 11: a server
whose ``usage`` claimed more tokens than it streamed got a pass with a TPOT of 1.3 ms against
an honest 20 ms). A count that fails a check makes the request a failed one (``StageError``),
never a measured one. The check every protocol shares is ``check_count_within``: no server may
report more completion tokens than the request asked for. The others are the protocol's own
(see ``native`` and ``openai``).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import requests

from servegate.bench.protocol.sse import SSEDecoder
from servegate.errors import StageError

__all__ = [
    "Prompt",
    "StreamEvent",
    "WireProtocol",
    "TokenStream",
    "BatchTally",
    "check_count_within",
    "chunk_error",
    "last_completion_tokens",
]

_COMPLETION_KEY = b'"completion_tokens":'
_INT_AFTER_KEY = re.compile(rb"\s*(\d+)")


def last_completion_tokens(payload: bytes) -> int | None:
    """The last ``"completion_tokens":`` counter of a stream chunk, read at the bytes level (SGLang's
    ``meta_info`` or OpenAI's ``usage``: both protocols spell it alike).

    The key cannot occur inside a JSON string (its quotes would be escaped), so the last match is
    the server's counter. None when the chunk has none (an error chunk, a server that does not
    send it, another spacing): the caller then decodes the chunk.
    """
    k = payload.rfind(_COMPLETION_KEY)
    if k < 0:
        return None
    m = _INT_AFTER_KEY.match(payload, k + len(_COMPLETION_KEY))
    return int(m.group(1)) if m else None


Prompt = list[int] | str
"""One prompt: token ids (no tokenizer needed on the client) or text."""


@dataclass(frozen=True)
class StreamEvent:
    """Progress of one request (``index`` within a batch) seen in one stream chunk."""

    index: int
    completion_tokens: int | None
    """Cumulative output tokens as the server reports them; None when the chunk has no count."""
    prompt_tokens: int | None
    finished: bool
    output_ids: int | None = None
    """How many ``output_ids`` the chunk carries (native; None when it has none)."""


def chunk_error(data: dict[str, Any]) -> None:
    """``StageError`` when a stream chunk is the server's error report (``{"error": ...}``)."""
    err = data.get("error")
    if err:
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise StageError(f"server reported an error in the stream: {msg}")


def check_count_within(reported: int, max_tokens: int, what: str = "the request") -> None:
    """``StageError`` when a server reports more completion tokens than ``what`` asked for."""
    if reported > max_tokens:
        raise StageError(
            f"the server reported {reported} completion tokens for {what}, which asked for at most "
            f"{max_tokens}: it claims tokens it cannot have generated, so TPOT and throughput from its "
            f"counts would be false — the request is failed; the server's token accounting is broken")


class TokenStream(abc.ABC):
    """One streamed request as the serving load generator reads it: a ``StreamSink`` fed body
    bytes straight from the socket callback.

    Per token-bearing chunk it keeps only when its bytes arrived (``times``) and the cumulative
    output-token count after it (``counts``); latencies are computed once at the end, not per
    chunk. Subclasses (one per protocol) read the count out of each event payload in
    ``_take``, the load generator's hot path: a few bytes operations or one ``orjson.loads``.
    """

    __slots__ = ("decoder", "times", "counts", "count", "done", "end_ts", "last_payload", "prompt_tokens")

    def __init__(self) -> None:
        self.decoder = SSEDecoder()
        self.times: list[float] = []
        self.counts: list[int] = []
        self.count = 0
        self.done = False
        self.end_ts = float("nan")
        """When the last byte that mattered arrived: the [DONE] event, else the last body bytes."""
        self.last_payload = b""
        """The last token-bearing chunk, decoded in full once the stream ended."""
        self.prompt_tokens: int | None = None
        """The prompt's length as a chunk reported it while streaming (None: not yet)."""

    def feed(self, data: bytes, ts: float) -> bool:
        """Take body bytes that arrived at ``ts``; True once the stream is complete (``[DONE]``, or
        what ends it in the protocol's dialect: ``OpenAITextTokenStream``)."""
        return self._take(self.decoder.feed(data), ts)

    def close(self) -> None:
        """Take an event the server ended without its blank line."""
        if not self.done:
            self._take(self.decoder.close(), self.end_ts)

    @abc.abstractmethod
    def _take(self, payloads: list[bytes], ts: float) -> bool:
        """Count the tokens of the event payloads that arrived at ``ts``; True after ``[DONE]``."""

    def _arrived(self, ts: float, count: int) -> None:
        """Record that the cumulative count reached ``count`` at ``ts``.

        One arrival per read, however many events it held: they came at the same instant as far as
        the client can tell, so the gap since the previous read is spread over all their tokens
        (ITL), never a run of zero gaps. A read may reach ``feed`` several times with one ``ts``
        (each HTTP chunk of a chunked body is its own callback, and a busy client reads several
        chunks at once): those are merged into one arrival too.
        """
        if self.times and self.times[-1] == ts:
            self.counts[-1] = count
        else:
            self.times.append(ts)
            self.counts.append(count)

    @property
    def output_tokens(self) -> int:
        """The request's output tokens as the server counted them."""
        return self.count

    @abc.abstractmethod
    def final_prompt_tokens(self) -> int | None:
        """The prompt's length as the server counted it, once the stream ended (may decode the
        last chunk; ``StageError`` when that chunk is malformed)."""

    @abc.abstractmethod
    def count_error(self, max_tokens: int) -> str | None:
        """Why the server's token count cannot be trusted (the protocol's checks), or None."""


class BatchTally(abc.ABC):
    """One streamed batched request as the one-batch stage reads it: per prompt ``index``, when
    its first token arrived and its cumulative count; checked at the end (``check``).

    Feed every decoded chunk with ``take``. The protocol's subclass decides what a chunk holds
    and which counts are checked against what.
    """

    def __init__(self, protocol: WireProtocol, batch_size: int, max_tokens: int) -> None:
        self.protocol = protocol
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.first_token_at: dict[int, float] = {}
        self.tokens: dict[int, int] = {}

    def take(self, chunk: dict[str, Any], now: float) -> None:
        """One decoded stream chunk that arrived at ``now``; ``StageError`` on an error chunk."""
        events = self.protocol.events(chunk)
        if not events:
            self._without_events(chunk)
        for ev in events:
            self.first_token_at.setdefault(ev.index, now)
            if ev.completion_tokens is not None:
                self.tokens[ev.index] = ev.completion_tokens
                self._count(ev)

    def _without_events(self, chunk: dict[str, Any]) -> None:
        """A chunk that advanced no prompt (e.g. an OpenAI usage summary)."""

    def _count(self, ev: StreamEvent) -> None:
        """A prompt's count advanced (``ev.completion_tokens`` is not None)."""

    def check(self, case: str) -> None:
        """After ``[DONE]``: ``StageError`` when a count is not believable (``case`` names the request)."""
        for index, count in self.tokens.items():
            self._check_prompt(index, count)
            check_count_within(count, self.max_tokens, f"prompt {index} of {case}")

    def _check_prompt(self, index: int, count: int) -> None:
        """The protocol's own check of one prompt's final count."""

    def output_tokens(self) -> int:
        """The batch's output tokens: the server's count, ``batch_size * max_tokens`` when it gave none."""
        counted = self._counted_total()
        return counted if counted is not None else self.batch_size * self.max_tokens

    @abc.abstractmethod
    def _counted_total(self) -> int | None:
        """The batch's output tokens as the server counted them, None when it did not."""


class WireProtocol(abc.ABC):
    """How the gate talks to a generation endpoint: one object per protocol (``native``, ``openai``).

    Stateless; the per-request state lives in the ``TokenStream`` and ``BatchTally`` it makes.
    """

    name: ClassVar[str]
    """The engine's ``protocol`` attribute (and the ``protocol`` column of result tables)."""
    path: ClassVar[str]
    """The generation route, e.g. ``/generate``."""
    needs_model: ClassVar[bool]
    """Whether every request body must name the served model (``served_model``)."""
    no_logprobs_hint: ClassVar[str]
    """What the server must support for the quality stage's log-probability requests."""
    needs_text_prompts: ClassVar[bool] = False
    """Whether the server takes text prompts only: token-id prompts must be decoded with the model's
    tokenizer before the clock starts (``servegate.bench.datasets.as_text_prompts``; the serving
    stage's run function loads that tokenizer once per run)."""

    def url(self, base_url: str) -> str:
        return base_url.rstrip("/") + self.path

    def served_model(self, session: requests.Session, base_url: str, *, limit_s: float,
                     setting: str | None) -> str | None:
        """The model name request bodies must carry (None: the protocol needs none, no request made)."""
        return None

    # -- requests ---------------------------------------------------------------------------
    @abc.abstractmethod
    def body(self, prompt: Prompt | list[Prompt], max_tokens: int, *, model: str | None = None,
             stream: bool | None, ignore_eos: bool | None = True, temperature: float = 0.0) -> dict[str, Any]:
        """A generation request for one prompt or a batch (a list of prompts, one request).

        ``stream``/``ignore_eos`` None leave the field out (the server's default).
        """

    # -- whole (non-streamed) answers ------------------------------------------------------------
    @abc.abstractmethod
    def has_output(self, doc: Any) -> bool:
        """Whether a non-streamed answer carries any generated output."""

    @abc.abstractmethod
    def check_counts(self, doc: dict[str, Any], max_tokens: int, what: str) -> None:
        """``StageError`` when a non-streamed answer's completion-token count is not believable."""

    # -- streams ------------------------------------------------------------------------------
    @abc.abstractmethod
    def events(self, chunk: dict[str, Any]) -> list[StreamEvent]:
        """One decoded stream chunk -> an event per request index it advanced (``StageError``
        on an error chunk or a malformed one)."""

    @abc.abstractmethod
    def batch_tally(self, batch_size: int, max_tokens: int) -> BatchTally:
        """Per-prompt progress of one streamed batched request (one-batch)."""

    @abc.abstractmethod
    def token_stream(self) -> TokenStream:
        """The byte-level reader of one streamed request (the serving load generator)."""

    # -- log-probabilities (quality) --------------------------------------------------------------
    @abc.abstractmethod
    def scoring_body(self, ctx_ids: Sequence[int], ending_ids: Sequence[Sequence[int]],
                     model: str | None = None) -> dict[str, Any]:
        """One request scoring every ending of an item: prompt log-probabilities of ``ctx + ending``."""

    @abc.abstractmethod
    def ending_logprobs(self, doc: Any, ctx_ids: Sequence[int], ending_ids: Sequence[Sequence[int]],
                        what: str) -> list[list[float]]:
        """Each ending's per-token log-probabilities from the answer to ``scoring_body`` (NaN where
        the server gave none); ``StageError`` naming ``what`` when the answer has none."""

    @abc.abstractmethod
    def greedy_body(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    model: str | None = None) -> dict[str, Any]:
        """One batched greedy request (EOS ignored) asking for each output token's log-probability."""

    @abc.abstractmethod
    def greedy_outputs(self, doc: Any, n_prompts: int, what: str) -> list[tuple[list[int], list[float | None]]]:
        """``(output ids, their log-probabilities)`` per prompt, in prompt order, from the answer to
        ``greedy_body``; ``StageError`` naming ``what`` when the answer has none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
