"""The solo effect of a candidate build: its scheduler's decode steps and the baseline's, alternated one by
one in one process, never at the same time.

What the paired gate's reading is held against (``servegate calibrate --paired --regressions``). Each side
loads its own code (the baseline: this package; the candidate: the same package from a tree, e.g. a zoo
member's, :mod:`servegate.paired.zoo`), its own model with its own CPU fast path, and its own real
:class:`~servegate.worker.scheduler.Scheduler`, which is driven step by step here instead of from its
thread: both batches of the paired workload (``requests_per_block`` prompts of ``input_len`` random tokens,
``output_len`` greedy tokens each, ``ignore_eos``) are in flight together, and the two schedulers take
turns, one decode step each (prefill, forward, sampling, the scheduler's per-token Python, its metrics).

The prompts arrive as they reach the gate's workers: a paired block sends them all at once, and the
worker's scheduler wakes on the first, prefills it alone, runs a decode step and then admits the other
three together (``arrivals="served"``, the default: what ``benchmarks/duet_admissions.py`` read off 20 of 20
blocks of real duets). The batch shape decides what a change costs: admitted together (``"aligned"``) the
decode batch is mask-free, and a change to the attention kernel read +25 % there and x0.975 with one
prompt per turn (``"ragged"``), where the gate read x0.99; a fixed cost per step is a larger share of the
aligned step (32-34 ms) than of the ragged one (43-45 ms). ``benchmarks/solo_arrivals.py`` prints a member
on each shape side by side (docs/paired.md).
Each step runs alone on the core, so the change is measured at its solo size; and the two sides' steps
are tens of milliseconds apart, so the machine's swings in speed, which make blocks measured one after
the other differ by 12-14 % here (docs/paired.md), fall on both alike.

Two builds in one process: the baseline's ``servegate`` modules are imported first and set aside, then
the candidate's from its tree; each side's objects keep their own modules' globals, and the side's
modules are put back into ``sys.modules`` before each of its steps, for any import made at call time.
HTTP streaming is not in the measurement (it is the same code on both sides); per round the ratio of the
two sides' median step time is one sample, and the result is its geometric mean over the rounds with a
t interval.

Run as ``python -P -m servegate.paired.solo --candidate-tree DIR [--baseline-tree DIR] --json``: a fresh
process per measurement, pinned to ``--cpu``, with one torch thread as the paired workers have.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["SoloEffect", "NAMED_ARRIVALS", "DEFAULT_ARRIVALS", "admission_plan", "measure_solo", "run_solo", "main"]

PACKAGE = "servegate"


@dataclass(frozen=True)
class SoloEffect:
    """The candidate's decode step against the baseline's, alternated in one process."""

    ratio: float
    ci_low: float
    ci_high: float
    rounds: int
    sd_log: float
    baseline_step_ms: float
    candidate_step_ms: float
    baseline_build: str
    candidate_build: str
    seconds: float


def _own_modules() -> dict[str, ModuleType]:
    return {k: m for k, m in sys.modules.items() if k == PACKAGE or k.startswith(PACKAGE + ".")}


def _import_build(tree: Path | None) -> dict[str, ModuleType]:
    """Import the worker's modules of the build in ``tree`` (None: wherever ``servegate`` resolves without
    it) into a clean ``servegate`` namespace; returns them, and leaves them out of ``sys.modules``."""
    for name in _own_modules():
        del sys.modules[name]
    if tree is not None:
        sys.path.insert(0, str(tree))
    try:
        import servegate.models  # noqa: F401  (each import binds the build's own modules)
        import servegate.provenance  # noqa: F401
        import servegate.worker.fastpath  # noqa: F401
        import servegate.worker.metrics  # noqa: F401
        import servegate.worker.request  # noqa: F401
        import servegate.worker.sampling  # noqa: F401
        import servegate.worker.scheduler  # noqa: F401
    finally:
        if tree is not None:
            sys.path.remove(str(tree))
    modules = _own_modules()
    for name in modules:
        del sys.modules[name]
    return modules


@contextlib.contextmanager
def _active(modules: dict[str, ModuleType]) -> Iterator[None]:
    saved = _own_modules()
    for name in saved:
        del sys.modules[name]
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in _own_modules():
            del sys.modules[name]
        sys.modules.update(saved)


class _Side:
    """One build: its modules, model, tokenizer and scheduler (not started: stepped from here)."""

    def __init__(self, modules: dict[str, ModuleType], model_path: Path, max_total_tokens: int) -> None:
        self.modules = modules
        with _active(modules):
            models = modules["servegate.models"]
            model, tokenizer = models.load_model(model_path, "bfloat16")
            modules["servegate.worker.fastpath"].speed_up(model)
            self.build = modules["servegate.provenance"].source_identity()["digest"]
            sched = modules["servegate.worker.scheduler"]
            metrics = modules["servegate.worker.metrics"].WorkerMetrics("solo", enabled=True)
            self.scheduler = sched.Scheduler(model, tokenizer, sched.SchedulerConfig(
                max_total_tokens=max_total_tokens, max_running_requests=64,
                context_length=int(getattr(model.config, "max_position_embeddings", 2048)),
                enable_prefix_cache=False), metrics=metrics)
        self.step_s: list[float] = []

    def submit(self, prompts: list[list[int]], output_len: int) -> None:
        request = self.modules["servegate.worker.request"]
        params = self.modules["servegate.worker.sampling"].SamplingParams(
            max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        with _active(self.modules):
            reqs = [request.Request(input_ids=list(p), params=params) for p in prompts]
            self.scheduler.submit_batch(reqs)
            with self.scheduler._cv:
                admitted = self.scheduler._admit_locked()
            self.scheduler._prefill(admitted)

    @property
    def running(self) -> bool:
        return bool(self.scheduler.batch.rows)

    def step(self) -> None:
        with _active(self.modules):
            t0 = time.perf_counter()
            self.scheduler._decode_step()
            self.step_s.append(time.perf_counter() - t0)


def _t_interval(samples: list[float], confidence: float) -> tuple[float, float, float]:
    from scipy import stats

    mean = statistics.fmean(samples)
    sd = statistics.stdev(samples) if len(samples) > 1 else math.nan
    half = stats.t.ppf(0.5 + confidence / 2, len(samples) - 1) * sd / math.sqrt(len(samples))
    return mean, mean - half, mean + half


NAMED_ARRIVALS = {
    "served": "the first prompt alone, the rest one decode step later, as a paired block reaches the worker",
    "ragged": "one prompt admitted per scheduler turn",
    "aligned": "the block's prompts admitted together",
}
"""Admission patterns by name; any other is written as its counts per scheduler turn (``"1,3"``).

