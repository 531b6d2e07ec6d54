"""Streamed POSTs for the serving load generator: asyncio + httptools, bytes to a sink.

``StreamingClient`` keeps keep-alive HTTP/1.1 connections on the running event loop,
parses responses with httptools (llhttp) and hands body bytes to a ``StreamSink`` straight
from the socket callback — no per-chunk future, task switch or stream buffer. aiohttp costs
~10 µs of client CPU per streamed chunk in its stream reader alone (measured with
``benchmarks/loadgen_cost.py``), more than the whole budget of issue 7; what the bytes mean
is the wire protocol's business (``servegate.bench.protocol``: a ``TokenStream`` is a sink).

Transport failures are mapped by ``errors`` like every other request's: a refused connect or
a stream cut before ``[DONE]`` is ``ServerUnreachableError``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

try:  # a dependency of the serving stage only; the rest of the package imports without it
    import httptools
except ImportError:  # pragma: no cover - depends on the environment
    httptools = None

from servegate.errors import ServerUnreachableError, StageError
from servegate.http.errors import connection_lost_error, unreachable_as_error
from servegate.http.session import api_key_headers

__all__ = ["StreamSink", "StreamingClient"]


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
                self.failure = connection_lost_error(exc, self.got_bytes)
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

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
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
        extra = "".join(f"{k}: {v}\r\n" for k, v in api_key_headers(api_key).items())
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
            raise unreachable_as_error("streamed POST", f"{self.host}:{self.port}", exc) from exc
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
