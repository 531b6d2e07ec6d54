"""Flush: wait until the worker is idle, then drop its prefix cache (per engine).

Every measurement stage starts from a flushed, idle worker, so that cache hits from an
earlier stage cannot make a regression look like an improvement.
"""

from __future__ import annotations

import logging
import time

import requests

from servegate.config import FlushConfig
from servegate.engines.base import Engine
from servegate.http import make_session

__all__ = ["flush_until_idle"]

logger = logging.getLogger(__name__)


def flush_until_idle(base_url: str, engine: Engine, cfg: FlushConfig, api_key: str | None = None, *,
                     session: requests.Session | None = None) -> float:
    """Ask the server to wait up to ``cfg.timeout_s`` for idle and flush; the seconds it took.

    HTTP timeout: ``cfg.request_timeout_s``, default ``cfg.timeout_s + 30``. Raises ``FlushError``
    when the server refused or stayed busy, ``ServerUnreachableError`` when it did not answer.
    A server without any flush endpoint (engine "external" only) is logged as a warning and
    the stage goes on unflushed.
    """
    request_timeout_s = cfg.request_timeout_s if cfg.request_timeout_s is not None else cfg.timeout_s + 30.0
    own_session = session is None
    session = session or make_session(api_key)
    started = time.perf_counter()
    try:
        flushed = engine.flush(session, base_url, cfg.timeout_s, request_timeout_s)
    finally:
        if own_session:
            session.close()
    waited_s = time.perf_counter() - started
    if not flushed:
        logger.warning("%s has no flush endpoint; measuring without flushing its prefix cache "
                       "(cached prefixes from earlier stages may flatter the results)", base_url)
    return waited_s