``served`` is what the embedded worker does with a paired block (all its requests sent at once): its
scheduler wakes on the first request and prefills it alone while the others arrive, then admits them
together. Read off real duets with ``benchmarks/duet_admissions.py``: ``1,3`` in 20 of 20 blocks of a
smoke-ab A/A (10 rounds, both sides; 2026-12-07)."""
DEFAULT_ARRIVALS = "served"


def admission_plan(arrivals: str, requests: int) -> list[int]:
    """How many of the block's ``requests`` prompts each scheduler turn admits (a turn: its arrivals prefilled
    together, then one decode step of the batch), from ``arrivals``: a name of :data:`NAMED_ARRIVALS`
    (``"served"``: one, then the rest; ``"ragged"``: one per turn; ``"aligned"``: all in the first turn) or
    the counts per turn, comma-separated, as
    ``benchmarks/duet_admissions.py`` reads them off a real worker (``"1,3"``: one, a decode step, three;
    ``"1,0,3"``: two decode steps between). ``ValueError`` names what is wrong."""
    if arrivals == "served":
        return [1, requests - 1] if requests > 1 else [1]
    if arrivals == "ragged":
        return [1] * requests
    if arrivals == "aligned":
        return [requests]
    try:
        plan = [int(part) for part in arrivals.split(",")]
    except ValueError:
        plan = []
    if not plan or any(n < 0 for n in plan) or sum(plan) != requests or plan[0] == 0:
        raise ValueError(f"arrivals must be {' or '.join(NAMED_ARRIVALS)} or the prompts admitted per scheduler "
                         f"turn, comma-separated, starting above 0 and adding up to the block's {requests} "
                         f"requests (e.g. 1,{requests - 1}), got {arrivals!r}")
    return plan


def measure_solo(candidate_tree: Path, *, baseline_tree: Path | None = None, model: str = "smollm2-135m",
                 rounds: int = 20, requests_per_block: int = 4, input_len: int = 64, output_len: int = 64,
                 seed: int = 0, confidence: float = 0.95, candidate_first: bool = False,
                 arrivals: str = DEFAULT_ARRIVALS) -> SoloEffect:
    """Alternate the two builds' decode steps over ``rounds`` rounds of the paired workload (fresh random
    prompts per round, the same for both sides; which side steps first alternates by round).
    ``candidate_first``: load the candidate's build and model before the baseline's (where each model's
    memory lands is an offset of the process, :func:`run_solo` averages it over processes).
    ``arrivals``: which prompts each scheduler turn admits (:func:`admission_plan`)."""
    plan = admission_plan(arrivals, requests_per_block)
    import torch

    from servegate.models import ensure_model

    torch.set_num_threads(1)
    model_path = ensure_model(model)
    capacity = 4 * requests_per_block * (input_len + output_len)
    trees = [baseline_tree, Path(candidate_tree).resolve()]
    loaded = {i: _Side(_import_build(trees[i]), model_path, capacity) for i in ((1, 0) if candidate_first else (0, 1))}
    sides = [loaded[0], loaded[1]]
    vocab = int(sides[0].scheduler.tokenizer.vocab_size)
    log_ratios: list[float] = []
    medians: list[tuple[float, float]] = []
    t_start = time.perf_counter()
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms both up and is not counted
            rng = random.Random(seed + r)
            prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(requests_per_block)]
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                side.step_s.clear()
            queued = list(prompts)
            for count in plan:  # one scheduler turn: the turn's arrivals prefilled, then one decode step
                turn, queued = queued[:count], queued[count:]
                for side in order:
                    if turn:
                        side.submit(turn, output_len)
                    if side.running:
                        side.step()
            while any(side.running for side in order):
                for side in order:
                    if side.running:
                        side.step()
            if r == 0:
                continue
            a, b = (statistics.median(side.step_s) for side in sides)
            medians.append((a, b))
            log_ratios.append(math.log(b / a))
    mean, low, high = _t_interval(log_ratios, confidence)
    return SoloEffect(ratio=math.exp(mean), ci_low=math.exp(low), ci_high=math.exp(high), rounds=len(log_ratios),
                      sd_log=statistics.stdev(log_ratios),
                      baseline_step_ms=1000 * statistics.median(m[0] for m in medians),
                      candidate_step_ms=1000 * statistics.median(m[1] for m in medians),
                      baseline_build=sides[0].build, candidate_build=sides[1].build,
                      seconds=round(time.perf_counter() - t_start, 1))


SOLO_TIMEOUT_S = 1800.0
"""Longest one solo process may take (two model loads and the rounds: ~60 s for 10 rounds here)."""


def run_solo(candidate_tree: Path, *, model: str, requests_per_block: int, input_len: int, output_len: int,
             rounds: int = 8, processes: int = 4, cpu: int | None = None, log_path: Path | None = None,
             confidence: float = 0.95, arrivals: str = DEFAULT_ARRIVALS) -> dict[str, Any]:
    """The solo effect over ``processes`` fresh processes of :func:`measure_solo`, ``rounds`` rounds each,
    alternating which build loads first: the ratio is the geometric mean of the processes' ratios and its
    interval a t interval over them. Two models in one process differ by about 1 % by where their memory
    lands (an A/A measured x0.990 [0.986, 0.994] in one process here), so the processes, not the rounds,
    are the samples. The :class:`SoloEffect` fields of the whole, with ``per_process`` the processes' own."""
    per_process = [_solo_process(candidate_tree, model=model, requests_per_block=requests_per_block,
                                 input_len=input_len, output_len=output_len, rounds=rounds, cpu=cpu,
                                 log_path=log_path, candidate_first=bool(i % 2), arrivals=arrivals)
                   for i in range(processes)]
    logs = [math.log(p["ratio"]) for p in per_process]
    mean, low, high = _t_interval(logs, confidence) if len(logs) > 1 else (logs[0], math.nan, math.nan)
    return {"ratio": math.exp(mean), "ci_low": math.exp(low), "ci_high": math.exp(high),
            "rounds": sum(p["rounds"] for p in per_process), "processes": len(per_process),
            "sd_log": statistics.stdev(logs) if len(logs) > 1 else math.nan,
            "baseline_step_ms": statistics.median(p["baseline_step_ms"] for p in per_process),
            "candidate_step_ms": statistics.median(p["candidate_step_ms"] for p in per_process),
            "baseline_build": per_process[0]["baseline_build"], "candidate_build": per_process[0]["candidate_build"],
            "seconds": round(sum(p["seconds"] for p in per_process), 1), "arrivals": arrivals,
            "per_process": per_process}


