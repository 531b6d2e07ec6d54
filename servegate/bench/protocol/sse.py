"""Server-Sent Events, the framing both generation protocols stream in.

``data: {json}`` events ending with ``data: [DONE]``. Two ways to read a stream: line by line
(``parse_sse_line``: simple, for the one-batch stage and tests) and ``SSEDecoder``, which splits
whatever bytes arrived into event payloads at the bytes level (the serving load generator's
hot path: the common one-line event costs a split and a slice).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from servegate.errors import StageError

__all__ = ["SSE_DONE", "parse_sse_line", "parse_sse_payload", "SSEDecoder"]


class _Done:
    """Sentinel type for the ``data: [DONE]`` line."""

    def __repr__(self) -> str:
        return "SSE_DONE"


SSE_DONE: Final = _Done()


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
