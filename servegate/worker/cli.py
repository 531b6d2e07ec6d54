"""``servegate worker``: start the embedded CPU worker (SGLang-compatible HTTP server).

``servegate/cli.py`` calls :func:`add_arguments` on its ``worker`` sub-parser and then
:func:`run`. ``python -m servegate.worker.cli ...`` runs the same thing standalone.

Start-up order: the KV budget is planned from the model's config and the memory
budget *before* anything binds a port (a budget too small for one full-length request
is a ``ConfigError`` and a non-zero exit); then the HTTP server starts and answers
``/health`` with 503 while the model loads in a background thread, and 200 once the
scheduler runs.

The API key comes from ``$SERVEGATE_API_KEY`` (how servegate launches the worker: a command
line is visible to every user in ``ps``, a process's environment only to its owner) or, for
manual use, ``--api-key``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from servegate.errors import ConfigError, ServegateError
from servegate.worker.faults import add_fault_arguments, faults_from_args, slow_down_activations

__all__ = ["add_arguments", "run", "main", "DEFAULT_MEM_FRACTION_STATIC", "DEFAULT_MAX_RUNNING_REQUESTS",
           "DEFAULT_CHUNKED_PREFILL_SIZE", "API_KEY_ENV"]

log = logging.getLogger("servegate.worker")

DEFAULT_MEM_FRACTION_STATIC = 0.4
"""Share of available RAM (weights + KV) when neither budget flag is given."""
DEFAULT_MAX_RUNNING_REQUESTS = 32
DEFAULT_CHUNKED_PREFILL_SIZE = 2048
"""SGLang's default ``--chunked-prefill-size`` (``SchedulerConfig.chunked_prefill_size``)."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
API_KEY_ENV = "SERVEGATE_API_KEY"
"""The worker's API key by environment (how servegate launches it); ``--api-key`` wins when given."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the worker's flags (SGLang's spelling where SGLang has one)."""
    parser.add_argument("--model", "--model-path", dest="model", default="smollm2-135m",
                        help="model alias (smollm2-135m, tiny-random) or a local model directory")
    parser.add_argument("--served-model-name", default=None, help="name reported in /v1/models and metric labels")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    parser.add_argument("--max-total-tokens", type=int, default=None, metavar="N",
                        help="KV cache capacity in tokens (running requests plus prefix cache)")
    parser.add_argument("--mem-fraction-static", type=float, default=None, metavar="F",
                        help=f"share of available RAM for weights + KV cache (default {DEFAULT_MEM_FRACTION_STATIC} "
                             f"when --max-total-tokens is not given)")
    parser.add_argument("--max-running-requests", type=int, default=DEFAULT_MAX_RUNNING_REQUESTS, metavar="N")
    parser.add_argument("--chunked-prefill-size", type=int, default=DEFAULT_CHUNKED_PREFILL_SIZE, metavar="N",
                        help=f"most prompt tokens per prefill forward pass, padding included (default "
                             f"{DEFAULT_CHUNKED_PREFILL_SIZE}): longer prompts are prefilled in chunks, and requests "
                             f"admitted together are prefilled in one pass while their padded batch fits")
    parser.add_argument("--context-length", type=int, default=None, metavar="N",
                        help="longest prompt + output (default: the model's max_position_embeddings)")
    parser.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics on /metrics")
    parser.add_argument("--decode-log-interval", type=int, default=40, metavar="STEPS",
                        help="decode steps per metrics window (fwd_occupancy, gen_throughput), as SGLang")
    parser.add_argument("--disable-radix-cache", action="store_true", help="turn the prefix cache off")
    parser.add_argument("--disable-cpu-fastpath", action="store_true",
                        help="run transformers' default kernels: no oneDNN-packed bfloat16 weights, attention in "
                             "the model's dtype (servegate/worker/fastpath.py; for A/B runs and debugging)")
    parser.add_argument("--speculative-algorithm", choices=["NGRAM"], default=None,
                        help="NGRAM speculative decoding (requests are then served one at a time)")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="K")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' (not on /health*, /metrics); the command line is "
                             f"visible to every user, so prefer the environment variable {API_KEY_ENV}")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: all CPUs but one, left to the HTTP loop and the client)")
    parser.add_argument("--random-seed", type=int, default=0, help="seed of the sampler")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--profiler-dir", default=None, metavar="DIR",
                        help="enable POST /start_profile and /stop_profile (vLLM's routes; 404 without this option): "
                             "torch.profiler traces of the model's operators, written to DIR as "
                             "*.pt.trace.json.gz (Chrome trace format)")
    add_fault_arguments(parser)


