"""``servegate.http``'s whole-request deadline against a raw socket server that stalls at each
stage of an HTTP answer: the status line and headers, a Content-Length body, a silent body;
then its one transport-error mapping and its per-thread sessions.

A per-read timeout never fires while a byte keeps coming; the deadline must, from send to
last byte, whichever part of the answer is slow (issue 11 #10).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from servegate.errors import ServerUnreachableError, StageError
from servegate.http import (
    StreamingClient,
    ThreadSessions,
    api_key_headers,
    make_session,
    request_within,
    stream_within,
)

from sim_server import free_port

pytestmark = pytest.mark.timeout(30)

DRIP_S = 0.1


def _drip(conn: socket.socket, data: bytes, forever: bytes = b"") -> None:
    for b in data:
        conn.sendall(bytes([b]))
        time.sleep(DRIP_S)
    while forever:
        conn.sendall(forever)
        time.sleep(DRIP_S)


def _answer(conn: socket.socket, path: str) -> None:
    ok = b'{"ok": true}'
    if path == "/ok":
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(ok), ok))
    elif path == "/slow-headers":  # the status line and then header after header, a byte at a time
        _drip(conn, b"HTTP/1.1 200 OK\r\n", forever=b"X")
    elif path == "/slow-body":  # headers at once, then a Content-Length body a byte at a time
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        _drip(conn, b"", forever=b" ")
    elif path == "/silent-body":  # headers, then nothing
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
        time.sleep(30)


class RawServer:
    """Answers each request on its own thread according to its path; keeps connections alive."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                _answer(conn, head.split(b" ")[1].decode())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw() -> Iterator[RawServer]:
    server = RawServer()
    yield server
    server.close()


def _within(session: requests.Session, url: str, limit_s: float = 1.0) -> float:
    started = time.monotonic()
    with pytest.raises(StageError, match=rf"test request did not complete within its deadline of {limit_s:g} s "
                                         rf".*raise test.request_timeout_s"):
        request_within(session, "GET", url, limit_s=limit_s, what="test request", setting="test.request_timeout_s")
    return time.monotonic() - started


@pytest.mark.parametrize("path", ["/slow-headers", "/slow-body", "/silent-body"])
def test_a_stalled_answer_ends_at_the_deadline(raw: RawServer, path: str) -> None:
    with make_session() as session:
        assert 1.0 <= _within(session, raw.url + path) < 2.0


def test_a_foreign_session_is_bounded_once_the_headers_are_in(raw: RawServer) -> None:
    # A plain requests.Session has no hook before the response exists: the body is still bounded.
    with requests.Session() as session:
        assert 1.0 <= _within(session, raw.url + "/slow-body") < 2.0


def test_the_session_works_on_after_a_request_was_cut(raw: RawServer) -> None:
    with make_session() as session:
        _within(session, raw.url + "/slow-body", limit_s=0.5)
        for _ in range(2):
            answer = request_within(session, "GET", raw.url + "/ok", limit_s=5, what="ok", setting=None)
            assert answer.json() == {"ok": True}
    assert raw.connections == 2  # the cut connection was dropped, the good one kept alive


def test_a_stream_read_in_the_block_is_bounded_too(raw: RawServer) -> None:
    received = 0
    with make_session() as session, pytest.raises(StageError, match="deadline of 1 s"):
        with stream_within(session, "GET", raw.url + "/slow-body", limit_s=1.0, what="test stream",
                           setting="test.request_timeout_s") as response:
            for chunk in response.iter_content(chunk_size=1):
                received += len(chunk)
    assert 3 <= received <= 15


def test_a_fixed_limit_says_so_and_an_unreachable_server_is_unreachable(raw: RawServer) -> None:
    with make_session() as session:
        with pytest.raises(StageError, match="this limit is fixed"):
            request_within(session, "GET", raw.url + "/silent-body", limit_s=0.3, what="scrape", setting=None)
        with pytest.raises(ServerUnreachableError, match="probe: could not reach"):
            request_within(session, "GET", f"http://127.0.0.1:{free_port()}/", limit_s=5, what="probe", setting=None)


def test_the_api_key_rides_on_every_request_of_the_session(raw: RawServer) -> None:
    session = make_session("sekrit")
    assert session.headers["Authorization"] == "Bearer sekrit"
    assert "Authorization" not in make_session().headers


def test_thread_sessions_one_per_thread_each_with_the_key() -> None:
    seen: dict[str, requests.Session] = {}
    with ThreadSessions("sekrit") as sessions:
        def grab(name: str) -> None:
            seen[name] = sessions.get()
            assert sessions.get() is seen[name]  # the same session for the same thread

        threads = [threading.Thread(target=grab, args=(f"t{i}",)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grab("main")
    assert len({id(s) for s in seen.values()}) == 4
    assert all(s.headers["Authorization"] == "Bearer sekrit" for s in seen.values())
    assert api_key_headers("k") == {"Authorization": "Bearer k"} and api_key_headers(None) == {}


def test_both_clients_map_a_refused_connection_the_same_way() -> None:
    port = free_port()
    with make_session() as session, pytest.raises(ServerUnreachableError) as blocking:
        request_within(session, "POST", f"http://127.0.0.1:{port}/generate", limit_s=5, what="req", setting=None)

    async def stream() -> None:
        async with StreamingClient(f"http://127.0.0.1:{port}") as client:
            await client.post_stream(client.request_bytes("/generate", b"{}"), None)  # type: ignore[arg-type]

    with pytest.raises(ServerUnreachableError) as streamed:
        asyncio.run(stream())
    for exc in (blocking.value, streamed.value):  # the advice is written once, in servegate.http.errors
        assert "check that the server is running and the URL" in str(exc)
        assert not isinstance(exc.__cause__, ServerUnreachableError)
