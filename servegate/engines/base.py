"""The one narrow engine interface: ``Engine``, the launch adapter of one serving engine.

An engine knows how to launch its server (argument list + env) within its memory budget
(``budget_model``: its own typed budget from config.py), how to probe readiness,
how to flush its prefix cache, how to read token capacity from its server info, which
protocol the load generator speaks to it, and the names of its Prometheus metrics.
Each concrete engine is one small module in this package.

It also states its capabilities as class attributes (``launches``, ``can_flush``,
``has_metrics``, ``has_occupancy_gauge``, ``reports_capacity``, ``has_logprobs``,
``takes_prompt_batches``, ``profiler_routes``), so that a
stage can tell "this engine cannot do that" (not applicable) from "it failed" (a breach or an
infra error) without branching on the engine's name.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import requests

from servegate.budgets import MemoryBudget
from servegate.config import REDACTED, WorkerSpec
from servegate.errors import ConfigError
from servegate.http import request_within

__all__ = ["Engine", "ServerCapacity", "Protocol", "ProfilerRoutes", "user_env"]

Protocol = Literal["native", "openai", "openai-text"]


@dataclass(frozen=True)
class ServerCapacity:
    """What the server says it can hold. ``math.inf`` when the engine does not report it."""

    token_capacity: float = math.inf
    """Sum of internal_states[*].memory_usage.token_capacity (SGLang) or max_total_num_tokens."""
    max_running_requests: float = math.inf
    """effective_max_running_requests_per_dp * dp_size (SGLang) or max_running_requests."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The server info document as returned (empty when the engine has none)."""


@dataclass(frozen=True)
class ProfilerRoutes:
    """The engine's own operator profiler over HTTP: POST ``start``, requests, POST ``stop``; the
    traces (Chrome trace files) are then in the directory the worker was launched with
    (:meth:`Engine.with_profiler`)."""

    start: str
    stop: str


