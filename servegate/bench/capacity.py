"""Capacity at SLO: the highest request rate the worker sustains with its goodput on target.

A sweep like GuideLLM's: start at ``capacity.start_rate`` and multiply the rate by
``capacity.growth`` while the load's *goodput fraction* — the share of the requests sent that
succeeded and met every SLO set in ``serving.slo_ttft_ms`` / ``slo_tpot_ms`` / ``slo_e2e_ms``
(``stats.goodput_mask``, vLLM's ``--goodput``) — stays at or above ``capacity.goodput_target``,
up to ``capacity.max_rate``; then ``capacity.refine_steps`` bisection steps between the last good
and the first bad rate (midpoint in log rate, as the growth is multiplicative). The capacity is the
highest rate whose load met the target.

Each step is one load of the serving load generator (``serving.run_serving``: serving's dataset,
lengths, arrival law and SLOs, ``capacity.num_prompts`` requests at the step's rate) from a
flushed, idle worker. A step whose client was not valid (it fell behind its schedule or its
arrivals failed their fit) measured another load than the one asked for and cannot decide: it is
flushed and run once more, and a second invalid load fails the stage (``StageError``: the verdict
is inconclusive); the discarded load stays in ``capacity_steps`` with ``client_valid`` False.

The decisions are a pure function of the outcomes so far (:func:`next_step`, :func:`sweep_result`),
tested against recorded outcomes; :func:`run_capacity` only measures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pandas as pd

from servegate.errors import ConfigError, ServegateError, StageError
from servegate.tables import CAPACITY_COLUMNS, CAPACITY_STEP_COLUMNS

if TYPE_CHECKING:  # pragma: no cover
    from servegate.config import CapacityConfig, GateConfig, ServingConfig
    from servegate.engines.base import Engine

__all__ = ["Step", "CapacityResult", "check_capacity_config", "next_step", "sweep_result", "run_capacity"]

Phase = Literal["grow", "refine"]


@dataclass(frozen=True)
class Step:
    """One decided step of the sweep: the rate tried and whether its goodput met the target."""

    phase: Phase
    rate: float
    meets_target: bool


@dataclass
class CapacityResult:
    steps: pd.DataFrame
    """``capacity_steps``: one row per load (a discarded invalid load included)."""
    capacity: pd.DataFrame
    """``capacity``: one row."""
    remarks: list[str] = field(default_factory=list)
    """What a reader should know about how the sweep measured (a load that fits in one batch)."""


def check_capacity_config(config: "GateConfig") -> None:
    """ConfigError when the capacity stage is on but cannot decide anything (before a worker starts)."""
    cap, serving = config.capacity, config.serving
    if not cap.enabled:
        return
    if all(v is None for v in (serving.slo_ttft_ms, serving.slo_tpot_ms, serving.slo_e2e_ms)):
        raise ConfigError("capacity.enabled needs an SLO to measure goodput against: set at least one of "
                          "serving.slo_ttft_ms, serving.slo_tpot_ms, serving.slo_e2e_ms (e.g. --set "
                          "serving.slo_ttft_ms=2000), or --set capacity.enabled=false")
    if serving.arrival == "all-at-once" or serving.dataset == "trace":
        what = "serving.arrival = 'all-at-once'" if serving.arrival == "all-at-once" else "serving.dataset = 'trace'"
        raise ConfigError(f"the capacity sweep sets the request rate of each load, but {what} ignores it; use "
                          f"serving.arrival 'poisson', 'gamma' or 'constant' with a non-trace dataset, or "
                          f"--set capacity.enabled=false")
    if cap.start_rate > cap.max_rate:
        raise ConfigError(f"capacity.start_rate ({cap.start_rate}) is above capacity.max_rate ({cap.max_rate}); "
                          f"lower start_rate or raise max_rate")


def next_step(cfg: "CapacityConfig", steps: Sequence[Step]) -> tuple[Phase, float] | None:
    """The next ``(phase, rate)`` to load, or None when the sweep is over.

    Grow while every step met the target (the last grow step is ``max_rate`` itself); after the
    first failure, bisect (in log rate) between the highest good and the lowest bad rate until
    ``refine_steps`` refine loads have run. A first rate that fails ends the sweep (capacity 0).
    """
    if not steps:
        return "grow", float(cfg.start_rate)
    good = [s.rate for s in steps if s.meets_target]
    bad = [s.rate for s in steps if not s.meets_target]
    if not bad:
        last = steps[-1].rate
        if last >= cfg.max_rate:
            return None
        return "grow", min(last * cfg.growth, float(cfg.max_rate))
    if not good:
        return None
    refined = sum(1 for s in steps if s.phase == "refine")
    if refined >= cfg.refine_steps:
        return None
    return "refine", math.sqrt(max(good) * min(bad))


def sweep_result(cfg: "CapacityConfig", steps: Sequence[Step]) -> dict[str, Any]:
    """``capacity_rps`` (the highest rate that met the target, 0 when none did), ``capacity_bound``
    (``found``; ``at_least_max``: max_rate still met it; ``below_start``: the first rate failed),
    ``last_good_rate`` and ``first_bad_rate`` (NaN when there is none)."""
    good = [s.rate for s in steps if s.meets_target]
    bad = [s.rate for s in steps if not s.meets_target]
    if not steps:
        raise ValueError("a sweep of no steps has no result")
    last_good = max(good) if good else math.nan
    first_bad = min(bad) if bad else math.nan
    bound = "found" if good and bad else ("at_least_max" if good else "below_start")
    return {"capacity_rps": last_good if good else 0.0, "capacity_bound": bound, "last_good_rate": last_good,
            "first_bad_rate": first_bad, "steps": len(steps)}


def _load_config(serving: "ServingConfig", cfg: "CapacityConfig", rate: float) -> "ServingConfig":
    # model_validate, not model_copy(update=...): the step's config is checked like any other.
    data = serving.model_dump()
    data.update(num_prompts=cfg.num_prompts, request_rate=rate, request_timeout_s=cfg.request_timeout_s,
                progress=False)
    return type(serving).model_validate(data)


def _step_row(step: int, phase: Phase, rate: float, sent: int, summary: pd.Series, target: float,
              duration_s: float) -> dict[str, Any]:
    good = int(summary["good_completed"])
    fraction = good / sent if sent else 0.0
    return {"step": step, "phase": phase, "request_rate": rate, "num_prompts": sent,
            "completed": int(summary["completed"]), "failed": int(summary["failed"]), "good_completed": good,
            "goodput_fraction": fraction, "meets_target": bool(fraction >= target),
            "p90_ttft_ms": float(summary["p90_ttft_ms"]), "p90_tpot_ms": float(summary["p90_tpot_ms"]),
            "p90_e2e_latency_ms": float(summary["p90_e2e_latency_ms"]),
            "output_throughput": float(summary["output_throughput"]),
            "client_valid": bool(summary["client_valid"]), "duration_s": round(duration_s, 3)}


def _tables(rows: list[dict[str, Any]], cfg: "CapacityConfig", serving: "ServingConfig", decided: list[Step],
            started: float) -> CapacityResult:
    steps = pd.DataFrame(rows, columns=CAPACITY_STEP_COLUMNS)
    if not decided:
        return CapacityResult(steps, pd.DataFrame(columns=CAPACITY_COLUMNS))
    row = {**sweep_result(cfg, decided), "goodput_target": cfg.goodput_target,
           "slo_ttft_ms": serving.slo_ttft_ms, "slo_tpot_ms": serving.slo_tpot_ms, "slo_e2e_ms": serving.slo_e2e_ms,
           "duration_s": round(time.perf_counter() - started, 3)}
    capacity = pd.DataFrame([row], columns=CAPACITY_COLUMNS)
    for col in ("slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms"):
        capacity[col] = capacity[col].astype(float)
    return CapacityResult(steps, capacity)


def _batch_remark(base_url: str, engine: "Engine", api_key: str | None, num_prompts: int) -> list[str]:
    """A load no larger than the worker's running batch never queues at the worker: however high
    the rate, it is one burst, and the sweep then measures how a burst is served, not a sustained
    rate. Said in the stage's remarks (the server's own figure; nothing when it reports none)."""
    import requests

    from servegate.http import make_session

    try:
        with make_session(api_key) as http:
            running = engine.server_capacity(http, base_url).max_running_requests
    except (ServegateError, requests.RequestException):
        return []
    if math.isfinite(running) and num_prompts <= running:
        return [f"capacity.num_prompts ({num_prompts}) <= the worker's max running requests ({running:g}): each "
                f"load fits in one batch, so the sweep measures bursts, not a sustained rate; raise num_prompts"]
    return []


def run_capacity(base_url: str, engine: "Engine", config: "GateConfig", api_key: str | None = None, *,
                 tokenizer: Any | None = None, partial: dict[str, pd.DataFrame] | None = None) -> CapacityResult:
    """Sweep the request rate (module docstring) and return both tables.

    ``config``: the gate's config (``capacity``, ``serving`` and ``flush`` sections). ``partial``
    (when given) holds ``capacity_steps`` as the sweep goes, so that a stage that fails keeps the
    loads it measured. A load with no successful request, an unreachable server or a refused flush
    raise as from the serving stage; a step whose client stays invalid raises ``StageError``.
    """
    from servegate.bench.flush import flush_until_idle
    from servegate.bench.serving import run_serving

    check_capacity_config(config)
    cfg, serving, flush_cfg = config.capacity, config.serving, config.flush
    remarks = _batch_remark(base_url, engine, api_key, cfg.num_prompts)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    decided: list[Step] = []
    partial = partial if partial is not None else {}
    while (nxt := next_step(cfg, decided)) is not None:
        phase, rate = nxt
        load_cfg = _load_config(serving, cfg, rate)
        for attempt in (1, 2):
            flush_until_idle(base_url, engine, flush_cfg, api_key=api_key)
            t0 = time.perf_counter()
            out = run_serving(base_url, engine, load_cfg, api_key=api_key, tokenizer=tokenizer)
            summary = out.summary.iloc[0]
            rows.append(_step_row(len(rows), phase, rate, len(out.requests), summary, cfg.goodput_target,
                                  time.perf_counter() - t0))
            partial["capacity_steps"] = pd.DataFrame(rows, columns=CAPACITY_STEP_COLUMNS)
            if bool(summary["client_valid"]):
                break
            if attempt == 2:
                why = "; ".join(n for n in out.meta.get("notes", []) if n.startswith("client not valid"))
                raise StageError(f"capacity step at {rate:.4g} req/s: the load generator was not valid twice "
                                 f"({why or 'fell behind its schedule or its arrivals did not fit'}), so the step "
                                 f"cannot decide; the machine is too busy to drive this rate. Lower "
                                 f"capacity.max_rate or run the gate on a quieter machine")
        decided.append(Step(phase, rate, bool(rows[-1]["meets_target"])))
    result = _tables(rows, cfg, serving, decided, started)
    result.remarks.extend(remarks)
    partial.update(capacity_steps=result.steps, capacity=result.capacity)
    return result
