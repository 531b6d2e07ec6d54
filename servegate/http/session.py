"""Blocking HTTP: the one session factory, whole-request deadlines, JSON helpers.

Every blocking HTTP request servegate makes goes through a session from ``make_session``
(which sends the API key) and, for requests that talk to the model, through
``request_within`` or ``stream_within``, which bound the *whole* request: from sending it
to its last byte. ``requests``' own ``timeout`` bounds each socket read, so a server that
sends a byte every few seconds never trips it (issue 11: a 10 s warm-up timeout let a
dripping server hold the gate for 60 s, then pass). Here a watchdog shuts the request's
socket down when its deadline passes, which ends whatever read is waiting, and the request
fails with ``StageError`` naming the request, the limit and the config field to raise.

Connection failures are mapped to ``ServerUnreachableError`` here, at the boundary (by
``errors.unreachable_as_error``), so that no ``requests`` exception leaks out of servegate.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from servegate.errors import StageError
from servegate.http.errors import deadline_error, unreachable_as_error

__all__ = [
    "api_key_headers",
    "make_session",
    "ThreadSessions",
    "join_url",
    "request_within",
    "stream_within",
    "served_model_name",
    "json_body",
    "body_excerpt",
]


# ----------------------------------------------------------------------------- deadlines

_pending = threading.local()
"""The ``_Cutoff`` of the request this thread is sending, while ``session.request`` runs."""


class _Cutoff:
    """Shuts a request's socket down once its deadline passes (from a ``threading.Timer``).

    ``shutdown`` makes a ``recv`` blocked in another thread return at once, so the request
    ends whether the server is silent, sends its headers slowly or drips its body.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.fired = False

    def attach(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._sock = sock
            if self.fired:
                _shutdown(sock)

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            if self._sock is not None:
                _shutdown(self._sock)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _TracedHTTPConnection(HTTPConnection):
    """Hands its socket to the request in flight on this thread, so that its deadline covers
    the status line and headers too (the response object, and its socket, exist only after)."""

    def request(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        cutoff = getattr(_pending, "cutoff", None)
        if cutoff is not None:
            cutoff.attach(self.sock)  # a kept-alive connection: its socket exists already
        try:
            super().request(*args, **kwargs)
        finally:
            if cutoff is not None:
                cutoff.attach(self.sock)  # a new connection: connected while sending


class _TracedHTTPSConnection(_TracedHTTPConnection, HTTPSConnection):
    pass


class _TracedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _TracedHTTPConnection


class _TracedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _TracedHTTPSConnection


class _DeadlineAdapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _TracedHTTPPool, "https": _TracedHTTPSPool}


def api_key_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer <api_key>`` when a key is given (SGLang and the embedded worker
    require it on every route but health and metrics, vLLM on its ``/v1`` routes).

    The one place the header is spelled: ``make_session`` sends it on every request, and the
    serving load generator's ``StreamingClient`` takes it from here too.
    """
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_session(api_key: str | None = None) -> requests.Session:
    """The session every stage uses: sends the API key (``api_key_headers``) on every request,
    and lets ``request_within``/``stream_within`` bound a request's status line and headers as
    well as its body. A stage given a session by its caller relies on it carrying the key."""
    session = requests.Session()
    adapter = _DeadlineAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.headers.update(api_key_headers(api_key))
    return session


class ThreadSessions:
    """One ``make_session`` session per thread (a ``requests.Session`` is not thread-safe),
    all closed together: ``with ThreadSessions(api_key) as sessions: sessions.get()``."""

    def __init__(self, api_key: str | None = None) -> None:
        self._api_key = api_key
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    def get(self) -> requests.Session:
        """This thread's session (made on first use)."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = make_session(self._api_key)
            with self._lock:
                self._sessions.append(session)
        return session

    def close(self) -> None:
        with self._lock:
            for session in self._sessions:
                session.close()
            self._sessions.clear()

    def __enter__(self) -> "ThreadSessions":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@contextlib.contextmanager
def stream_within(session: requests.Session, method: str, url: str, *, limit_s: float, what: str,
                  setting: str | None, hint: str = "", **kwargs: Any) -> Iterator[requests.Response]:
    """Send a request and yield its response (headers read, body not yet) to be read in the
    ``with`` block; the whole request — send, headers, every body byte — must end within
    ``limit_s`` seconds.

    When the deadline passes the socket is shut down and ``RequestDeadlineError`` (a
    ``StageError``) is raised, naming
    ``what`` (e.g. ``"warmup request 2/3 (POST http://…/generate)"``), the limit and
    ``setting`` (the config field that sets it; None when the limit is fixed). A transport
    failure before the deadline is ``ServerUnreachableError`` (with ``hint`` on what to do).
    Leaving the block closes the response; a body left unread is dropped with its connection.
    """
    if not limit_s > 0:
        raise StageError(f"{what}: the request deadline must be > 0 s, got {limit_s!r}; set {setting or 'it'}")
    cutoff = _Cutoff()
    started = time.monotonic()
    timer = threading.Timer(limit_s, cutoff.fire) if math.isfinite(limit_s) else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    response: requests.Response | None = None
    try:
        _pending.cutoff = cutoff
        try:
            # The read timeout is the whole limit: no single wait may outlast the request's.
            timeout = (limit_s, limit_s) if timer is not None else None
            response = session.request(method, url, stream=True, timeout=timeout, **kwargs)
        finally:
            _pending.cutoff = None
        # A session not from make_session: the deadline covers the body from here on.
        cutoff.attach(getattr(getattr(response.raw, "connection", None), "sock", None))
        yield response
    except (OSError, StageError) as exc:  # requests' exceptions are OSErrors
        if cutoff.fired or isinstance(exc, requests.ReadTimeout) or time.monotonic() - started > limit_s:
            raise deadline_error(what, limit_s, time.monotonic() - started, setting) from exc
        if not isinstance(exc, requests.RequestException):
            raise
        raise unreachable_as_error(what, url, exc, hint, limit_s=limit_s) from exc
    finally:
        if timer is not None:
            timer.cancel()
        if response is not None:
            response.close()
    if cutoff.fired or time.monotonic() - started > limit_s:
        raise deadline_error(what, limit_s, time.monotonic() - started, setting)  # the body may have been cut short


def request_within(session: requests.Session, method: str, url: str, *, limit_s: float, what: str,
                   setting: str | None, hint: str = "", **kwargs: Any) -> requests.Response:
    """``session.request`` with its body read, all within ``limit_s`` seconds from send to last
    byte (see ``stream_within``); ``.status_code``, ``.text`` and ``.json()`` work on the result."""
    with stream_within(session, method, url, limit_s=limit_s, what=what, setting=setting, hint=hint,
                       **kwargs) as response:
        response.content  # noqa: B018 - reads (and keeps) the body inside the deadline
    return response


# ----------------------------------------------------------------------------- helpers


def join_url(base: str, path: str) -> str:
    """``base`` and ``path`` joined by exactly one slash (``path`` may carry a query string)."""
    return base.rstrip("/") + "/" + path.lstrip("/")


def body_excerpt(response: requests.Response, limit: int = 500) -> str:
    """The response body, shortened for error messages."""
    text = response.text or ""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def json_body(response: requests.Response, what: str) -> Any:
    """The response's JSON document; ``StageError`` naming ``what`` when it is not JSON."""
    try:
        return response.json()
    except ValueError as exc:
        raise StageError(
            f"{what}: {response.url} answered {response.status_code} with a body that is not JSON: "
            f"{body_excerpt(response)!r}; check that the URL points at the right kind of server"
        ) from exc


def served_model_name(session: requests.Session, base_url: str, timeout_s: float = 30.0,
                      setting: str | None = None) -> str:
    """The first model id from ``GET /v1/models``: what OpenAI-protocol requests must name.

    ``timeout_s`` bounds the whole request; ``setting`` is the config field that sets it. The
    session (from ``make_session``) carries the API key.
    """
    url = join_url(base_url, "/v1/models")
    response = request_within(session, "GET", url, limit_s=timeout_s, what=f"GET {url}", setting=setting)
    if response.status_code != 200:
        raise StageError(
            f"GET {url} answered {response.status_code}: {body_excerpt(response)!r}; the server does not list "
            f"its models, which the OpenAI protocol needs to name the model — pass the model name explicitly"
        )
    doc = json_body(response, "listing served models")
    data = doc.get("data") if isinstance(doc, dict) else None
    if not data or not isinstance(data, list) or not isinstance(data[0], dict) or not data[0].get("id"):
        raise StageError(f"GET {url} listed no model ({doc!r}); the server must list its model under data[0].id, "
                         f"or pass the model name explicitly")
    return str(data[0]["id"])