def _weight_bytes(path: Path, dtype_bytes: int) -> int:
    """Parameter count from the safetensors headers (no tensor data read) times the dtype size."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                n = 1
                for dim in fh.get_slice(key).get_shape():
                    n *= dim
                total += n
    return total * dtype_bytes


def _server_args(args: argparse.Namespace, model_path: Path, context_length: int, faults: Any) -> dict[str, Any]:
    keep = {k: v for k, v in vars(args).items() if not k.startswith("fault_") and not callable(v)
            and k not in ("command", "api_key")}
    keep.update({
        "model_path": str(model_path),
        "served_model_name": args.served_model_name or args.model,
        "context_length": context_length,
        "tp_size": 1,
        "dp_size": 1,
        "api_key": "<set>" if args.api_key else None,
        "disable_radix_cache": bool(args.disable_radix_cache),
        "faults": faults.active(),
    })
    return keep


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$SERVEGATE_API_KEY`` (removed from the environment once read, so that
    nothing the worker starts inherits it); None (no key required) when both are empty."""
    from_env = os.environ.pop(API_KEY_ENV, "")
    return args.api_key or from_env or None


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code. Raises ``ConfigError`` for a bad budget."""
    import psutil
    import uvicorn
    from transformers import AutoConfig

    import servegate
    from servegate.worker.kv_budget import kv_bytes_per_token, plan_token_capacity
    from servegate.worker.metrics import WorkerMetrics
    from servegate.models import ensure_model
    from servegate.worker.http_plumbing import WorkerState
    from servegate.worker.server import build_app

    # force: the servegate command's own console handler (warnings only unless -v) would otherwise make
    # this a no-op, and --log-level would not reach the worker's loggers.
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    args.api_key = _api_key(args)
    faults = faults_from_args(args)
    if faults.active():
        log.warning("fault injection active: %s", faults.active())
    if args.speculative_algorithm and not args.speculative_num_draft_tokens:
        args.speculative_num_draft_tokens = 4
    if args.speculative_num_draft_tokens and not args.speculative_algorithm:
        raise ConfigError("--speculative-num-draft-tokens needs --speculative-algorithm NGRAM")
    if faults.random_drafts and not args.speculative_algorithm:
        raise ConfigError("--fault-random-drafts needs --speculative-algorithm NGRAM: without speculative "
                          "decoding there are no drafts to ruin")
    if args.max_running_requests < 1:
        raise ConfigError(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if args.chunked_prefill_size < 1:
        raise ConfigError(f"--chunked-prefill-size must be >= 1 (tokens per prefill forward pass), got "
                          f"{args.chunked_prefill_size}; give a positive number such as the default "
                          f"{DEFAULT_CHUNKED_PREFILL_SIZE}")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static <= 1:
        raise ConfigError(f"--mem-fraction-static must be within (0, 1], got {args.mem_fraction_static}")
    if args.profiler_dir is not None:
        args.profiler_dir = str(Path(args.profiler_dir).resolve())
        try:
            Path(args.profiler_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--profiler-dir {args.profiler_dir}: cannot create it ({exc}); give a writable "
                              f"directory") from exc

    model_path = ensure_model(args.model)
    model_config = AutoConfig.from_pretrained(str(model_path))
    max_pos = int(getattr(model_config, "max_position_embeddings", 2048))
    context_length = args.context_length or max_pos
    if context_length < 2:
        raise ConfigError(f"--context-length must be >= 2, got {context_length}")
    if context_length > max_pos:
        raise ConfigError(f"--context-length {context_length} exceeds the model's max_position_embeddings "
                          f"{max_pos}; lower it")
    dtype_bytes = DTYPE_BYTES[args.dtype]
    bytes_per_token = kv_bytes_per_token(model_config, dtype_bytes)
    weight_bytes = _weight_bytes(model_path, dtype_bytes)
    mem_fraction = args.mem_fraction_static
    if mem_fraction is None and args.max_total_tokens is None:
        mem_fraction = DEFAULT_MEM_FRACTION_STATIC
    capacity = plan_token_capacity(
        bytes_per_token=bytes_per_token, weight_bytes=weight_bytes,
        available_bytes=psutil.virtual_memory().available, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=mem_fraction, context_length=context_length)
    log.info("KV budget: %d tokens (%d bytes/token, %.3f GiB); weights %.3f GiB; context %d",
             capacity, bytes_per_token, capacity * bytes_per_token / 2**30, weight_bytes / 2**30, context_length)

    model_name = args.served_model_name or args.model
    speculative = args.speculative_algorithm is not None
    metrics = WorkerMetrics(model_name, enabled=args.enable_metrics, occupancy_fault=faults.occupancy,
                            speculative=speculative)
    state = WorkerState(
        model_name=model_name, server_args=_server_args(args, model_path, context_length, faults),
        metrics=metrics, faults=faults, token_capacity=capacity,
        max_running_requests=1 if speculative else args.max_running_requests,
        context_length=context_length, weight_bytes=weight_bytes, kv_bytes_per_token=bytes_per_token,
        version=servegate.__version__, api_key=args.api_key)
    state.error_rng.seed(faults.seed)
    app = build_app(state)
    state.server_args["max_total_tokens"] = args.max_total_tokens
    loader = threading.Thread(target=_load_and_start, name="servegate-loader", daemon=True,
                              args=(state, args, model_path, context_length))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    loader.start()
    try:
        server.run()
    finally:
        if state.scheduler is not None:
            state.scheduler.stop()
    return 0 if server.started else 1


def _load_and_start(state: Any, args: argparse.Namespace, model_path: Path, context_length: int) -> None:
    """Load the model and start the scheduler; on failure end the process (nothing could serve)."""
    import torch

    from servegate.worker.profiler import StepProfiler
    from servegate.worker.scheduler import Scheduler, SchedulerConfig
    from servegate.models import load_model
    from servegate.provenance import source_identity
    from servegate.worker.fastpath import speed_up
    from servegate.worker.server import install_crash_fault

    if state.faults.startup_oom:
        log.error("fault injection: --fault-startup-oom, killing this process with SIGKILL like the OOM killer")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        torch.set_num_threads(args.num_threads or default_thread_count())
        model, tokenizer = load_model(model_path, args.dtype)
        # What it switched shows in /get_server_info, as SGLang shows its chosen backends there.
        state.server_args["cpu_fastpath"] = [] if args.disable_cpu_fastpath else speed_up(model)
        state.server_args["servegate_source"] = source_identity()
        if state.faults.slow_activation_factor > 1:
            slowed = slow_down_activations(model, state.faults.slow_activation_factor)
            log.warning("fault injection: %d MLP activations computed %d times per call", slowed,
                        state.faults.slow_activation_factor)
        scheduler = Scheduler(model, tokenizer, SchedulerConfig(
            max_total_tokens=state.token_capacity, max_running_requests=state.max_running_requests,
            context_length=context_length, decode_log_interval=args.decode_log_interval,
            speculative_num_draft_tokens=args.speculative_num_draft_tokens if args.speculative_algorithm else None,
            enable_prefix_cache=not args.disable_radix_cache, seed=args.random_seed,
            chunked_prefill_size=args.chunked_prefill_size,
        ), metrics=state.metrics, faults=state.faults,
            profiler=StepProfiler(Path(args.profiler_dir)) if args.profiler_dir else None)
        if state.faults.crash_after_requests is not None:
            install_crash_fault(scheduler, state.faults.crash_after_requests)
        scheduler.start()
    except (ServegateError, OSError, RuntimeError, ValueError) as exc:
        log.error("the worker could not load %s: %s", model_path, exc)
        os._exit(1)
    state.tokenizer = tokenizer
    state.scheduler = scheduler
    state.ready.set()
    log.info("worker ready: %s on %d thread(s)", model_path, torch.get_num_threads())


def default_thread_count(cpus: int | None = None) -> int:
    """Intra-op threads for torch: every CPU this process may run on (or of ``cpus`` CPUs) but one.

    The spare core serves the HTTP loop, and on a gate machine the load generator that
    measures us: measured on 2 cores with one other busy process, 2 torch threads decoded at
    0.9 tok/s (OpenMP threads stall each other when one is preempted) against 11.2 tok/s with 1.
    """
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cpus = os.cpu_count() or 1
    return max(1, cpus - 1)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m servegate.worker.cli``)."""
    parser = argparse.ArgumentParser(prog="servegate worker", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ServegateError as exc:
        print(f"servegate worker: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
