"""SGLang: ``python -m sglang.launch_server`` with the profile's memory budget, native protocol.

Flush is ``POST /flush_cache?timeout=T``: the server waits up to T seconds for idle, then
answers 200 (flushed) or 400 (still busy). Server info comes from ``/server_info``
(newer SGLang) or ``/get_server_info`` (older).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import requests

from servegate.budgets import SGLangBudget
from servegate.config import WorkerSpec
from servegate.engines.base import Engine, ProfilerRoutes, Protocol, ServerCapacity, user_env
from servegate.errors import ConfigError, FlushError, StageError
from servegate.http import body_excerpt, join_url, json_body, request_within

__all__ = ["SGLangEngine", "SGLANG_METRIC_NAMES", "SGLANG_PREFIX_CACHE_COUNTERS", "SGLANG_SPECULATIVE_ALGORITHMS", "parse_server_info",
           "fetch_sglang_server_info", "sglang_flush", "sglang_speculative_flags"]

SGLANG_METRIC_NAMES: dict[str, str] = {
    "fwd_occupancy": "sglang:fwd_occupancy",
    "spec_accept_length": "sglang:spec_accept_length",
    "token_usage": "sglang:token_usage",
    "num_running_reqs": "sglang:num_running_reqs",
    "num_queue_reqs": "sglang:num_queue_reqs",
}

SGLANG_PREFIX_CACHE_COUNTERS: dict[str, str] = {
    # sglang:prompt_tokens / sglang:cached_tokens (counters: scraped with "_total"); every prompt token
    # is looked up in the radix cache, so the prompt tokens are also the cache's queries.
    "prompt": "sglang:prompt_tokens_total",
    "cached": "sglang:cached_tokens_total",
    "queried": "sglang:prompt_tokens_total",
}

# sglang/srt/server_args.py, ServerArgs.speculative_algorithm (checked against SGLang's source and
# test launch commands: docs/speculation.md). NEXTN is SGLang's alias of EAGLE for MTP heads.
SGLANG_SPECULATIVE_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"})
SGLANG_DRAFT_MODEL_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "STANDALONE"})
"""Algorithms that load a draft model (``--speculative-draft-model-path``); NEXTN can use the
target's own MTP layers, NGRAM looks up drafts in the request's tokens."""

# Newer SGLang renamed /get_server_info to /server_info; try the new name first.
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")


def _positive_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if math.isnan(value) or value <= 0:
        return None
    return float(value)


def parse_server_info(doc: dict[str, Any]) -> ServerCapacity:
    """Token capacity and max running requests from an SGLang server-info document.

    token capacity: the sum of ``internal_states[*].memory_usage.token_capacity`` (one entry per
    DP rank); when any rank lacks it, ``max_total_num_tokens``. max running requests:
    ``effective_max_running_requests_per_dp * dp_size``; else ``max_running_requests``.
    ``math.inf`` where the server reports neither.
    """
    states = doc.get("internal_states")
    states = [s for s in states if isinstance(s, dict)] if isinstance(states, list) else []
    first = states[0] if states else {}

    token_capacity = math.inf
    per_rank = [_positive_number((s.get("memory_usage") or {}).get("token_capacity")) for s in states]
    if per_rank and all(c is not None for c in per_rank):
        token_capacity = float(sum(per_rank))  # type: ignore[arg-type]
    else:
        fallback = _positive_number(doc.get("max_total_num_tokens"))
        if fallback is None:
            fallback = _positive_number(first.get("max_total_num_tokens"))
        if fallback is not None:
            token_capacity = fallback

    max_running = math.inf
    per_dp = _positive_number(first.get("effective_max_running_requests_per_dp"))
    if per_dp is not None:
        dp_size = _positive_number(doc.get("dp_size")) or 1.0
        max_running = per_dp * dp_size
    else:
        fallback = _positive_number(doc.get("max_running_requests"))
        if fallback is None:
            fallback = _positive_number(first.get("max_running_requests"))
        if fallback is not None:
            max_running = fallback

    return ServerCapacity(token_capacity=token_capacity, max_running_requests=max_running, raw=doc)


SERVER_INFO_TIMEOUT_S = 30.0
"""The whole-request limit on a server-info answer: a healthy server answers in milliseconds."""


def fetch_sglang_server_info(session: requests.Session, base_url: str,
                             timeout_s: float | None = None) -> dict[str, Any] | None:
    """The server-info document from ``/server_info`` or ``/get_server_info``; None when both are 404."""
    timeout_s = SERVER_INFO_TIMEOUT_S if timeout_s is None else timeout_s
    for path in SERVER_INFO_PATHS:
        url = join_url(base_url, path)
        response = request_within(session, "GET", url, limit_s=timeout_s, what=f"server info (GET {url})",
                                  setting=None, hint="check that the server is up")
        if response.status_code == 404:
            continue
        if response.status_code != 200:
            raise StageError(f"GET {url} answered {response.status_code}: {body_excerpt(response)!r}; "
                             f"the server could not report its capacity — check its log")
        doc = json_body(response, "reading server info")
        if not isinstance(doc, dict):
            raise StageError(f"GET {url} returned {type(doc).__name__}, not a JSON object; "
                             f"check that the URL points at an SGLang-compatible server")
        return doc
    return None


def sglang_flush(session: requests.Session, base_url: str, timeout_s: float,
                 request_timeout_s: float | None, engine_name: str) -> bool:
    """``POST /flush_cache?timeout=T``: 200 flushed, 400 still busy after T seconds."""
    url = join_url(base_url, "/flush_cache")
    http_timeout = request_timeout_s if request_timeout_s is not None else timeout_s + 30.0
    # `:g` so that 60.0 goes out as "60": servers that declare the parameter int accept it too.
    response = request_within(session, "POST", url, params={"timeout": f"{timeout_s:g}"}, limit_s=http_timeout,
                              what=f"flush (POST {url})", setting="flush.request_timeout_s",
                              hint=f"the flush waits up to {timeout_s:g} s for idle; raise flush.request_timeout_s "
                                   f"if the server is slow to answer")
    if response.status_code == 200:
        return True
    if response.status_code == 400:
        raise FlushError(
            f"{engine_name} did not flush its prefix cache: still busy after {timeout_s:g} s "
            f"(POST {url} -> 400: {body_excerpt(response)!r}); requests are still running — wait for them "
            f"to finish or raise flush.timeout_s"
        )
    raise FlushError(
        f"{engine_name} refused to flush its prefix cache: POST {url} -> {response.status_code}: "
        f"{body_excerpt(response)!r}; check the server log"
    )


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in an argument list (``--flag V`` or ``--flag=V``); the last one wins, as argparse."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def sglang_speculative_flags(spec: WorkerSpec) -> list[str]:
    """SGLang's speculative-decoding flags for ``worker.speculative_num_draft_tokens``.

    The algorithm is NGRAM (prompt lookup, no draft model) unless ``worker.extra_args`` names one
    (``--speculative-algorithm EAGLE|EAGLE3|NEXTN|STANDALONE|NGRAM``, with the draft model's
    ``--speculative-draft-model-path``, ``--speculative-num-steps``, ``--speculative-eagle-topk``):
    then only ``--speculative-num-draft-tokens`` comes from here, so that the command holds each flag
    once. Draft-model algorithms without a draft model path are refused before launch.
    """
    extra = list(spec.extra_args)
    algorithm = _flag_value(extra, "--speculative-algorithm")
    if spec.speculative_num_draft_tokens is None:
        if algorithm is not None:
            raise ConfigError(f"worker.extra_args turns speculative decoding on (--speculative-algorithm {algorithm}) "
                              f"but worker.speculative_num_draft_tokens is unset; set it (it gives "
                              f"--speculative-num-draft-tokens and tells the gate that the run speculates, which "
                              f"its accept-length expectation needs)")
        return []
    if algorithm is not None and algorithm.upper() not in SGLANG_SPECULATIVE_ALGORITHMS:
        raise ConfigError(f"worker.extra_args: --speculative-algorithm {algorithm!r} is not one servegate knows; "
                          f"choose one of {sorted(SGLANG_SPECULATIVE_ALGORITHMS)}")
    if (algorithm or "NGRAM").upper() in SGLANG_DRAFT_MODEL_ALGORITHMS \
            and _flag_value(extra, "--speculative-draft-model-path") is None:
        raise ConfigError(f"--speculative-algorithm {algorithm} needs a draft model: add "
                          f"'--speculative-draft-model-path', 'PATH' to worker.extra_args (EAGLE3 heads are "
                          f"published per target model, e.g. an EAGLE3 head trained for {spec.model})")
    if _flag_value(extra, "--speculative-num-draft-tokens") is not None:
        raise ConfigError("worker.extra_args sets --speculative-num-draft-tokens, and so does "
                          "worker.speculative_num_draft_tokens; keep one (the config field)")
    flags = [] if algorithm is not None else ["--speculative-algorithm", "NGRAM"]
    return flags + ["--speculative-num-draft-tokens", str(spec.speculative_num_draft_tokens)]


def sglang_common_flags(spec: WorkerSpec, *, api_key_flag: bool) -> list[str]:
    """The flags SGLang and the embedded worker spell alike, then the user's extra args (last).

    ``api_key_flag``: pass the API key as ``--api-key`` (only for a server that reads it from
    nowhere else: the command line is visible to every user of the machine).
    """
    flags: list[str] = []
    if spec.enable_metrics:
        flags += ["--enable-metrics"]
    flags += sglang_speculative_flags(spec)
    key = spec.api_key_value() if api_key_flag else None
    if key:
        flags += ["--api-key", key]
    return flags + list(spec.extra_args)


class SGLangEngine(Engine):
    name: ClassVar[str] = "sglang"
    protocol: ClassVar[Protocol] = "native"
    readiness_path: ClassVar[str] = "/health_generate"
    metric_names: ClassVar[dict[str, str]] = SGLANG_METRIC_NAMES
    prefix_cache_counters: ClassVar[dict[str, str]] = SGLANG_PREFIX_CACHE_COUNTERS
    metrics_hint: ClassVar[str] = (
        "start the server with --enable-metrics and env SGLANG_ENABLE_METRICS_DEVICE_TIMER=1"
    )
    can_flush: ClassVar[bool] = True
    has_metrics: ClassVar[bool] = True
    has_occupancy_gauge: ClassVar[bool] = True
    reports_capacity: ClassVar[bool] = True
    has_logprobs: ClassVar[bool] = True
    takes_prompt_batches: ClassVar[bool] = True
    # SGLang reads its API key only from --api-key (ServerArgs.api_key; no environment variable in
    # sglang/srt/server_args.py), so the key stays on its command line, visible in `ps`. Its
    # `--config FILE` (YAML holding `api-key`) would keep it out, given a 0600 file that launch
    # creates and removes; until then, attach to a server started with the key (engine external).
    api_key_env_var: ClassVar[str | None] = None
    budget_model: ClassVar[type[SGLangBudget]] = SGLangBudget
    # sglang/srt/entrypoints/http_server.py: /start_profile and /stop_profile (GET or POST); the traces
    # (<id>-TP-<rank>.trace.json.gz) go to $SGLANG_TORCH_PROFILER_DIR when the request names no output_dir.
    profiler_routes: ClassVar[ProfilerRoutes | None] = ProfilerRoutes("/start_profile", "/stop_profile")

    def with_profiler(self, spec: WorkerSpec, trace_dir: Path) -> WorkerSpec:
        env = {**spec.env, "SGLANG_TORCH_PROFILER_DIR": str(Path(trace_dir).resolve())}
        return spec.model_copy(update={"env": env})

    def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
        budget = self.budget(spec)
        cmd = [spec.python or "python3", "-m", "sglang.launch_server",
               "--model-path", spec.model, "--host", spec.host, "--port", str(port)]
        if budget.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(budget.mem_fraction_static)]
        if budget.disable_prefill_cuda_graph:
            cmd += ["--cuda-graph-backend-prefill", "disabled"]
        if budget.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(budget.max_total_tokens)]
        if budget.max_running_requests is not None:
            cmd += ["--max-running-requests", str(budget.max_running_requests)]
        if budget.cuda_graph_max_bs is not None:
            cmd += ["--cuda-graph-max-bs", str(budget.cuda_graph_max_bs)]
        return cmd + sglang_common_flags(spec, api_key_flag=True)

    def launch_env(self, spec: WorkerSpec) -> dict[str, str]:
        env: dict[str, str] = {}
        if spec.enable_metrics:
            # sglang:fwd_occupancy is only measured with the device timer on.
            env["SGLANG_ENABLE_METRICS_DEVICE_TIMER"] = "1"
        env.update(user_env(spec))  # the user's env wins
        return env

    def flush(self, session: requests.Session, base_url: str, timeout_s: float,
              request_timeout_s: float | None = None) -> bool:
        return sglang_flush(session, base_url, timeout_s, request_timeout_s, self.name)

    def build_identity(self, session: requests.Session, base_url: str) -> str | None:
        version = (fetch_sglang_server_info(session, base_url) or {}).get("version")
        return f"sglang {version}" if version else None

    def server_capacity(self, session: requests.Session, base_url: str) -> ServerCapacity:
        doc = fetch_sglang_server_info(session, base_url)
        if doc is None:
            raise StageError(f"{base_url} has neither /server_info nor /get_server_info; "
                             f"is it an SGLang server? Use engine 'external' for other servers")
        return parse_server_info(doc)
