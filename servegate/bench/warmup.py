"""Warmup: a few short requests before anything is measured; any failure fails the stage.

Nothing warmup produces is measured. SGLang's kits warm up with max_new_tokens=64.
Each request must end, last byte included, within ``warmup.request_timeout_s`` (a server
that drips its answer a byte at a time fails here instead of holding the gate), and must
answer with output whose token count is believable (``WireProtocol.check_counts``): no more
than ``max_new_tokens``, and native ``completion_tokens`` equal to the ``output_ids``
returned — a server whose counters lie would make every later measurement false, so it
fails the gate before them.
"""

from __future__ import annotations

import pandas as pd
import requests

from servegate.bench.protocol import protocol_for
from servegate.config import WarmupConfig
from servegate.engines.base import Engine
from servegate.errors import StageError
from servegate.http import body_excerpt, json_body, make_session, request_within

__all__ = ["run_warmup"]


def run_warmup(base_url: str, engine: Engine, cfg: WarmupConfig, api_key: str | None = None, *,
               session: requests.Session | None = None, model: str | None = None,
               partial: dict[str, pd.DataFrame] | None = None) -> int:
    """Send ``cfg.num_requests`` short greedy requests over the engine's protocol, one at a time.

    The body leaves ``ignore_eos`` and ``stream`` to the server's defaults. The OpenAI protocol
    names ``model`` (default: the first id from ``GET /v1/models``). Returns the number of
    requests sent. ``partial`` is accepted like every stage's and left empty: warmup measures
    nothing. Raises ``StageError`` on a non-200 answer, an empty output, an unbelievable token
    count or a request that outlasts ``cfg.request_timeout_s``; ``ServerUnreachableError`` when
    the server cannot be reached.
    """
    wire = protocol_for(engine)
    own_session = session is None
    session = session or make_session(api_key)
    try:
        model = model or wire.served_model(session, base_url, limit_s=min(cfg.request_timeout_s, 30.0),
                                           setting="warmup.request_timeout_s")
        body = wire.body(cfg.prompt, cfg.max_new_tokens, model=model, stream=None, ignore_eos=None)
        url = wire.url(base_url)
        for i in range(cfg.num_requests):
            what = f"warmup request {i + 1}/{cfg.num_requests} (POST {url})"
            response = request_within(session, "POST", url, limit_s=cfg.request_timeout_s, what=what,
                                      setting="warmup.request_timeout_s", json=body,
                                      hint="check that the worker is alive")
            if response.status_code != 200:
                raise StageError(f"warmup failed: request {i + 1}/{cfg.num_requests} POST {url} -> "
                                 f"{response.status_code}: {body_excerpt(response)!r}; read the worker log")
            doc = json_body(response, "warmup")
            if not wire.has_output(doc):
                raise StageError(f"warmup failed: request {i + 1}/{cfg.num_requests} POST {url} -> 200 with no "
                                 f"generated output: {body_excerpt(response)!r}; the worker answers but does "
                                 f"not generate — read its log")
            wire.check_counts(doc, cfg.max_new_tokens, what)
        return cfg.num_requests
    finally:
        if own_session:
            session.close()
