"""Fault-injection switches of the embedded worker: test instruments, off by default.

Each switch is a command-line flag ``--fault-<name>`` and an environment variable
``SERVEGATE_FAULT_<NAME>`` (the flag wins). They exist so that every failure path of
the gate can be exercised against a real worker process:

``decode_delay_ms``
    Sleep this long after every decode step, *outside* the forward pass: host overhead
    grows, so throughput drops and ``sglang:fwd_occupancy`` falls.
``decode_slowdown_pct``
    Make every decode forward pass P percent slower by *sleeping* P % of its measured duration
    inside the timed forward window: throughput drops while occupancy stays high. The time is
    spent off the CPU, as waiting on a lock, a device or a synchronisation would.
``decode_compute_pct``
    Make every decode forward pass P percent slower by *computing*: after it, small matrix
    products run on the forward's thread, inside the timed window, for P % of the CPU time the
    forward took on that thread (its CPU clock, not the wall clock). The time is spent on the CPU,
    as a slower kernel's would. The two differ where the workers share a core (the paired stage's
    duet on one CPU set): there a side's time off the CPU is the other side's time on it, so a
    sleep shows up to twice its size, while this shows at face value. (Sized on the wall clock, it
    grew with the other side's turns too: a 3 % fault moved a duet's ITL by 4 %.)
``slow_activation_factor``
    Compute each MLP's activation (the HF model's ``mlp.act_fn`` modules: ``aten::silu`` in Llama
    and SmolLM2) K times per call, returning the same result: one real operator becomes slower,
    as a worse kernel would, and an operator profile shows which (``decode_slowdown_pct`` is a
    sleep, which no operator profile can name). Prefill and decode alike. Measured here (1 torch
    thread, load 3-5 on 2 cores, 4 prompts x 64 tokens): K = 1000 makes the tiny random model's
    requests 3.4x slower, K = 50 SmolLM2-135M's 1.6x. A profile holds K times the activation's
    events: SmolLM2 at K = 1000 writes a trace of millions of events (minutes to export), so give a
    30-layer model a K near 50.
``crash_after_requests``
    ``os._exit(1)`` right after the N-th completed user request (``/generate`` and the
    OpenAI routes; ``/health_generate`` does not count) has been answered.
``flush_busy_s``
    Every flush request sees the worker as busy for S seconds from the moment it
    arrives: ``/flush_cache?timeout=T`` answers 200 after ~S s when T >= S, and 400 after
    T s otherwise (at once when T = 0).
``occupancy``
    ``nan``: ``sglang:fwd_occupancy`` is always NaN; ``absent``: the gauge is not exported.
``startup_oom``
    The worker SIGKILLs itself during start-up, before it is ready (what the OOM killer does).
``error_rate``
    Answer this fraction of generate requests with HTTP 500, drawn from a seeded RNG
    (seed ``SERVEGATE_FAULT_SEED``, default 0) so a run is reproducible.
``cut_stream_after_tokens``
    Streaming responses are cut (connection closed without the final chunk or
    ``data: [DONE]``) once N tokens have been sent.
``corrupt_logits``
    Rotate the logits by one vocabulary position before sampling and before log-probs
    are computed: output is fluent-looking garbage and log-probs are wrong (quality stage).
``random_drafts``
    In NGRAM speculative mode, replace every draft token by a random token id (seeded by
    ``SERVEGATE_FAULT_SEED``): verification rejects nearly all of them, so the accept length
    falls towards 1 while the output stays exactly the greedy output (only verified tokens are
    ever emitted). A broken drafter that the output cannot show; only the accept length can.
``only_first_launch``
    A path: every other fault is active only in the first worker process started with it, which
    creates the file at start-up; a later process that finds it runs without faults. A regression
    that measuring again with fresh workers does not reproduce (the paired stage's confirmation).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any, Literal

from servegate.errors import ConfigError

__all__ = ["FaultConfig", "add_fault_arguments", "burn_cpu_until", "faults_from_args", "slow_down_activations",
           "ENV_PREFIX"]

ENV_PREFIX = "SERVEGATE_FAULT_"


@dataclass(frozen=True)
class FaultConfig:
    """The active faults; the defaults inject nothing."""

    decode_delay_ms: float = 0.0
    decode_slowdown_pct: float = 0.0
    decode_compute_pct: float = 0.0
    slow_activation_factor: int = 1
    crash_after_requests: int | None = None
    flush_busy_s: float = 0.0
    occupancy: Literal["nan", "absent"] | None = None
    startup_oom: bool = False
    error_rate: float = 0.0
    cut_stream_after_tokens: int | None = None
    corrupt_logits: bool = False
    random_drafts: bool = False
    only_first_launch: str | None = None
    seed: int = 0

    def active(self) -> dict[str, Any]:
        """The switches that differ from their defaults (for logs and server info)."""
        default = FaultConfig()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name) and f.name not in ("seed", "only_first_launch")}


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``--fault-*`` flags (defaults None so the environment can fill in)."""
    group = parser.add_argument_group("fault injection (test instruments; also env SERVEGATE_FAULT_<NAME>)")
    group.add_argument("--fault-decode-delay-ms", type=float, default=None, metavar="MS",
                       help="sleep MS after every decode step (host overhead; lowers fwd_occupancy)")
    group.add_argument("--fault-decode-slowdown-pct", type=float, default=None, metavar="P",
                       help="make every decode forward pass P percent slower by sleeping (off the CPU, inside "
                            "the forward window)")
    group.add_argument("--fault-decode-compute-pct", type=float, default=None, metavar="P",
                       help="make every decode forward pass P percent slower by computing (on the CPU, inside the "
                            "forward window; P %% of the CPU time the forward took)")
    group.add_argument("--fault-slow-activation-factor", type=int, default=None, metavar="K",
                       help="compute each MLP activation (aten::silu) K times per call, same result: one operator "
                            "K times slower")
    group.add_argument("--fault-crash-after-requests", type=int, default=None, metavar="N",
                       help="os._exit(1) after the N-th completed user request")
    group.add_argument("--fault-flush-busy-s", type=float, default=None, metavar="S",
                       help="each flush request sees the worker busy for S seconds from its arrival")
    group.add_argument("--fault-occupancy", choices=["nan", "absent"], default=None,
                       help="sglang:fwd_occupancy always NaN, or not exported at all")
    group.add_argument("--fault-startup-oom", action="store_true", default=None,
                       help="SIGKILL itself during start-up, like the OOM killer")
    group.add_argument("--fault-error-rate", type=float, default=None, metavar="F",
                       help="answer fraction F of generate requests with HTTP 500 (seeded)")
    group.add_argument("--fault-cut-stream-after-tokens", type=int, default=None, metavar="N",
                       help="close streaming responses after N tokens, without [DONE]")
    group.add_argument("--fault-corrupt-logits", action="store_true", default=None,
                       help="rotate logits by one position: wrong tokens and log-probs")
    group.add_argument("--fault-random-drafts", action="store_true", default=None,
                       help="NGRAM drafts replaced by random tokens (seeded): accept length falls towards 1, "
                            "output unchanged")
    group.add_argument("--fault-only-first-launch", default=None, metavar="PATH",
                       help="the other faults only in the first worker started with PATH (it creates the file); "
                            "later ones run without faults")


