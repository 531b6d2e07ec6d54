"""The paired stage: the baseline worker (A) and the candidate (B) measured side by side, in rounds,
until every gated metric is decided or the measurement budget is spent.

A round is one block of ``paired.requests_per_block`` streaming requests (fresh random prompts
per round, the same prompts for both sides) sent to A and to B, each from a flushed, idle worker:
one after the other in ABBA order (``interleaved``) or at the same time (``duet``: both workers on
one shared CPU set, or each on its own; both loads begin together and the side whose block ends
first is kept busy until the other's ends, so that neither runs any of its block alone). Per metric
the round gives one log ratio B/A; the interval over rounds (or over worker instance pairs) is a
group-sequential repeated confidence interval (:mod:`servegate.paired.stats`), looked at after every
round from ``min_rounds`` on. Both workers are restarted every ``rounds_per_worker`` rounds.

Tables (``servegate.tables``): ``paired`` (one row per metric: ratio, interval, decision, how many
rounds and why the measurement stopped), ``paired_rounds`` (per round and metric: A's and B's
values, the log ratio, and the interval as it stood after that round) and ``paired_workers`` (each
worker instance launched: side, engine, model, python, extra args, launch and warm-up seconds).

Profiles (``paired.profile``, with ``paired.confirm``): the confirmation's workers are launched with
their engine's profiler on (:meth:`servegate.engines.base.Engine.with_profiler`, traces into
``<run>/profiles/<side>/``); when the confirmation reproduces a regression, one more block of fresh
prompts, the same for both sides, is sent to each between the engine's own start and stop profile
routes. Both traces stay in the run folder; ``paired_profiles`` (one row per side: status, trace
files, why not) and ``profile_ops`` (the operators whose self time changed most,
:mod:`servegate.profiling`) are the tables. A profile that cannot be recorded is said so there and in
``remarks``; it never changes a decision.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from servegate.compare import decide_change
from servegate.config import PAIRED_METRICS, GateConfig, PairedConfig, ServingConfig, WorkerSpec
from servegate.engine_install import resolve_engine_python
from servegate.engines import get_engine
from servegate.errors import ConfigError, ServegateError, StageError, WorkerDiedError, WorkerLaunchError
from servegate.http import make_session
from servegate.launch import EXIT_GRACE_S
from servegate.proctree import tree_cpu_seconds
from servegate.paired.stats import METHOD, Interval, ratio_interval
from servegate.tables import PAIRED_COLUMNS, PAIRED_PROFILE_COLUMNS, PAIRED_ROUND_COLUMNS, PAIRED_WORKER_COLUMNS

if TYPE_CHECKING:  # pragma: no cover
    from servegate.launch import WorkerHandle

__all__ = ["SIDES", "PairedMeasurement", "block_config", "decide_metric", "design", "did_not_start", "run_paired",
           "stop_reason"]

logger = logging.getLogger("servegate.paired")

FILLER_SEED = 10**9
"""Where the seeds of the duet's keep-busy load start (:meth:`PairedMeasurement._duet_block`)."""

WARMUP_SEED = 2 * 10**9
"""Where the seeds of the warm-up blocks start (:meth:`PairedMeasurement._warmup_blocks`)."""

SIDES = ("baseline", "candidate")
"""A is the baseline, B the candidate; ratios are B/A."""

PROFILE_DIR = "profiles"
"""The run folder's subfolder of the profiler traces, one folder per side."""
PROFILE_REQUEST_TIMEOUT_S = 300.0
"""Longest wait for a start or stop profile answer (a stop writes the trace first)."""
PROFILE_TRACE_WAIT_S = 60.0
"""Longest wait, after the stop answered, for the trace files to appear and stop growing: an engine
may write them after it answers (SGLang: "This will take some time")."""

_UNITS = {"itl_median_ms": "ms", "tpot_median_ms": "ms", "ttft_median_ms": "ms", "e2e_median_ms": "ms",
          "output_throughput": "tok/s", "cpu_ms_per_token": "ms"}
CPU_METRIC = "cpu_ms_per_token"
"""The paired metric the gate reads from the worker's process tree, not from the serving summary."""


def did_not_start(side: str) -> str:
    """How the paired stage's error begins when ``side``'s worker failed to launch (``servegate
    bisect`` tells a build that does not start from one that could not be decided by it)."""
    return f"the {side} worker did not start: "


def block_config(config: GateConfig, round_index: int) -> ServingConfig:
    """The serving load of one block: ``requests_per_block`` requests of fixed lengths, all at once,
    seeded by the round (fresh prompts per round, the same for both sides)."""
    p = config.paired
    return ServingConfig(dataset="random", num_prompts=p.requests_per_block, random_input_len=p.input_len,
                         random_output_len=p.output_len, random_range_ratio=1.0, arrival="all-at-once",
                         request_rate=float("inf"), max_concurrency=p.requests_per_block,
                         protocol=config.serving.protocol, seed=p.seed + round_index,
                         request_timeout_s=p.request_timeout_s, progress=False,
                         max_dispatch_lag_p99_ms=config.serving.max_dispatch_lag_p99_ms)


