"""A streaming server that does almost no work per chunk, for measuring load-generator clients.

It speaks just enough HTTP/1.1 (keep-alive, chunked transfer encoding) on a raw asyncio
protocol to serve:

- ``POST /generate`` — SGLang-native SSE: every chunk carries the *cumulative* ``text`` and
  ``output_ids`` and a ``meta_info`` with ``prompt_tokens``, ``completion_tokens`` and
  ``finish_reason``, as SGLang streams by default (so a client that parses every chunk pays
  for O(n) bytes per chunk, as it does against a real SGLang);
- ``POST /v1/completions`` — OpenAI SSE, one token of text per chunk, a cumulative ``usage``
  per chunk when ``stream_options.continuous_usage_stats`` is asked for, and the
  ``include_usage`` summary chunk before ``data: [DONE]``;
- ``GET /v1/models``, ``GET /health``, ``GET /health_generate``.

Every chunk is pre-encoded once per (protocol, output length, prompt length); serving a
chunk is one ``transport.write``. Chunks are paced like a batched engine: one "decode step"
every ``--step-ms`` writes the next chunk of every running stream, each with its own write,
so that the client sees one chunk per socket read as it would against a GPU server (a server
that writes as fast as it can lets chunks coalesce in the socket and flatters the client).

Run it in its own process::

    python benchmarks/near_free_server.py --port 0 --tokens 256 --step-ms 1

It prints ``READY <port>`` on stdout once it listens, and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import socket
import sys
from typing import Final

import orjson

try:  # the server must not be the bottleneck: use the fastest loop available
    import uvloop
except ImportError:  # pragma: no cover - uvloop is optional
    uvloop = None

MODEL: Final = "near-free"
_MAX_NEW_RE: Final = re.compile(rb'"max_(?:new_)?tokens"\s*:\s*(\d+)')
_CONTINUOUS_RE: Final = re.compile(rb'"continuous_usage_stats"\s*:\s*true')
_INCLUDE_USAGE_RE: Final = re.compile(rb'"include_usage"\s*:\s*true')
_STREAM_FALSE_RE: Final = re.compile(rb'"stream"\s*:\s*false')
_SSE_HEADERS: Final = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                       b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")


def _token(step: int) -> int:
    return 1000 + (step * 7) % 5000


def _frame(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk carrying ``payload``."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse(obj: object) -> bytes:
    return _frame(b"data: " + orjson.dumps(obj) + b"\n\n")


_DONE: Final = _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def native_chunks(n_tokens: int, prompt_tokens: int) -> list[bytes]:
    """The framed SSE chunks of one SGLang-native stream of ``n_tokens`` tokens, then [DONE]."""
    chunks = []
    for step in range(1, n_tokens + 1):
        ids = [_token(s) for s in range(1, step + 1)]
        chunks.append(_sse({
            "text": "".join(f" t{i}" for i in ids),
            "output_ids": ids,
            "meta_info": {
                "id": "0123456789abcdef0123456789abcdef",
                "finish_reason": {"type": "length", "length": n_tokens} if step == n_tokens else None,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": step,
                "cached_tokens": 0,
                "e2e_latency": 0.0,
            },
        }))
    chunks[-1] += _DONE
    return chunks


def openai_chunks(n_tokens: int, prompt_tokens: int, continuous_usage: bool, include_usage: bool) -> list[bytes]:
    """The framed SSE chunks of one ``/v1/completions`` stream, then the usage chunk and [DONE]."""
    chunks = []
    for step in range(1, n_tokens + 1):
        obj: dict[str, object] = {
            "id": "cmpl-near-free", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": f" t{_token(step)}", "logprobs": None,
                         "finish_reason": "length" if step == n_tokens else None}],
        }
        if continuous_usage:
            obj["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": step,
                            "total_tokens": prompt_tokens + step}
        chunks.append(_sse(obj))
    if include_usage:
        chunks[-1] += _sse({"id": "cmpl-near-free", "object": "text_completion", "created": 0, "model": MODEL,
                            "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                                                     "total_tokens": prompt_tokens + n_tokens}})
    chunks[-1] += _DONE
    return chunks


class _Stream:
    __slots__ = ("transport", "chunks", "pos")

    def __init__(self, transport: asyncio.Transport, chunks: list[bytes]) -> None:
        self.transport = transport
        self.chunks = chunks
        self.pos = 0


class NearFreeServer:
    """The chunk cache, the running streams and the decode-step ticker."""

    def __init__(self, default_tokens: int, step_s: float) -> None:
        self.default_tokens = default_tokens
        self.step_s = step_s
        self._cache: dict[tuple[object, ...], list[bytes]] = {}
        self._streams: list[_Stream] = []
        self._wake = asyncio.Event()

    def chunks(self, key: tuple[object, ...]) -> list[bytes]:
        cached = self._cache.get(key)
        if cached is None:
            if key[0] == "native":
                cached = native_chunks(key[1], key[2])  # type: ignore[arg-type]
            else:
                cached = openai_chunks(*key[1:])  # type: ignore[arg-type]
            self._cache[key] = cached
        return cached

    def start_stream(self, transport: asyncio.Transport, chunks: list[bytes]) -> None:
        transport.write(_SSE_HEADERS)
        self._streams.append(_Stream(transport, chunks))
        self._wake.set()

    async def tick(self) -> None:
        """One step writes the next chunk of every running stream, then waits ``step_s``."""
        while True:
            if not self._streams:
                self._wake.clear()
                await self._wake.wait()
            still = []
            for st in self._streams:
                if st.transport.is_closing():
                    continue
                st.transport.write(st.chunks[st.pos])
                st.pos += 1
                if st.pos < len(st.chunks):
                    still.append(st)
            self._streams = still
            await asyncio.sleep(self.step_s)


class _Http(asyncio.Protocol):
    """Minimal HTTP/1.1: request line, headers, a Content-Length body; keep-alive."""

    def __init__(self, server: NearFreeServer) -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
            self.handle(method, path.split("?", 1)[0], body)

    def respond(self, status: str, body: bytes, ctype: bytes = b"application/json") -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (status.encode(), ctype, len(body), body))

    def handle(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        if method == "GET" and path in ("/health", "/health_generate"):
            self.respond("200 OK", b"")
        elif method == "GET" and path == "/v1/models":
            self.respond("200 OK", orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        elif method == "POST" and path in ("/generate", "/v1/completions"):
            if _STREAM_FALSE_RE.search(body) or b'"stream"' not in body:
                self.respond("400 Bad Request", b'{"error": {"message": "near_free_server only streams"}}')
                return
            m = _MAX_NEW_RE.search(body)
            n_tokens = int(m.group(1)) if m else self.server.default_tokens
            # A prompt of token ids: one more id than commas (cheap; exact for a flat id list).
            prompt_tokens = body.count(b",", body.find(b"["), body.find(b"]")) + 1
            if path == "/generate":
                key: tuple[object, ...] = ("native", n_tokens, prompt_tokens)
            else:
                key = ("openai", n_tokens, prompt_tokens, bool(_CONTINUOUS_RE.search(body)),
                       bool(_INCLUDE_USAGE_RE.search(body)))
            self.server.start_stream(self.transport, self.server.chunks(key))
        else:
            self.respond("404 Not Found", b'{"error": {"message": "not found"}}')


async def serve(host: str, port: int, default_tokens: int, step_s: float) -> None:
    server = NearFreeServer(default_tokens, step_s)
    srv = await asyncio.get_running_loop().create_server(lambda: _Http(server), host, port, backlog=1024)
    ticker = asyncio.create_task(server.tick())
    print(f"READY {srv.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    ticker.cancel()
    srv.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed as READY <port>)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request when the body names none")
    parser.add_argument("--step-ms", type=float, default=1.0,
                        help="decode step: every running stream gets one chunk per step (0: as fast as possible)")
    args = parser.parse_args(argv)
    if uvloop is not None:
        uvloop.install()
    asyncio.run(serve(args.host, args.port, args.tokens, args.step_ms / 1000.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
