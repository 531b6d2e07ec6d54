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

Those counters are checked, not trusted (issue 11: a server whose ``usage`` claimed more
tokens than it streamed got a pass with a TPOT of 1.3 ms against an honest 20 ms). A request
whose count fails a check is a failed request (``StageError``), never a measured one:

- any protocol: the final count must not exceed the ``max_new_tokens``/``max_tokens`` the
  request asked for (``check_count_within``): no server may generate more;
- native, when chunks carry ``output_ids`` (SGLang and the embedded worker do): the final
  ``completion_tokens`` must equal the number of output ids streamed — the last chunk's
  (SGLang's default, cumulative ids) or their sum over the chunks (``--stream-output``,
  incremental ids); see ``NativeCountCheck``. This holds whatever the tokens per chunk. A
  count that goes down within a stream is rejected too;
- openai: a chunk may carry several tokens (vLLM groups them under speculative decoding or a
  stream interval) and only its text, which the client does not tokenize, so the number of
  chunks bounds nothing. What is checked: the bound above, and that the final ``usage`` agrees
  with the last per-chunk cumulative ``usage`` (``continuous_usage_stats``) when the server
  sends both. An OpenAI server that claims no more than was asked but streams fewer tokens
  cannot be caught without a tokenizer (or logprobs, which cost the server time).

Two ways to read a stream: line by line (``parse_sse_line`` + ``native_event`` /
``openai_events``: simple, for the one-batch stage and tests), and the fast path the serving
load generator uses: ``StreamingClient`` (keep-alive HTTP/1.1 connections on the running
event loop, responses parsed by httptools/llhttp, body bytes handed to a ``StreamSink``
straight from the socket callback — no per-chunk future, task switch or stream buffer),
``SSEDecoder`` (splits whatever bytes arrived into event payloads at the bytes level) and
``native_completion_tokens`` (reads the cumulative token count out of an SGLang chunk
without decoding its cumulative text and ids, which are most of its bytes). aiohttp costs
~10 µs of client CPU per streamed chunk in its stream reader alone (measured with
``benchmarks/loadgen_cost.py``), more than the whole budget of issue 7.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol
from urllib.parse import urlsplit

import orjson
import requests

from servegate.http import request_within

try:  # a dependency of the serving stage only; the rest of the package imports without it
    import httptools
except ImportError:  # pragma: no cover - depends on the environment
    httptools = None

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
    "parse_sse_payload",
    "SSEDecoder",
    "native_completion_tokens",
    "native_output_id_count",
    "NativeCountCheck",
    "check_count_within",
    "StreamSink",
    "StreamingClient",
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
    return parse_sse_payload(line[5:].strip())


def parse_sse_payload(payload: bytes) -> dict[str, Any] | _Done:
    """The data of one SSE event: ``SSE_DONE`` for ``[DONE]``, else a JSON object (``StageError`` if not)."""
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