def _results(futures: dict[str, concurrent.futures.Future]) -> dict[str, Any]:
    """Each future's result; on a failure the first one that is not the other side's broken barrier
    (the side that failed first is what the error should name)."""
    done, _ = concurrent.futures.wait(futures.values(), return_when=concurrent.futures.FIRST_EXCEPTION)
    failed = [f for f in done if f.exception() is not None]
    if failed and all(isinstance(f.exception(), threading.BrokenBarrierError) for f in failed):
        concurrent.futures.wait(futures.values())  # the side that broke it is failing: wait for its error
        failed = [f for f in futures.values() if f.exception() is not None]
    for f in sorted(failed, key=lambda f: isinstance(f.exception(), threading.BrokenBarrierError)):
        f.result()
    return {name: f.result() for name, f in futures.items()}


@dataclass
class _Side:
    name: str
    spec: WorkerSpec
    log: Path
    handle: "WorkerHandle | None" = None
    tokenizer: Any = None


class PairedMeasurement:
    """One paired measurement: both workers, the rounds so far, the tables. ``register`` is told of
    every worker launched (the gate's deadline timer and teardown stop them)."""

    def __init__(self, config: GateConfig, run_dir: Path, *, register: Callable[["WorkerHandle"], None],
                 tables: dict[str, pd.DataFrame], clock: Callable[[], float] = time.monotonic) -> None:
        if config.baseline is None:
            raise ConfigError("the paired stage needs a baseline worker: set [baseline] in the gate config")
        self.config = config
        self.p = config.paired
        self.run_dir = run_dir
        self.sides = {"baseline": _Side("baseline", config.baseline, run_dir / "baseline-worker.log"),
                      "candidate": _Side("candidate", config.worker, run_dir / "worker.log")}
        self.register = register
        self.tables = tables
        self.clock = clock
        self.rounds: list[dict[str, Any]] = []  # per round: order, instance, values per side
        self.workers: list[dict[str, Any]] = []
        self.instance = -1
        self.rng = random.Random(self.p.seed)
        self.started: float | None = None
        # The pause after each flush, before the block's load: a server's busy-wait after its last
        # step (``Engine.idle_spin_s``: vLLM's 1 s) must not land on the measured block.
        spin = max(get_engine(s.spec.engine).idle_spin_s for s in self.sides.values())
        self.settle_s = spin + 0.5 if spin > 0 else 0.0
        self.stopped_because = ""
        self.restart_s: list[float] = []
        # The confirmation (``paired.confirm``): the rounds from ``confirm_from`` on re-measure, with
        # fresh workers and fresh prompts, the gated metrics the first measurement found regressed.
        self.confirm_from: int | None = None
        self.first: dict[str, dict[str, Any]] = {}  # per re-measured metric: the first measurement's figures
        # ``paired.profile``: the confirmation's workers run with their engine's profiler on.
        self.profiling = False
        self.remarks: list[str] = []
        """What the stage should say besides its tables (a profile that could not be recorded)."""

    # -- workers ------------------------------------------------------------------------------
    def _start(self, side: _Side) -> None:
        """Start ``side``'s worker process without waiting for it (:meth:`start_instances` waits)."""
        from servegate.launch import start_worker

        engine = get_engine(side.spec.engine)
        spec = engine.with_profiler(side.spec, self.trace_dir(side.name)) if self.profiling else side.spec
        try:
            side.handle = start_worker(spec, side.log)
        except WorkerLaunchError as exc:
            raise type(exc)(did_not_start(side.name) + str(exc)) from exc
        self.register(side.handle)

    def _ready(self, side: _Side) -> dict[str, Any]:
        """Wait for ``side``'s started worker, warm it up; its ``paired_workers`` row."""
        from servegate.bench.datasets import load_prompt_tokenizer
        from servegate.bench.protocol import protocol_for
        from servegate.bench.warmup import run_warmup

        handle = side.handle  # this thread's own reference: a failure elsewhere clears side.handle
        assert handle is not None
        engine = get_engine(side.spec.engine)
        try:
            handle.wait_ready()
        except WorkerLaunchError as exc:
            raise type(exc)(did_not_start(side.name) + str(exc)) from exc
        launched = handle.startup_s if handle.startup_s is not None else time.perf_counter() - handle.started
        if side.tokenizer is None and protocol_for(engine, self.config.serving.protocol).needs_text_prompts:
            side.tokenizer = load_prompt_tokenizer(side.spec.model)
        t0 = time.perf_counter()
        if self.config.warmup.enabled:
            run_warmup(handle.base_url, engine, self.config.warmup, api_key=side.spec.api_key_value())
        self._warmup_blocks(side, engine)
        warmed = time.perf_counter() - t0
        with make_session(side.spec.api_key_value()) as session:
            build = engine.build_identity(session, handle.base_url)
        return {
            "side": side.name, "instance": self.instance, "engine": side.spec.engine, "model": side.spec.model,
            "python": resolve_engine_python(side.spec.python) if side.spec.python else None,
            # The build's own arguments: the profiler's (paired.profile) are the gate's instrument, not the build's.
            "extra_args": json.dumps(side.spec.extra_args),
            "cpus": json.dumps(side.spec.cpus), "pid": handle.pid, "build": build, "launch_s": round(launched, 3),
            "warmup_s": round(warmed, 3)}

    def _warmup_blocks(self, side: _Side, engine: Any) -> None:
        """``paired.warmup_blocks`` blocks of the measured workload on ``side``'s new instance, nothing measured.

        A fresh worker's first block of the paired workload is not yet its steady state: the attention-eager
        zoo member read its first block x1.14-1.33 against the baseline and every later one x1.04-1.11 (a duet
        and interleaved blocks, 20 rounds on one pair of instances; docs/paired.md), its process still growing
        the memory its larger per-step temporaries take. With a restart every round, the gate read that
        first block only. Prompts of a seed no measured block uses; a failed request is a StageError."""
        from servegate.bench.serving import run_serving

        assert side.handle is not None
        if self.p.warmup_blocks and self.p.client_cpus:
            os.sched_setaffinity(0, set(self.p.client_cpus))  # this thread sends them: the load generator's CPUs
        for k in range(self.p.warmup_blocks):
            load = block_config(self.config, 0).model_copy(update={"seed": WARMUP_SEED + self.instance * 100 + k})
            out = run_serving(side.handle.base_url, engine, load, api_key=side.spec.api_key_value(),
                              tokenizer=side.tokenizer)
            failed = int(out.summary.iloc[0]["failed"])
            if failed:
                raise StageError(f"{failed} of {self.p.requests_per_block} requests of the {side.name} worker's "
                                 f"warm-up block failed (first: {_first_failure(out.requests)}); it cannot be "
                                 f"measured (the worker's side: {side.log})")

    def _stop_all(self) -> None:
        for side in self.sides.values():
            if side.handle is not None:
                side.handle.stop()
                side.handle = None

    def start_instances(self) -> float:
        """(Re)launch both workers: a new instance of each, warmed up; the seconds it took (the previous
        pair's stop included: what a restart costs the measurement).

        Both start up side by side (a restart costs the slower of the two start-ups, not their sum)
        and are warmed up side by side; neither is measured until both are ready and warm.

        In duet mode with a CPU set per side (two different sets), every other instance pair swaps
        the sets: two cores are not alike (the one that also runs the load generator measured 8 %
        slower in an A/A duet here), and a fixed assignment would turn that into a ratio."""
        t0 = time.perf_counter()
        self._stop_all()
        self.instance += 1
        a, b = self.sides["baseline"], self.sides["candidate"]
        if self.p.mode == "duet" and a.spec.cpus and b.spec.cpus and self.instance > 0:
            a.spec, b.spec = (a.spec.model_copy(update={"cpus": b.spec.cpus}),
                              b.spec.model_copy(update={"cpus": a.spec.cpus}))
        sides = [self.sides[name] for name in SIDES]
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(sides))
        try:
            for side in sides:
                self._start(side)
            # Wait in threads, each future's result in this thread (a signal still reaches it); on
            # a failure or a signal both workers stop first, so a thread still waiting fails at once.
            futures = [pool.submit(self._ready, side) for side in sides]
            done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in done:
                future.result()  # the first failure, without waiting for the other side
            rows = [f.result() for f in futures]
        except BaseException:
            self._stop_all()
            raise
        finally:
            pool.shutdown(wait=True)
        took = time.perf_counter() - t0
        self.workers.extend({**row, "pair_s": round(took, 3)} for row in rows)
        self.tables["paired_workers"] = pd.DataFrame(self.workers, columns=PAIRED_WORKER_COLUMNS)
        _check_distinct_builds(a.spec, b.spec, rows[0]["build"], rows[1]["build"])
        return took

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise :class:`WorkerDiedError` naming the side whose worker has exited. ``grace_s``: how long
        to wait for an exit to show (a worker that crashed right after answering is still exiting
        when its last response arrives)."""
        deadline = time.monotonic() + grace_s
        while True:
            for side in self.sides.values():
                if side.handle is not None and not side.handle.is_alive():
                    raise WorkerDiedError(f"the {side.name} worker exited (code {side.handle.returncode}) during "
                                          f"the paired measurement; log tail:\n{side.handle.log_tail(20)}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    # -- one block, one round -----------------------------------------------------------------
    def _block(self, side: _Side, round_index: int, start: threading.Barrier | None = None) -> dict[str, float]:
        """``side``'s block of round ``round_index``: flushed, settled, measured. ``start`` (duet): both
        sides' loads begin together, once both are flushed and settled."""
        from servegate.bench.flush import flush_until_idle
        from servegate.bench.serving import run_serving

        if self.p.client_cpus:
            os.sched_setaffinity(0, set(self.p.client_cpus))  # this thread: the load generator's loop
        assert side.handle is not None
        engine = get_engine(side.spec.engine)
        api_key = side.spec.api_key_value()
        flush_until_idle(side.handle.base_url, engine, self.config.flush, api_key=api_key)
        if self.settle_s:
            time.sleep(self.settle_s)
        if start is not None:
            start.wait(timeout=self.config.flush.timeout_s + self.settle_s + 60.0)
        pid = side.handle.pid
        cpu_before = tree_cpu_seconds(pid) if pid is not None else math.nan
        out = run_serving(side.handle.base_url, engine, block_config(self.config, round_index), api_key=api_key,
                          tokenizer=side.tokenizer)
        cpu_s = (tree_cpu_seconds(pid) if pid is not None else math.nan) - cpu_before
        row = out.summary.iloc[0]
        if int(row["failed"]) > 0:
            first = _first_failure(out.requests)
            raise StageError(f"{int(row['failed'])} of {self.p.requests_per_block} requests to the {side.name} "
                             f"worker failed in round {round_index + 1} (first: {first}); a round with failed "
                             f"requests is not a measurement (the worker's side: {side.log})")
        values = {metric: float(row[column]) for metric, (column, _) in PAIRED_METRICS.items() if metric != CPU_METRIC}
        tokens = int(out.requests["output_tokens"].sum())
        values[CPU_METRIC] = cpu_s * 1000.0 / tokens if tokens > 0 else math.nan
        return values

    def _duet_block(self, side: _Side, round_index: int, start: threading.Barrier,
                    ended: dict[str, threading.Event], kept_busy: dict[str, float]) -> dict[str, float]:
        """``side``'s block in a duet, then, if the other side's block is still running, more of the same
        load (fresh prompts, nothing measured) until it ends: ``kept_busy[side]`` the seconds that took.

        On a shared core the side whose block ends first would otherwise leave the other to run its
        rest alone, at up to twice its shared speed: a candidate needing r times the baseline's CPU per
        token would have a share 1 - 1/r of its tokens from that lone tail, its TPOT and e2e read
        (r + 1)/2 and its median ITL r below r = 2 but r/2 above (a x2 regression could read x1.0)."""
        from servegate.bench.serving import serve_until

        other = ended["candidate" if side.name == "baseline" else "baseline"]
        try:
            values = self._block(side, round_index, start)
        except BaseException:
            start.abort()  # the other side stops waiting for this one
            raise
        finally:
            ended[side.name].set()
        t0 = time.perf_counter()
        if not other.is_set():
            assert side.handle is not None
            # Prompts of a seed no block uses (the next round's block is the next seed).
            load = block_config(self.config, round_index).model_copy(update={"seed": FILLER_SEED + round_index * 1000})
            serve_until(side.handle.base_url, get_engine(side.spec.engine), load, other,
                        api_key=side.spec.api_key_value(), tokenizer=side.tokenizer)
            kept_busy[side.name] = time.perf_counter() - t0
        return values

    def measure_round(self) -> None:
        r = len(self.rounds)
        if self.p.order == "abba":
            order = "AB" if r % 2 == 0 else "BA"
        else:
            order = self.rng.choice(["AB", "BA"])
        names = {"A": "baseline", "B": "candidate"}
        t0 = time.perf_counter()
        values: dict[str, dict[str, float]] = {}
        kept_busy: dict[str, float] = {}
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        try:
            if self.p.mode == "duet":
                start, ended = threading.Barrier(2), {name: threading.Event() for name in SIDES}
                futures = {names[s]: pool.submit(self._duet_block, self.sides[names[s]], r, start, ended, kept_busy)
                           for s in order}
                values = _results(futures)
            else:
                for s in order:  # a thread per block, so that client_cpus pins only the load generator
                    values[names[s]] = pool.submit(self._block, self.sides[names[s]], r).result()
        except BaseException as exc:
            # SIGTERM, Ctrl-C or the other block's failure: stop the workers first, so that a block
            # still waiting on one fails at once instead of holding the teardown for its timeout.
            # A block that failed because its worker died (a refused flush, a cut stream) says so:
            # which side exited, its code and log tail, not only the connection error.
            try:
                if isinstance(exc, Exception) and not isinstance(exc, WorkerDiedError):
                    self.check_alive(grace_s=EXIT_GRACE_S)
            except WorkerDiedError as died:
                self._stop_all()
                raise died from exc
            self._stop_all()
            raise
        finally:
            pool.shutdown(wait=True)
        self.rounds.append({"round": r + 1, "instance": self.instance, "order": order if self.p.mode != "duet"
                            else "A+B", "block_s": time.perf_counter() - t0, "kept_busy_s": sum(kept_busy.values()),
                            **{k: v for k, v in values.items()}})
        self.check_alive()

    # -- statistics ---------------------------------------------------------------------------
    def _log_ratios(self, metric: str) -> list[float]:
        out = []
        for rnd in self.rounds:
            a, b = rnd["baseline"][metric], rnd["candidate"][metric]
            out.append(math.log(b / a) if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b) else math.nan)
        return out

    def _phase(self, metric: str, upto: int | None = None) -> tuple[int, int]:
        """The rounds ``metric``'s figures at round ``upto`` rest on: the confirmation's for a metric
        it re-measures (from its first round on), else the first measurement's."""
        end = len(self.rounds) if upto is None else upto
        if self.confirm_from is not None and metric in self.first:
            return (self.confirm_from, end) if end > self.confirm_from else (0, end)
        return 0, min(end, self.confirm_from) if self.confirm_from is not None else end

    def _decide(self, metric: str, upto: int | None = None) -> tuple[Interval, str]:
        start, end = self._phase(metric, upto)
        return decide_metric(self._log_ratios(metric)[start:end], PAIRED_METRICS[metric][1], self.p,
                             [r["instance"] for r in self.rounds[start:end]])

    def decided(self) -> bool:
        """Every metric the current measurement decides is decided: the gated ones, or in the
        confirmation the ones it re-measures."""
        return all(self._decide(m)[1] != "inconclusive" for m in (self.first or self.p.gated))

    def decision(self, metric: str) -> tuple[Interval, str, str | None]:
        """The interval, the decision and why, of ``metric`` as the gate takes it: a regression the
        confirmation reproduces stays one; one it excludes is ``unconfirmed``; one it can neither
        reproduce nor exclude is inconclusive."""
        iv, decision = self._decide(metric)
        first = self.first.get(metric)
        if first is None or self.confirm_from is None or len(self.rounds) <= self.confirm_from:
            return iv, decision, None
        then = (f"the first measurement (rounds 1-{self.confirm_from}) found a regression, x{first['ratio']:.3f} "
                f"[{first['ci_low']:.3f}, {first['ci_high']:.3f}]")
        again = f"the re-measurement (rounds {self.confirm_from + 1}-{len(self.rounds)}, fresh workers and prompts)"
        if decision == "regression":
            return iv, "regression", f"confirmed: {then}, and {again} reproduced it"
        if decision == "inconclusive":
            return iv, "inconclusive", (f"{then}; {again} neither reproduced nor excluded it; more rounds "
                                        f"(paired.max_measure_s) would decide it")
        return iv, "unconfirmed", (f"unconfirmed: {then}, but {again} excluded a regression of the bound "
                                   f"({decision}); not a failure")

    def publish(self) -> None:
        """Write the tables as they stand (after every round: a failure later keeps them)."""
        rows = []
        for i, rnd in enumerate(self.rounds):
            for metric in PAIRED_METRICS:
                iv, decision = self._decide(metric, i + 1)  # as it stood within that round's measurement
                a, b = rnd["baseline"][metric], rnd["candidate"][metric]
                rows.append({"round": rnd["round"], "instance": rnd["instance"], "order": rnd["order"],
                             "metric": metric, "a_value": a, "b_value": b,
                             "log_ratio": self._log_ratios(metric)[i], "ratio": iv.ratio, "ci_low": iv.ci_low,
                             "ci_high": iv.ci_high, "decision": decision, "block_s": round(rnd["block_s"], 3),
                             "kept_busy_s": round(rnd["kept_busy_s"], 3)})
        self.tables["paired_rounds"] = pd.DataFrame(rows, columns=PAIRED_ROUND_COLUMNS)
        elapsed = 0.0 if self.started is None else self.clock() - self.started
        summary = []
        for metric, (column, direction) in PAIRED_METRICS.items():
            iv, decision, reason = self.decision(metric)
            gated = metric in self.p.gated
            start, end = self._phase(metric)
            rounds = self.rounds[start:end]
            if reason is None and decision == "inconclusive":
                reason = (f"{len(rounds)} round(s): fewer than min_rounds = {self.p.min_rounds}"
                          if len(rounds) < self.p.min_rounds else
                          f"the interval straddles the bound ±{self.p.bound:.1%} after {len(rounds)} rounds; "
                          f"more rounds (paired.max_measure_s) would decide it")
            summary.append({
                "metric": metric, "column": column, "unit": _UNITS[metric], "direction": direction, "gated": gated,
                "rounds": len(rounds), "baseline_median": _median(r["baseline"][metric] for r in rounds),
                "candidate_median": _median(r["candidate"][metric] for r in rounds), "ratio": iv.ratio,
                "ci_low": iv.ci_low, "ci_high": iv.ci_high, "confidence": self.p.confidence, "bound": self.p.bound,
                "sd_log": iv.sd_log, "decision": decision if gated else "report_only", "paired_decision": decision,
                "reason": reason, "stopped_because": self.stopped_because, "measure_s": round(elapsed, 3),
                "instances": self.instance + 1, "mode": self.p.mode, "order": self.p.order,
                "rounds_per_worker": self.p.rounds_per_worker, "method": METHOD})
        self.tables["paired"] = pd.DataFrame(summary, columns=PAIRED_COLUMNS)

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Launch, then measure rounds until :func:`stop_reason` says stop; with ``paired.confirm``,
        measure again (fresh workers, fresh prompts) what regressed; stop the workers."""
        try:
            self._measure()
            regressed = [m for m in self.p.gated if self._decide(m)[1] == "regression"]
            if regressed and self.p.confirm:
                first_stop = self.stopped_because
                for metric in regressed:
                    iv, _ = self._decide(metric)
                    self.first[metric] = {"ratio": iv.ratio, "ci_low": iv.ci_low, "ci_high": iv.ci_high}
                self.confirm_from = len(self.rounds)
                logger.info("paired: %s regressed after %d rounds; re-measuring with fresh workers to confirm",
                            ", ".join(regressed), self.confirm_from)
                self.profiling = self.p.profile and self.profilable()
                self._measure()
                self.stopped_because = f"{first_stop}; re-measured to confirm: {self.stopped_because}"
                if self.p.profile and any(self.decision(m)[1] == "regression" for m in regressed):
                    self.profile()
            logger.info("paired: %s", self.stopped_because)
            self.publish()
        finally:
            self._stop_all()

    # -- profiles of a confirmed regression -------------------------------------------------------
    def profilable(self) -> bool:
        """Both sides' engines have profiler endpoints the gate can drive."""
        return all(get_engine(s.spec.engine).profiler_routes is not None for s in self.sides.values())

    def trace_dir(self, side: str) -> Path:
        """Where ``side``'s engine writes its profiler traces."""
        return self.run_dir / PROFILE_DIR / side

    def profile(self) -> None:
        """One block of fresh prompts (the same for both sides) sent to each side between its engine's
        start and stop profile routes; the tables ``paired_profiles`` and, when both traces were
        recorded, ``profile_ops``. Never raises for a profile that could not be recorded: that is a
        remark (and the row's ``reason``), not a measurement failure."""
        from servegate.profiling import diff_operator_times, read_operator_times

        round_index = len(self.rounds)  # a seed no measured round used
        rows, traces = [], {}
        for name in SIDES:
            side = self.sides[name]
            engine = get_engine(side.spec.engine)
            row: dict[str, Any] = {"side": name, "engine": engine.name, "status": "failed", "traces": "[]",
                                   "trace_bytes": 0, "requests": self.p.requests_per_block, "profile_s": math.nan,
                                   "itl_median_ms": math.nan, "reason": ""}
            if not self.profiling:
                engines = sorted({s.spec.engine for s in self.sides.values()
                                  if get_engine(s.spec.engine).profiler_routes is None})
                row.update(status="not_applicable", reason=f"engine {', '.join(engines)} has no profiler endpoints "
                                                           f"servegate can drive")
            else:
                try:
                    found, row["profile_s"], row["itl_median_ms"] = self._profile_side(side, round_index)
                    traces[name] = found
                    row.update(status="recorded", trace_bytes=sum(p.stat().st_size for p in found),
                               traces=json.dumps([str(p.relative_to(self.run_dir)) for p in found]))
                except (ServegateError, OSError) as exc:
                    row["reason"] = f"no profile of the {name} worker: {exc}"
            rows.append(row)
        if len(traces) == len(SIDES):
            try:
                self.tables["profile_ops"] = diff_operator_times(read_operator_times(traces["baseline"]),
                                                                 read_operator_times(traces["candidate"]))
            except StageError as exc:
                for row in rows:
                    row.update(status="failed", reason=f"the traces could not be compared: {exc}")
        self.tables["paired_profiles"] = pd.DataFrame(rows, columns=PAIRED_PROFILE_COLUMNS)
        for row in rows:
            if row["status"] != "recorded":
                self.remarks.append(f"profile {row['status'].replace('_', ' ')} ({row['side']}): {row['reason']}")
                logger.warning("paired: %s", self.remarks[-1])

    def _profile_side(self, side: _Side, round_index: int) -> tuple[list[Path], float, float]:
        """Profile one block on ``side``: the new trace files, seconds from start to the traces on disk,
        and the block's median ITL (against the rounds' medians: what the profiler cost)."""
        from servegate.bench.flush import flush_until_idle
        from servegate.bench.serving import run_serving
        from servegate.http import make_session
        from servegate.profiling import find_traces

        assert side.handle is not None
        engine = get_engine(side.spec.engine)
        routes = engine.profiler_routes
        assert routes is not None
        api_key = side.spec.api_key_value()
        base = side.handle.base_url
        trace_dir = self.trace_dir(side.name)
        before = set(find_traces(trace_dir)) if trace_dir.is_dir() else set()
        flush_until_idle(base, engine, self.config.flush, api_key=api_key)
        if self.settle_s:
            time.sleep(self.settle_s)
        t0 = time.perf_counter()
        with make_session(api_key) as session:
            self._profiler_call(session, base, routes.start)
            try:
                out = run_serving(base, engine, block_config(self.config, round_index), api_key=api_key,
                                  tokenizer=side.tokenizer)
            finally:
                self._profiler_call(session, base, routes.stop)
        found = _new_traces(trace_dir, before)
        row = out.summary.iloc[0]
        if int(row["failed"]) > 0:
            first = _first_failure(out.requests)
            raise StageError(f"{int(row['failed'])} of {self.p.requests_per_block} requests failed while profiling "
                             f"(first: {first}; the worker's side: {side.log})")
        return found, round(time.perf_counter() - t0, 3), float(row[PAIRED_METRICS["itl_median_ms"][0]])

    @staticmethod
    def _profiler_call(session: Any, base_url: str, path: str) -> None:
        from servegate.http import body_excerpt, join_url, request_within

        url = join_url(base_url, path)
        response = request_within(session, "POST", url, limit_s=PROFILE_REQUEST_TIMEOUT_S,
                                  what=f"profiler (POST {url})", setting=None)
        if response.status_code != 200:
            raise StageError(f"POST {url} answered {response.status_code}: {body_excerpt(response)!r}; is the "
                             f"engine's profiler enabled (see the worker log)?")

    def _measure(self) -> None:
        """One measurement: fresh instances of both workers, rounds until :func:`stop_reason` says
        stop (counting this measurement's rounds and time only)."""
        first_round = len(self.rounds)
        self.restart_s.append(self.start_instances())  # what a restart is expected to cost
        self.started = self.clock()
        while True:
            r = len(self.rounds) - first_round
            restart = r > 0 and r % self.p.rounds_per_worker == 0
            reason = stop_reason(self.p, r, decided=r >= self.p.min_rounds and self.decided(),
                                 elapsed_s=self.clock() - self.started, next_round_s=self._estimate(restart))
            if reason is not None:
                self.stopped_because = reason
                return
            if restart:
                self.restart_s.append(self.start_instances())
            self.measure_round()
            self.publish()

    def _estimate(self, restart: bool) -> float:
        """What the next round is expected to take: the median of the last 4, plus a restart's cost."""
        recent = [r["block_s"] for r in self.rounds[-4:]]
        block = statistics.median(recent) if recent else 0.0
        return block + (statistics.median(self.restart_s) if restart and self.restart_s else 0.0)


