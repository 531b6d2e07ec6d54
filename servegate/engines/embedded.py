"""The embedded CPU worker: ``python -m servegate worker``, SGLang-compatible surface.

Launch flags follow SGLang's spelling; flush, readiness and server info are SGLang's
(the same code), so the gate exercises the SGLang paths on a CPU machine.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

import requests

from servegate.budgets import EmbeddedBudget
from servegate.config import WorkerSpec
from servegate.engines.base import Engine, ProfilerRoutes, Protocol, ServerCapacity
from servegate.engines.sglang import (SGLANG_METRIC_NAMES, SGLANG_PREFIX_CACHE_COUNTERS, fetch_sglang_server_info,
                                     parse_server_info, sglang_common_flags, sglang_flush)
from servegate.errors import StageError
from servegate.worker.cli import API_KEY_ENV, default_thread_count

__all__ = ["EmbeddedEngine"]


class EmbeddedEngine(Engine):
    name: ClassVar[str] = "embedded"
    protocol: ClassVar[Protocol] = "native"
    readiness_path: ClassVar[str] = "/health_generate"
    metric_names: ClassVar[dict[str, str]] = SGLANG_METRIC_NAMES
    prefix_cache_counters: ClassVar[dict[str, str]] = SGLANG_PREFIX_CACHE_COUNTERS  # the worker mirrors SGLang's
    metrics_hint: ClassVar[str] = "start the embedded worker with --enable-metrics (worker.enable_metrics = true)"
    can_flush: ClassVar[bool] = True
    has_metrics: ClassVar[bool] = True
    has_occupancy_gauge: ClassVar[bool] = True
    reports_capacity: ClassVar[bool] = True
    has_logprobs: ClassVar[bool] = True
    takes_prompt_batches: ClassVar[bool] = True
    pins_after_start: ClassVar[bool] = True
    # The worker reads its key from this variable (servegate/worker/cli.py): never on its command line.
    api_key_env_var: ClassVar[str | None] = API_KEY_ENV
    budget_model: ClassVar[type[EmbeddedBudget]] = EmbeddedBudget
    # The worker's torch.profiler, on with --profiler-dir (servegate/worker/profiler.py): vLLM's routes.
    profiler_routes: ClassVar[ProfilerRoutes | None] = ProfilerRoutes("/start_profile", "/stop_profile")

    def with_profiler(self, spec: WorkerSpec, trace_dir: Path) -> WorkerSpec:
        return spec.model_copy(update={"extra_args": [*spec.extra_args, "--profiler-dir",
                                                      str(Path(trace_dir).resolve())]})

    def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
        budget = self.budget(spec)
        # -P: the working directory is not put on sys.path, so a build named by worker.env's PYTHONPATH is the
        # code that runs; without it a gate started from a servegate checkout ran that checkout's code in
        # every worker, and a candidate tree on PYTHONPATH measured the baseline's code (docs/paired.md).
        cmd = [spec.python or sys.executable, "-P", "-m", "servegate", "worker",
               "--model", spec.model, "--host", spec.host, "--port", str(port)]
        if budget.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(budget.max_total_tokens)]
        if budget.max_running_requests is not None:
            cmd += ["--max-running-requests", str(budget.max_running_requests)]
        if spec.cpus:  # pinned once ready (pins_after_start): its thread count is that of worker.cpus
            cmd += ["--num-threads", str(default_thread_count(len(spec.cpus)))]
        return cmd + sglang_common_flags(spec, api_key_flag=False)

    def flush(self, session: requests.Session, base_url: str, timeout_s: float,
              request_timeout_s: float | None = None) -> bool:
        return sglang_flush(session, base_url, timeout_s, request_timeout_s, self.name)

    build_identity_is_digest: ClassVar[bool] = True

    def build_identity(self, session: requests.Session, base_url: str) -> str | None:
        source = (fetch_sglang_server_info(session, base_url) or {}).get("servegate_source")
        if not isinstance(source, dict) or "digest" not in source:
            return None
        return f"servegate source {source['digest']}"  # the folder it ran from is in the server info

    def server_capacity(self, session: requests.Session, base_url: str) -> ServerCapacity:
        doc = fetch_sglang_server_info(session, base_url)
        if doc is None:
            raise StageError(f"{base_url} has neither /server_info nor /get_server_info; "
                             f"is it the embedded worker (python -m servegate worker)?")
        return parse_server_info(doc)