class SSEDecoder:
    """Incremental Server-Sent Events decoder: bytes as they arrive in, event data payloads out.

    ``feed`` takes any slice of the stream (an event may be split across reads, or a read may
    hold many events) and returns the ``data`` of every event completed so far, as bytes with
    the ``data:`` prefix and the optional space removed; several ``data:`` lines of one event
    are joined with ``\\n``, comments and other fields are dropped (the SSE spec). ``close``
    returns the data of an event the server ended without its blank line. The common event
    (one ``data: ...`` line) costs a split and a slice — no per-line Python loop.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        if (not self._buf and data.startswith(b"data: ") and data.find(b"\n") == len(data) - 2
                and data.endswith(b"\n\n") and b"\r" not in data):
            return [data[6:-2]]  # exactly one one-line event: what servers send per write
        buf = self._buf + data if self._buf else data
        tail = b""
        if b"\r" in buf:
            # CRLF (or lone CR) line ends are legal SSE: normalise to LF. A trailing CR may be
            # the first half of a CRLF split across reads, so it waits for the next read.
            if buf.endswith(b"\r"):
                buf, tail = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        blocks = buf.split(b"\n\n")
        self._buf = blocks.pop() + tail
        out = []
        for block in blocks:
            if block.startswith(b"data: ") and b"\n" not in block:
                out.append(block[6:])
            elif block:
                payload = _event_data(block)
                if payload is not None:
                    out.append(payload)
        return out

    def close(self) -> list[bytes]:
        rest, self._buf = self._buf.replace(b"\r", b"\n"), b""
        payload = _event_data(rest.strip(b"\n")) if rest.strip() else None
        return [payload] if payload is not None else []


def _event_data(block: bytes) -> bytes | None:
    """The ``data`` of one event block (lines without the blank separator), or None if it has none."""
    parts = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    if not parts:
        return None
    return b"\n".join(parts).strip()


_COMPLETION_KEY: Final = b'"completion_tokens":'
_INT_AFTER_KEY: Final = re.compile(rb"\s*(\d+)")


def native_completion_tokens(payload: bytes) -> int | None:
    """The cumulative ``completion_tokens`` of an SGLang ``/generate`` chunk, read at the bytes level.

    SGLang streams the cumulative ``text`` and ``output_ids`` in every chunk, so decoding each
    chunk costs O(tokens so far); this reads only the counter. The key cannot occur inside
    a JSON string (its quotes would be escaped), so the last match is ``meta_info``'s. None
    when the chunk has no such counter (an error chunk, or a server that does not send it):
    the caller then decodes the chunk with ``parse_sse_payload`` + ``native_event``.
    """
    k = payload.rfind(_COMPLETION_KEY)
    if k < 0:
        return None
    m = _INT_AFTER_KEY.match(payload, k + len(_COMPLETION_KEY))
    return int(m.group(1)) if m else None


_IDS_KEY: Final = b'"output_ids":'


def native_output_id_count(payload: bytes) -> int | None:
    """How many ``output_ids`` an SGLang ``/generate`` chunk carries, read at the bytes level
    (commas between the brackets, as ``native_completion_tokens`` reads the counter); None
    when the chunk has no ``output_ids`` list."""
    k = payload.rfind(_IDS_KEY)
    if k < 0:
        return None
    k += len(_IDS_KEY)
    start = payload.find(b"[", k)
    if start < 0 or payload[k:start].strip():
        return None
    end = payload.find(b"]", start)
    if end < 0:
        return None
    if end - start < 8 and not payload[start + 1:end].strip():
        return 0
    return payload.count(b",", start, end) + 1


def check_count_within(reported: int, max_tokens: int, what: str = "the request") -> None:
    """``StageError`` when a server reports more completion tokens than ``what`` asked for."""
    if reported > max_tokens:
        raise StageError(
            f"the server reported {reported} completion tokens for {what}, which asked for at most "
            f"{max_tokens}: it claims tokens it cannot have generated, so TPOT and throughput from its "
            f"counts would be false — the request is failed; the server's token accounting is broken")


class NativeCountCheck:
    """Holds one native stream's final ``completion_tokens`` to the ``output_ids`` it streamed.

    SGLang sends ``output_ids`` cumulatively by default and incrementally with
    ``--stream-output``, and a server may render a chunk while its engine appends a token
    (the embedded worker does), so a mid-stream chunk's count may run one ahead of its ids.
    Only the end is judged therefore: the final count must equal the last chunk's ids (a
    cumulative stream) or the ids summed over the stream (an incremental one). Feed every
    chunk with ``chunk(count, n_ids)`` while ``wants_ids``: the sum is kept only while it
    could still be the count (not larger) — a cumulative stream outgrows it by its second
    chunk, after which its ids need not be read; ``n_ids`` None (a chunk without
    ``output_ids``) turns the check off. Then ``finish`` with the last chunk's ids.
    """

    __slots__ = ("count", "ids_sum", "wants_ids", "off")

    def __init__(self) -> None:
        self.count = 0
        self.ids_sum = 0
        self.wants_ids = True
        """Whether the next chunk's ids still matter (a plain attribute: read once per chunk)."""
        self.off = False

    def chunk(self, count: int, n_ids: int | None) -> None:
        if count < self.count:
            raise StageError(f"the server's completion_tokens went down from {self.count} to {count} within one "
                             f"stream; a cumulative count never does — the server's token accounting is broken")
        self.count = count
        if n_ids is None:
            self.off, self.wants_ids = True, False
            return
        self.ids_sum += n_ids
        if self.ids_sum > count:
            self.wants_ids = False  # not incremental: cumulative (or lying), the last chunk decides

    def finish(self, count: int, last_chunk_ids: int | None) -> None:
        """After the stream: its final count and the ``output_ids`` of its last chunk."""
        if self.off or last_chunk_ids is None or count == last_chunk_ids:
            return
        if self.wants_ids and count == self.ids_sum:
            return
        streamed = (f"its last chunk carries {last_chunk_ids} output ids" if not self.wants_ids else
                    f"its output ids add up to neither ({last_chunk_ids} in its last chunk, as a cumulative "
                    f"stream sends them; {self.ids_sum} summed over its chunks, as an incremental one does)")
        raise StageError(f"the server reported {count} completion tokens but {streamed}: its token count "
                         f"disagrees with the tokens it sent, so TPOT and throughput from it would be false — "
                         f"the request is failed; the server's token accounting is broken")


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
        ids = data.get("output_ids")
        n_ids = len(ids) if isinstance(ids, list) else None
        completion = meta.get("completion_tokens")
        if completion is None:
            completion = n_ids
        prompt = meta.get("prompt_tokens")
        return StreamEvent(
            index=int(data.get("index", 0)),
            completion_tokens=int(completion) if completion is not None else None,
            prompt_tokens=int(prompt) if prompt is not None else None,
            finished=meta.get("finish_reason") is not None,
            output_ids=n_ids,
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


class StreamSink(Protocol):
    """Receives the body of a 200 response as it arrives (see ``StreamingClient.post_stream``)."""

    def feed(self, data: bytes, ts: float) -> bool:
        """Take body bytes that arrived at ``ts`` (``time.perf_counter``); True once the stream's
        ``[DONE]`` was seen. May raise ``StageError`` (the request is then failed)."""
        ...


_DONE_GRACE_S: Final = 0.05
"""After [DONE], how long to wait for the HTTP message to end before dropping the connection."""
_ERROR_BODY_LIMIT: Final = 64 * 1024


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one streamed request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser: Any = None
        self._sink: StreamSink | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._grace: asyncio.TimerHandle | None = None
        self._now = 0.0
        self.status = 0
        self.error_body = bytearray()
        self.got_bytes = False
        self.saw_done = False
        self.message_complete = False
        self.keep_alive = False
        self.failure: BaseException | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            return  # bytes after the request was given up (e.g. past [DONE]); the connection is dropped
        self._now = time.perf_counter()
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, StageError) else None
            self.failure = cause or StageError(
                f"malformed HTTP response ({exc}); check that the URL points at an HTTP/1.1 server")
        if self.failure is not None:
            self._finish()
        elif self.saw_done and not self.message_complete and self._grace is None:
            self._grace = self._loop.call_later(_DONE_GRACE_S, self._finish)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            # A 200 stream cut before [DONE] is the server going away; an error answer whose
            # body ends with the connection is still an answer (returned with its status).
            if not self.saw_done and self.status in (0, 200):
                self.failure = ServerUnreachableError(
                    f"the server closed the connection mid-request ({exc or 'EOF'}) after "
                    f"{'some' if self.got_bytes else 'no'} response bytes; check the server's log")
            self._finish()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            if len(self.error_body) < _ERROR_BODY_LIMIT:
                self.error_body += body
            return
        if self.failure is None and not self.saw_done:
            try:
                self.saw_done = self._sink.feed(body, self._now)  # type: ignore[union-attr]
            except StageError as exc:
                self.failure = exc

    def on_message_complete(self) -> None:
        self.message_complete = True
        self.keep_alive = bool(self._parser.should_keep_alive())
        self._finish()

    # request cycle
    def begin(self, request: bytes, sink: StreamSink) -> asyncio.Future[None]:
        self._parser = httptools.HttpResponseParser(self)
        self._sink = sink
        self._waiter = self._loop.create_future()
        self._grace = None
        self.status = 0
        self.error_body = bytearray()
        self.got_bytes = self.saw_done = self.message_complete = self.keep_alive = False
        self.failure = None
        assert self.transport is not None
        self.transport.write(request)
        return self._waiter

    def _finish(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
        if self._waiter is not None and not self._waiter.done():
            if self.failure is not None:
                self._waiter.set_exception(self.failure)
            else:
                self._waiter.set_result(None)

    @property
    def reusable(self) -> bool:
        return self.message_complete and self.keep_alive and not self.closed and self.failure is None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True


class StreamingClient:
    """Keep-alive HTTP/1.1 connections to one server for streamed POSTs, on the running loop.

    Idle connections are reused (one request at a time each); a reused connection the server
    had already closed is retried once on a new one, before any response byte arrived. Use
    ``async with StreamingClient(base_url) as client`` so that every connection is closed.
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        if httptools is None:
            raise StageError("the serving load generator needs the httptools package; "
                             "install it with `pip install httptools`")
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StageError(f"cannot stream from {base_url!r}: the URL must be http(s)://host[:port]")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        host_header = self.host if parts.port is None else f"{self.host}:{self.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = (f"Host: {host_header}\r\nAccept: text/event-stream\r\n"
                      f"Content-Type: application/json\r\n{extra}").encode("latin-1")
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    async def __aenter__(self) -> "StreamingClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._idle.clear()

    def request_bytes(self, path: str, body: bytes) -> bytes:
        """The whole HTTP request for ``body``; build it once, send it with ``post_stream``."""
        return (b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
                % ((self._prefix + path).encode("latin-1"), self._head, len(body), body))

    async def _acquire(self) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, True
            self._all.discard(conn)
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(loop), self.host, self.port, ssl=self._ssl)
        except OSError as exc:
            raise ServerUnreachableError(f"cannot connect to {self.host}:{self.port} ({exc}); check that "
                                         f"the server is running and the URL is right") from exc
        self._all.add(conn)
        return conn, False

    async def post_stream(self, request: bytes, sink: StreamSink) -> tuple[int, bytes, bool]:
        """Send ``request`` (from ``request_bytes``); (HTTP status, error body, the message ended).

        A 200 body goes to ``sink`` as it arrives; another status's body (up to 64 KiB) is
        returned. Raises ``ServerUnreachableError`` when the connection fails or is lost before
        ``[DONE]``, ``StageError`` when the response is not HTTP or the sink rejects a chunk.
        Cancellation (e.g. a timeout around the call) drops the connection.
        """
        for attempt in (0, 1):
            conn, reused = await self._acquire()
            try:
                await conn.begin(request, sink)
            except ServerUnreachableError:
                self._drop(conn)
                if reused and not conn.got_bytes and attempt == 0:
                    continue  # the server closed this idle keep-alive connection: not a failure
                raise
            except BaseException:
                self._drop(conn)
                raise
            if conn.reusable:
                self._idle.append(conn)
            else:
                self._drop(conn)
            return conn.status, bytes(conn.error_body), conn.message_complete
        raise AssertionError("unreachable")  # pragma: no cover

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._all.discard(conn)


def fetch_model_name(session: requests.Session, base_url: str, api_key: str | None = None,
                     timeout_s: float = 30.0, setting: str | None = None) -> str:
    """The served model's id from ``GET /v1/models`` (the OpenAI protocol needs it in every body).

    ``timeout_s`` bounds the whole request; ``setting`` names the config field that sets it.
    """
    url = base_url.rstrip("/") + "/v1/models"
    resp = request_within(session, "GET", url, limit_s=timeout_s, what=f"GET {url}", setting=setting,
                          headers=auth_headers(api_key))
    if resp.status_code != 200:
        raise StageError(f"GET {url} answered {resp.status_code}: {resp.text[:300]}; the OpenAI "
                         f"protocol needs /v1/models to name the model")
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise StageError(f"GET {url} returned no model id ({resp.text[:300]!r}); "
                         f"the server must list its model under data[0].id") from exc