def _first_failure(requests: pd.DataFrame) -> str:
    """The first failed request of a block, as ``kind: error`` (a client-side check can fail a request
    whose answer the worker's log shows as 200, so its log alone does not say why)."""
    failed = requests[~requests["success"]]
    return f"{failed['error_kind'].iloc[0]}: {failed['error'].iloc[0]}" if len(failed) else "?"


def _new_traces(trace_dir: Path, before: set[Path]) -> list[Path]:
    """The trace files in ``trace_dir`` not in ``before``, once they stop growing (within
    :data:`PROFILE_TRACE_WAIT_S`); ``StageError`` when none appeared."""
    from servegate.profiling import find_traces

    deadline = time.monotonic() + PROFILE_TRACE_WAIT_S
    sizes: dict[Path, int] = {}
    while True:
        found = [p for p in (find_traces(trace_dir) if trace_dir.is_dir() else []) if p not in before]
        now = {p: p.stat().st_size for p in found}
        if found and now == sizes:
            return found
        if time.monotonic() >= deadline:
            if found:
                return found
            raise StageError(f"the engine wrote no profiler trace into {trace_dir} within {PROFILE_TRACE_WAIT_S:g} s "
                             f"of the stop; check its log for the profiler's errors")
        sizes = now
        time.sleep(0.5)