def _env(name: str) -> str | None:
    value = os.environ.get(ENV_PREFIX + name.upper())
    return value if value not in (None, "") else None


def _parse(name: str, raw: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean; use 1 or 0")
    try:
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"fault {name}={raw!r} is not a valid {kind.__name__}; "
                          f"set --fault-{name.replace('_', '-')} or {ENV_PREFIX}{name.upper()} "
                          f"to a {kind.__name__}") from exc


def faults_from_args(args: argparse.Namespace) -> FaultConfig:
    """Flags first, then ``SERVEGATE_FAULT_<NAME>``, then the defaults; values are checked."""
    kinds: dict[str, type] = {
        "decode_delay_ms": float, "decode_slowdown_pct": float, "decode_compute_pct": float,
        "slow_activation_factor": int,
        "crash_after_requests": int,
        "flush_busy_s": float, "occupancy": str, "startup_oom": bool, "error_rate": float,
        "cut_stream_after_tokens": int, "corrupt_logits": bool, "random_drafts": bool, "only_first_launch": str,
    }
    values: dict[str, Any] = {}
    for name, kind in kinds.items():
        raw = getattr(args, f"fault_{name}", None)
        if raw is None:
            raw = _env(name)
        if raw is not None:
            values[name] = _parse(name, raw, kind)
    seed = _env("seed")
    if seed is not None:
        values["seed"] = _parse("seed", seed, int)
    cfg = FaultConfig(**values)
    if min(cfg.decode_delay_ms, cfg.decode_slowdown_pct, cfg.decode_compute_pct, cfg.flush_busy_s) < 0:
        raise ConfigError("fault delays must be >= 0 (decode_delay_ms, decode_slowdown_pct, decode_compute_pct, "
                          "flush_busy_s)")
    if not 0.0 <= cfg.error_rate <= 1.0:
        raise ConfigError(f"fault error_rate must be within [0, 1], got {cfg.error_rate}")
    if cfg.occupancy not in (None, "nan", "absent"):
        raise ConfigError(f"fault occupancy must be 'nan' or 'absent', got {cfg.occupancy!r}")
    if cfg.slow_activation_factor < 1:
        raise ConfigError(f"fault slow_activation_factor must be >= 1 (times each activation is computed), got "
                          f"{cfg.slow_activation_factor}")
    for name in ("crash_after_requests", "cut_stream_after_tokens"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"fault {name} must be >= 1, got {value}")
    if cfg.only_first_launch is not None:
        try:
            os.close(os.open(cfg.only_first_launch, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return FaultConfig(seed=cfg.seed, only_first_launch=cfg.only_first_launch)  # a later launch: no faults
        except OSError as exc:
            raise ConfigError(f"fault only_first_launch: cannot create {cfg.only_first_launch}: {exc}") from exc
    return cfg


def burn_cpu_for(cpu_s: float) -> None:
    """The ``decode_compute_pct`` fault: compute on this thread until it has spent ``cpu_s`` more seconds on
    the CPU (its own CPU clock, ``time.thread_time``), however long the turns of other processes on its core
    make that in wall time."""
    import time

    burn_cpu_until(time.thread_time() + cpu_s, time.thread_time)


def burn_cpu_until(deadline: float, clock: Any = None) -> None:
    """Small matrix products on this thread until ``clock()`` (``time.perf_counter``) reaches ``deadline``.
    torch releases the GIL inside each product, so the worker's other threads (HTTP, streaming) keep
    running as they do beside a real forward pass."""
    import time

    import torch

    clock = clock or time.perf_counter
    a = torch.ones(48, 48)
    while clock() < deadline:
        torch.mm(a, a)


def slow_down_activations(model: Any, factor: int) -> int:
    """The ``slow_activation_factor`` fault: every ``<module>.mlp.act_fn`` of ``model`` computed
    ``factor`` times per call (the extra results dropped); returns how many activations it slowed.

    ``ConfigError`` when the model has no such module (the fault would silently do nothing)."""
    import torch

    class RepeatedActivation(torch.nn.Module):
        def __init__(self, act: torch.nn.Module, times: int) -> None:
            super().__init__()
            self.act = act
            self.times = times

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.times - 1):
                self.act(x)
            return self.act(x)

    slowed = 0
    for module in list(model.modules()):
        mlp = getattr(module, "mlp", None)
        act = getattr(mlp, "act_fn", None)
        if isinstance(act, torch.nn.Module) and not isinstance(act, RepeatedActivation):
            mlp.act_fn = RepeatedActivation(act, factor)
            slowed += 1
    if not slowed:
        raise ConfigError(f"--fault-slow-activation-factor: {type(model).__name__} has no mlp.act_fn module to "
                          f"slow down; the fault supports Llama-style models (SmolLM2, tiny-random)")
    return slowed
