"""Real local HTTP servers (stdlib http.server in a thread) that behave like engine control APIs.

``FakeServer`` serves SGLang's /flush_cache (held until "idle" or the timeout, like SGLang),
vLLM's /reset_prefix_cache, /generate, /v1/completions, /v1/models, /health*, and
/server_info|/get_server_info, each switchable per test. Every request is recorded.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


@dataclass
class FakeState:
    busy_until: float = 0.0
    """monotonic time until which the server has running requests (SGLang flush waits for it)."""
    vllm_refuse_until: float = 0.0
    """/reset_prefix_cache answers {"success": false} until this monotonic time."""
    routes_missing: set[str] = field(default_factory=set)
    """paths answered with 404."""
    generate_status: int = 200
    generate_body: Any = None
    """/generate and /v1/completions body override (None: a normal answer)."""
    server_info: dict[str, Any] | None = None
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    requests: list[Recorded] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, body: Any = None) -> None:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> tuple[str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        query = parse_qs(parts.query)
        self.server.state.requests.append(Recorded(self.command, parts.path, query, dict(self.headers), body))
        return parts.path, query

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def _route(self) -> None:
        state = self.server.state
        path, query = self._record()
        if path in state.routes_missing:
            return self._send(404, {"detail": "Not Found"})
        if path in ("/health", "/health_generate"):
            return self._send(200)
        if path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in state.models]})
        if path == "/flush_cache":
            timeout = float(query.get("timeout", ["0"])[0])
            deadline = time.monotonic() + timeout
            # Like SGLang: hold the request until idle or the timeout.
            while time.monotonic() < state.busy_until and time.monotonic() < deadline:
                time.sleep(0.02)
            if time.monotonic() < state.busy_until:
                return self._send(400, b"Cache not flushed: there are running requests.")
            return self._send(200, b"Cache flushed.")
        if path == "/reset_prefix_cache":
            if time.monotonic() < state.vllm_refuse_until:
                return self._send(200, {"success": False})
            return self._send(200, {"success": True})
        if path in ("/server_info", "/get_server_info"):
            if state.server_info is None:
                return self._send(404, {"detail": "Not Found"})
            return self._send(200, state.server_info)
        if path == "/generate":
            if state.generate_body is not None or state.generate_status != 200:
                return self._send(state.generate_status, state.generate_body)
            return self._send(200, {"text": " Paris.", "output_ids": [1, 2],
                                    "meta_info": {"id": "x", "completion_tokens": 2, "finish_reason": "length"}})
        if path == "/v1/completions":
            if state.generate_body is not None or state.generate_status != 200:
                return self._send(state.generate_status, state.generate_body)
            return self._send(200, {"choices": [{"text": " Paris.", "index": 0}],
                                    "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
        return self._send(404, {"detail": "Not Found"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: FakeState

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out on purpose (tests of HTTP timeouts) closes the socket before the
        # answer; that is expected, anything else is printed as usual.
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class FakeServer:
    """Start with ``with FakeServer() as srv:``; ``srv.url``, ``srv.state``."""

    def __init__(self) -> None:
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.state = FakeState()
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def state(self) -> FakeState:
        return self._httpd.state

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def requests_to(self, path: str) -> list[Recorded]:
        return [r for r in self.state.requests if r.path == path]

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