def design(p: PairedConfig, restarting: bool) -> tuple[int, int]:
    """The looks of the sequential design: ``(first_look, n_max)`` in samples, which are worker
    instance pairs when the workers restart during the measurement, else rounds."""
    n_max = p.max_rounds // p.rounds_per_worker if restarting else p.max_rounds
    return p.min_units, max(p.min_units, n_max)


def _check_distinct_builds(baseline: WorkerSpec, candidate: WorkerSpec, a_build: str | None,
                           b_build: str | None) -> None:
    """``ConfigError`` when the two sides name different code (another interpreter or ``PYTHONPATH``) but
    their servers report the same build: the gate would measure one build against itself and pass any
    regression. (How a candidate tree on PYTHONPATH once ran the baseline's code: docs/paired.md.) Only
    where both engines' identities are source digests (``Engine.build_identity_is_digest``): equal
    versions of a patched engine are recorded, not refused."""
    if not all(get_engine(spec.engine).build_identity_is_digest for spec in (baseline, candidate)):
        return
    names_other_code = (baseline.python != candidate.python
                        or baseline.env.get("PYTHONPATH") != candidate.env.get("PYTHONPATH"))
    if names_other_code and a_build is not None and a_build == b_build:
        raise ConfigError(
            f"the baseline and the candidate name different builds (python {baseline.python!r} / "
            f"{candidate.python!r}, PYTHONPATH {baseline.env.get('PYTHONPATH')!r} / "
            f"{candidate.env.get('PYTHONPATH')!r}) but both workers report the same one: {a_build}; a paired "
            f"gate of one build against itself passes every regression. Check that the candidate's "
            f"interpreter or PYTHONPATH holds its own code")


