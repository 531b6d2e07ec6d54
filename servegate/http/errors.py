"""The one mapping of transport failures to servegate's exceptions.

Every HTTP client in servegate — the blocking ``requests`` sessions (``session``) and the
serving load generator's asyncio connections (``streaming``) — turns a failed connection into
``ServerUnreachableError`` and a request that outlived its deadline into
``RequestDeadlineError`` through these functions, so that the messages (and what they tell
the user to do) are written once and no foreign exception leaks out of servegate.
"""

from __future__ import annotations

import requests

from servegate.errors import RequestDeadlineError, ServerUnreachableError

__all__ = ["unreachable_as_error", "connection_lost_error", "deadline_error"]


def unreachable_as_error(what: str, url: str, exc: BaseException, hint: str = "", *,
                         limit_s: float | None = None) -> ServerUnreachableError:
    """``ServerUnreachableError`` for a transport failure of ``what`` (a request, a connect) to ``url``.

    ``exc`` is a ``requests`` exception or an ``OSError`` from a socket; ``hint`` replaces the
    default advice; ``limit_s`` is the deadline a connect timeout ran into.
    """
    if isinstance(exc, requests.Timeout):
        within = f" within {limit_s:g} s" if limit_s is not None else ""
        return ServerUnreachableError(
            f"{what}: no connection to {url}{within} ({type(exc).__name__}); "
            f"{hint or 'check that the server is running and not overloaded'}")
    if isinstance(exc, requests.RequestException):
        return ServerUnreachableError(
            f"{what}: could not reach {url}: {exc}; "
            f"{hint or 'check that the server is running and the URL (host, port) is right'}")
    return ServerUnreachableError(
        f"{what}: cannot connect to {url} ({exc}); "
        f"{hint or 'check that the server is running and the URL is right'}")


def connection_lost_error(exc: BaseException | None, got_bytes: bool) -> ServerUnreachableError:
    """The server closed a connection before its answer ended (a 200 stream cut before ``[DONE]``)."""
    return ServerUnreachableError(
        f"the server closed the connection mid-request ({exc or 'EOF'}) after "
        f"{'some' if got_bytes else 'no'} response bytes; check the server's log")


def deadline_error(what: str, limit_s: float, elapsed_s: float, setting: str | None) -> RequestDeadlineError:
    """``what`` did not end, last byte included, within ``limit_s``; ``setting`` is the config
    field that raises the limit (None: the limit is fixed)."""
    todo = (f"raise {setting} if the server is only slow" if setting
            else "this limit is fixed; the endpoint should answer in well under it")
    return RequestDeadlineError(
        f"{what} did not complete within its deadline of {limit_s:g} s (from sending the request to its last "
        f"byte; {elapsed_s:.1f} s had passed): the server stalled or is sending too slowly — read the worker "
        f"log; {todo}")
