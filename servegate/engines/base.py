"""The one narrow engine interface.

An engine knows how to launch its server (argument list + env), how to probe readiness,
how to flush its prefix cache, how to read token capacity from its server info, which
protocol the load generator speaks to it, and the names of its Prometheus metrics.
Each concrete engine is one small module in this package.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import requests

from servegate.config import WorkerSpec

__all__ = ["Engine", "ServerCapacity", "Protocol"]

Protocol = Literal["native", "openai"]


@dataclass(frozen=True)
class ServerCapacity:
    """What the server says it can hold. ``math.inf`` when the engine does not report it."""

    token_capacity: float = math.inf
    """Sum of internal_states[*].memory_usage.token_capacity (SGLang) or max_total_num_tokens."""
    max_running_requests: float = math.inf
    """effective_max_running_requests_per_dp * dp_size (SGLang) or max_running_requests."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The server info document as returned (empty when the engine has none)."""


class Engine(abc.ABC):
    name: ClassVar[str]
    protocol: ClassVar[Protocol]
    """What the load generator speaks: SGLang-native /generate or OpenAI /v1/completions."""
    readiness_path: ClassVar[str]
    """GET path that answers 200 once the server can generate."""
    metric_names: ClassVar[dict[str, str]]
    """Logical name -> Prometheus metric name. Logical names: fwd_occupancy, spec_accept_length,
    token_usage, num_running_reqs, num_queue_reqs, kv_cache_usage (absent keys: not exposed)."""
    metrics_hint: ClassVar[str]
    """What to set on the server so that /metrics and its gauges exist (for error messages)."""

    @abc.abstractmethod
    def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
        """The server's command line as an argument list (never a shell string)."""

    def launch_env(self, spec: WorkerSpec) -> dict[str, str]:
        """Environment added to the worker process (on top of os.environ and spec.env)."""
        return dict(spec.env)

    def is_ready(self, session: requests.Session, base_url: str, timeout_s: float) -> bool:
        """One readiness probe: ``GET readiness_path`` answers 200.

        Transport errors (connection refused while the server starts) propagate as
        ``requests`` exceptions; the caller (launch) owns retries and their mapping.
        """
        response = session.get(base_url.rstrip("/") + self.readiness_path, timeout=timeout_s)
        return response.status_code == 200

    @abc.abstractmethod
    def flush(self, session: requests.Session, base_url: str, timeout_s: float,
              request_timeout_s: float | None = None) -> bool:
        """Wait for idle and drop the prefix cache.

        Returns True when flushed, False only when the server has no flush endpoint at all
        (engine "external"); raises FlushError when the server refused or stayed busy past
        ``timeout_s``, ServerUnreachableError when it did not answer.
        """

    @abc.abstractmethod
    def server_capacity(self, session: requests.Session, base_url: str) -> ServerCapacity:
        """Token capacity and max running requests from the server's info endpoint."""