def decide_metric(log_ratios: Sequence[float], direction: str, p: PairedConfig,
                  instances: Sequence[int] | None = None) -> tuple[Interval, str]:
    """The interval of one metric's ratio B/A from its per-round log ratios, and its decision
    (inconclusive before ``p.min_rounds`` rounds and ``p.min_units`` samples).

    ``instances`` (the worker instance of each round): when the workers are restarted during the
    measurement, rounds of one instance pair share its offset (memory layout, allocator, thread
    placement), so they are not independent: the samples are then the instance pairs' mean log
    ratios, one per *complete* pair (all ``rounds_per_worker`` rounds measured: a pair cut short
    by the stop has an AB round without its BA, whose order effect does not cancel). Treating the
    rounds as independent instead doubled the false alarms at the bound in
    ``benchmarks/paired_sequential.py``.
    """
    values = list(log_ratios)
    rounds = sum(1 for v in values if math.isfinite(v))
    units = values
    restarting = instances is not None and p.rounds_per_worker < p.max_rounds
    if restarting:
        by_instance: dict[int, list[float]] = {}
        for v, i in zip(values, instances):  # type: ignore[arg-type]
            by_instance.setdefault(i, []).append(v)
        units = [sum(vs) / len(vs) for vs in by_instance.values()
                 if len(vs) == p.rounds_per_worker and all(math.isfinite(v) for v in vs)]
    first_look, n_max = design(p, restarting)
    iv = ratio_interval(units, confidence=p.confidence, first_look=first_look, n_max=n_max, sd_floor=p.sd_floor)
    if iv.rounds < 2 and rounds:  # not bounded yet: the estimate of the rounds so far, no interval
        finite = [v for v in values if math.isfinite(v)]
        iv = Interval(iv.rounds, math.exp(sum(finite) / len(finite)), 0.0, math.inf, math.nan)
    if rounds < p.min_rounds or iv.rounds < p.min_units or not math.isfinite(iv.ci_low):
        return iv, "inconclusive"
    return iv, decide_change(iv.ci_low, iv.ci_high, direction, p.bound)  # type: ignore[arg-type]


