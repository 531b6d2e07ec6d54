"""An already running OpenAI-compatible server at ``worker.url``: nothing is launched.

Readiness: ``GET /health`` 200, or — for servers without that route (404/405) —
``GET /v1/models`` 200. Flush: ``POST /flush_cache`` with no parameters where the server
has it; a server without the route (404/405/501) is not an error: ``flush`` returns False
and the flush stage logs a warning. Any other refusal is a ``FlushError``. Server capacity
is read from SGLang-style server info where present, else ``inf``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import requests

from servegate.budgets import ExternalBudget
from servegate.config import WorkerSpec
from servegate.engines.base import Engine, Protocol, ServerCapacity, probe
from servegate.engines.sglang import fetch_sglang_server_info, parse_server_info
from servegate.errors import ConfigError, FlushError
from servegate.http import body_excerpt, join_url, request_within

__all__ = ["ExternalEngine"]

_NO_ROUTE = (404, 405, 501)


class ExternalEngine(Engine):
    name: ClassVar[str] = "external"
    protocol: ClassVar[Protocol] = "openai"
    readiness_path: ClassVar[str] = "/health"
    metric_names: ClassVar[dict[str, str]] = {}
    metrics_hint: ClassVar[str] = (
        "servegate does not know an external server's metric names; if it is SGLang or vLLM, "
        "use engine 'sglang' or 'vllm' with its URL, or disable the occupancy stage"
    )
    launches: ClassVar[bool] = False  # attaches to worker.url
    can_flush: ClassVar[bool] = False  # best effort: POST /flush_cache where the server has it
    has_metrics: ClassVar[bool] = False  # its metric names are unknown
    has_occupancy_gauge: ClassVar[bool] = False
    reports_capacity: ClassVar[bool] = False  # best effort: SGLang-style server info where present
    # Prompt log-probabilities (`echo` with `logprobs`) are not served by every OpenAI-compatible server.
    has_logprobs: ClassVar[bool] = False
    # Assumed, as vLLM and SGLang take a list of prompts: a server that refuses one answers each
    # one-batch case with an HTTP error, a failed row that names it.
    takes_prompt_batches: ClassVar[bool] = True
    budget_model: ClassVar[type[ExternalBudget]] = ExternalBudget  # no fields: it launches nothing

    def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
        raise ConfigError("engine 'external' launches nothing: it attaches to worker.url; "
                          "pick engine embedded, sglang or vllm to launch a server")

    def is_ready(self, session: requests.Session, base_url: str, timeout_s: float) -> bool:
        response = probe(session, join_url(base_url, "/health"), timeout_s)
        if response.status_code in _NO_ROUTE:
            response = probe(session, join_url(base_url, "/v1/models"), timeout_s)
        return response.status_code == 200

    def flush(self, session: requests.Session, base_url: str, timeout_s: float,
              request_timeout_s: float | None = None) -> bool:
        url = join_url(base_url, "/flush_cache")
        http_timeout = request_timeout_s if request_timeout_s is not None else timeout_s + 30.0
        response = request_within(session, "POST", url, limit_s=http_timeout, what=f"flush (POST {url})",
                                  setting="flush.request_timeout_s")
        if response.status_code == 200:
            return True
        if response.status_code in _NO_ROUTE:
            return False
        raise FlushError(f"the server refused to flush its cache: POST {url} -> {response.status_code}: "
                         f"{body_excerpt(response)!r}; wait until it is idle, or check its log")

    def server_capacity(self, session: requests.Session, base_url: str) -> ServerCapacity:
        doc = fetch_sglang_server_info(session, base_url)
        if doc is None:
            return ServerCapacity(token_capacity=math.inf, max_running_requests=math.inf, raw={})
        return parse_server_info(doc)
