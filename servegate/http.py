"""Shared HTTP helpers for control calls (readiness, flush, server info, warmup).

Control calls use ``requests``. Connection failures and timeouts are mapped to
``ServerUnreachableError`` here, at the boundary, so that no ``requests`` exception
leaks out of servegate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import requests

from servegate.errors import ServerUnreachableError, StageError

__all__ = ["make_session", "join_url", "unreachable_as_error", "served_model_name", "json_body", "body_excerpt"]


def make_session(api_key: str | None = None) -> requests.Session:
    """A session that sends ``Authorization: Bearer <api_key>`` when a key is given."""
    session = requests.Session()
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    return session


def join_url(base: str, path: str) -> str:
    """``base`` and ``path`` joined by exactly one slash (``path`` may carry a query string)."""
    return base.rstrip("/") + "/" + path.lstrip("/")


@contextlib.contextmanager
def unreachable_as_error(url: str, hint: str = "") -> Iterator[None]:
    """Map connection errors and timeouts raised inside the block to ``ServerUnreachableError``.

    Only transport failures are mapped; HTTP status codes are for the caller to judge.
    """
    try:
        yield
    except requests.Timeout as exc:
        raise ServerUnreachableError(
            f"no answer from {url} within the timeout ({type(exc).__name__}); "
            f"{hint or 'check that the server is running and not overloaded, or raise the timeout'}"
        ) from exc
    except requests.RequestException as exc:
        raise ServerUnreachableError(
            f"could not reach {url}: {exc}; "
            f"{hint or 'check that the server is running and the URL (host, port) is right'}"
        ) from exc


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


def served_model_name(session: requests.Session, base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id from ``GET /v1/models`` (what OpenAI-protocol requests must name)."""
    url = join_url(base_url, "/v1/models")
    with unreachable_as_error(url):
        response = session.get(url, timeout=timeout_s)
    if response.status_code != 200:
        raise StageError(
            f"GET {url} answered {response.status_code}: {body_excerpt(response)!r}; the server does not list "
            f"its models — pass the model name explicitly"
        )
    doc = json_body(response, "listing served models")
    data = doc.get("data") if isinstance(doc, dict) else None
    if not data or not isinstance(data, list) or not isinstance(data[0], dict) or not data[0].get("id"):
        raise StageError(f"GET {url} listed no model ({doc!r}); pass the model name explicitly")
    return str(data[0]["id"])