def stop_reason(p: PairedConfig, rounds: int, *, decided: bool, elapsed_s: float, next_round_s: float) -> str | None:
    """Why the paired measurement stops after ``rounds`` rounds, or None to measure another.

    ``decided``: every gated metric is decided (looked at from ``min_rounds`` on);
    ``elapsed_s``: measurement time so far; ``next_round_s``: what the next round is expected to
    take (restart included). The first round is always measured.
    """
    if decided:
        return f"every gated metric decided after {rounds} rounds"
    if rounds >= p.max_rounds:
        return f"max_rounds ({p.max_rounds}) reached"
    if rounds > 0 and elapsed_s + next_round_s > p.max_measure_s:
        return f"measurement budget max_measure_s = {p.max_measure_s:g} s: another round would end past it"
    return None


def _median(values: Any) -> float:
    vals = [v for v in values if math.isfinite(v)]
    return float(statistics.median(vals)) if vals else math.nan


def run_paired(config: GateConfig, run_dir: Path, tables: dict[str, pd.DataFrame],
               register: Callable[["WorkerHandle"], None]) -> PairedMeasurement:
    """Measure the paired stage of ``config`` (its tables go into ``tables`` as they are measured)."""
    measurement = PairedMeasurement(config, run_dir, register=register, tables=tables)
    measurement.run()
    return measurement