class Engine(abc.ABC):
    name: ClassVar[str]
    protocol: ClassVar[Protocol]
    """What the load generator speaks: SGLang-native /generate, OpenAI /v1/completions, or its
    strict-schema dialect "openai-text" (text prompts only, no ignore_eos, no [DONE])."""
    readiness_path: ClassVar[str]
    """GET path that answers 200 once the server can generate."""
    metric_names: ClassVar[dict[str, str]]
    """Logical name -> Prometheus metric name. Logical names: fwd_occupancy, spec_accept_length,
    token_usage, num_running_reqs, num_queue_reqs, kv_cache_usage (absent keys: not exposed)."""
    metrics_hint: ClassVar[str]
    """What to set on the server so that /metrics and its gauges exist (for error messages)."""
    spec_decode_counters: ClassVar[dict[str, str]] = {}
    """Speculative-decoding counters (``accepted``, ``drafts``, ``draft_tokens`` -> Prometheus name, as
    scraped, with ``_total``) from which the occupancy stage computes the accept length per scrape
    interval; empty when the engine has an accept-length gauge (``metric_names["spec_accept_length"]``)
    or none."""
    prefix_cache_counters: ClassVar[dict[str, str]] = {}
    """The prefix-cache counters the serving stage reads around its load (``prompt``, ``cached``,
    ``queried`` -> Prometheus name, as scraped, with ``_total``): ``cached / queried`` is the load's
    prefix-cache hit rate (docs/workloads.md); empty when the engine exposes none."""

    # ---- capabilities ------------------------------------------------------------------
    launches: ClassVar[bool] = True
    """True: servegate starts the server (``launch_command``); False: it attaches to ``worker.url``."""
    can_flush: ClassVar[bool]
    """The server has a prefix-cache flush the gate can rely on. False: none, or best effort only
    (``flush`` may then return False: nothing was flushed)."""
    has_metrics: ClassVar[bool]
    """servegate knows the server's Prometheus metric names (``metric_names`` is not empty)."""
    has_occupancy_gauge: ClassVar[bool]
    """The server exposes a forward-occupancy gauge (``metric_names["fwd_occupancy"]``)."""
    reports_capacity: ClassVar[bool]
    """The server reports its token capacity / running-request cap (``server_capacity`` is finite)."""
    has_logprobs: ClassVar[bool]
    """The server returns prompt and output token log-probabilities (the quality stage needs them)."""
    takes_prompt_batches: ClassVar[bool]
    """The server takes a list of prompts in one generation request (the one-batch stage sends its
    whole batch so); False makes one-batch not applicable."""
    idle_spin_s: ClassVar[float] = 0.0
    """How long the server keeps a core busy after its last step (a busy-wait before it sleeps): the
    paired stage lets that pass before each block, or the other side's block would pay for it."""
    pins_after_start: ClassVar[bool] = False
    """``worker.cpus`` may be set once the server is ready, on every thread of its tree, instead of
    before exec: its start-up (interpreter, model load) then runs on every CPU, which halves a paired
    restart when both workers share one CPU. Only for a server that sizes and binds nothing by the
    affinity it starts with (vLLM-CPU binds its OpenMP threads to the CPUs it is given)."""
    profiler_routes: ClassVar[ProfilerRoutes | None] = None
    """The engine's profiler endpoints (enabled at launch by :meth:`with_profiler`); None: the gate
    cannot profile this engine (the paired stage's profile is then not applicable)."""
    api_key_env_var: ClassVar[str | None] = None
    """The environment variable the server reads its API key from; None when it only takes a
    command-line flag (visible to every user in ``ps``)."""
    budget_model: ClassVar[type[MemoryBudget]]
    """The engine's memory budget model (config.py; ``budget_model.engine`` is ``name``): the fields a
    memory profile or ``worker.memory`` may set for this engine."""

    def budget(self, spec: WorkerSpec) -> MemoryBudget:
        """The memory budget this engine launches ``spec`` with (``spec.budget()``, which is
        ``budget_model``'s: the spec's engine is this one)."""
        budget = spec.budget()
        if not isinstance(budget, self.budget_model):
            raise ConfigError(f"the {self.name} engine cannot launch a worker spec for engine {spec.engine!r} "
                              f"(its budget is a {type(budget).__name__}); set worker.engine = {self.name!r}")
        return budget

    @classmethod
    def oom_knobs(cls) -> list[str]:
        """The budget fields to lower when the worker is killed for memory: its budget's sizes."""
        return cls.budget_model.lowerable_fields()

    @abc.abstractmethod
    def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
        """The server's command line as an argument list (never a shell string)."""

    def with_profiler(self, spec: WorkerSpec, trace_dir: Path) -> WorkerSpec:
        """``spec`` with the engine's profiler on (``profiler_routes`` answer), its traces written into
        ``trace_dir`` (made absolute: the server may run elsewhere than the gate's directory).
        ``ConfigError`` for an engine without one."""
        raise ConfigError(f"engine {self.name!r} has no profiler endpoints servegate can drive; profiles are "
                          f"recorded for engines embedded, vllm and sglang (set paired.profile = false)")

    def launch_env(self, spec: WorkerSpec) -> dict[str, str]:
        """Environment added to the worker process (on top of os.environ): the API key where the
        engine reads it from its environment, then ``spec.env`` (the user's env wins)."""
        return {**self.api_key_environ(spec), **user_env(spec)}

    def api_key_environ(self, spec: WorkerSpec) -> dict[str, str]:
        """``{api_key_env_var: key}``; ``{}`` for an engine without such a variable.

        Set to "" when no key is configured: a variable inherited from the gate's own environment
        would make the server demand a key that the gate does not send.
        """
        if self.api_key_env_var is None:
            return {}
        return {self.api_key_env_var: spec.api_key_value() or ""}

    def is_ready(self, session: requests.Session, base_url: str, timeout_s: float) -> bool:
        """One readiness probe: ``GET readiness_path`` answers 200.

        Transport errors (connection refused while the server starts) and a probe that does not
        end within ``timeout_s`` (a server dripping bytes) raise ``ServerUnreachableError`` /
        ``StageError``; the caller (launch) owns retries.
        """
        return probe(session, base_url.rstrip("/") + self.readiness_path, timeout_s).status_code == 200

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

    build_identity_is_digest: ClassVar[bool] = False
    """Whether :meth:`build_identity` differs whenever the code does (a digest of the source), so that two
    servers reporting one identity run one build. A version string is not: a patched build of an engine
    can keep its version."""

    def build_identity(self, session: requests.Session, base_url: str) -> str | None:
        """Which build the running server is, as it reports it (a version, a source digest); None when the
        engine does not say. The paired stage records it per worker; when it is a digest
        (:attr:`build_identity_is_digest`) it refuses two sides that name different builds but run one."""
        return None


def probe(session: requests.Session, url: str, timeout_s: float) -> requests.Response:
    """One readiness request, ended within ``timeout_s`` from send to last byte."""
    return request_within(session, "GET", url, limit_s=timeout_s, what=f"readiness probe (GET {url})",
                          setting="worker.ready_timeout_s")


def user_env(spec: WorkerSpec) -> dict[str, str]:
    """``spec.env``; ``ConfigError`` for a value that is a snapshot's placeholder (a config reloaded
    from config.json keeps no secrets: the worker would get "<redacted>" as its token)."""
    hidden = sorted(k for k, v in spec.env.items() if v == REDACTED)
    if hidden:
        raise ConfigError(f"worker.env {hidden} hold the placeholder {REDACTED!r} of a config snapshot, not values; "
                          f"give them again: " + " ".join(f"--set worker.env.{k}=VALUE" for k in hidden))
    return dict(spec.env)