def _solo_process(candidate_tree: Path, *, model: str, requests_per_block: int, input_len: int, output_len: int,
                  rounds: int, cpu: int | None, log_path: Path | None, candidate_first: bool,
                  arrivals: str = DEFAULT_ARRIVALS, timeout_s: float = SOLO_TIMEOUT_S) -> dict[str, Any]:
    """:func:`measure_solo` in a fresh process (``python -P``: this package as the baseline, whatever the
    working directory holds), its whole tree ended on every exit path; the :class:`SoloEffect` as a dict.
    Its stderr goes to ``log_path``; ``InfraError`` when it fails or outlives ``timeout_s``."""
    import subprocess

    from servegate.errors import InfraError
    from servegate.proctree import end_session, guard_process_tree, watch_group

    cmd = [sys.executable, "-P", "-m", "servegate.paired.solo", "--candidate-tree", str(candidate_tree),
           "--model", model, "--rounds", str(rounds), "--requests-per-block", str(requests_per_block),
           "--input-len", str(input_len), "--output-len", str(output_len), "--arrivals", arrivals, "--json"]
    if cpu is not None:
        cmd += ["--cpu", str(cpu)]
    if candidate_first:
        cmd += ["--candidate-first"]
    guard_process_tree()
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    try:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                   start_new_session=True, close_fds=True)
        watch_group(process.pid)
        try:
            out, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise InfraError(f"the solo measurement of {candidate_tree} ran past {timeout_s:.0f} s; see "
                             f"{log_path}") from exc
        finally:
            end_session(process, 10.0)
    finally:
        if log_path is not None:
            log.close()  # type: ignore[union-attr]
    if process.returncode != 0:
        raise InfraError(f"the solo measurement of {candidate_tree} failed (exit {process.returncode}); see "
                         f"{log_path} for its error")
    try:
        return dict(json.loads(out.decode().strip().splitlines()[-1]))
    except (ValueError, IndexError) as exc:
        raise InfraError(f"the solo measurement of {candidate_tree} printed no result ({out[-200:]!r})") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m servegate.paired.solo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidate-tree", type=Path, required=True, help="folder holding the candidate's servegate/")
    parser.add_argument("--baseline-tree", type=Path, help="folder holding the baseline's (default: this one)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests-per-block", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    parser.add_argument("--candidate-first", action="store_true", help="load the candidate's build first")
    parser.add_argument("--arrivals", default=DEFAULT_ARRIVALS,
                        help="the prompts admitted per scheduler turn: " + ", ".join(
                            f"{name} ({what})" for name, what in NAMED_ARRIVALS.items())
                        + ", or the counts, comma-separated (1,3)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        admission_plan(args.arrivals, args.requests_per_block)
    except ValueError as exc:
        parser.error(str(exc))
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    effect = measure_solo(args.candidate_tree, baseline_tree=args.baseline_tree, model=args.model,
                          rounds=args.rounds, requests_per_block=args.requests_per_block,
                          input_len=args.input_len, output_len=args.output_len, candidate_first=args.candidate_first,
                          arrivals=args.arrivals)
    if args.json:
        print(json.dumps(asdict(effect)))
    else:
        print(f"solo effect x{effect.ratio:.4f} [{effect.ci_low:.4f}, {effect.ci_high:.4f}] over {effect.rounds} "
              f"rounds (decode step {effect.baseline_step_ms:.2f} -> {effect.candidate_step_ms:.2f} ms; "
              f"builds {effect.baseline_build} / {effect.candidate_build}; {effect.seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
