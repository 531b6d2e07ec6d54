"""How this machine's CPU speed moves, and which paired arrangement sees the same machine on both sides.

Two processes each time one fixed piece of pure-Python work over and over for ``--seconds`` and
record every unit's wall time. Per ``--window-s`` window the median unit time is a side's speed
then; the log ratio of the two sides' window speeds is what a paired round of that length sees,
and its sd over the windows is the noise pairing leaves. Three arrangements, one after the other:

- ``two cores``: A pinned to the first CPU, B to the second, at the same time (a duet on disjoint CPUs);
- ``one core``: A and B both pinned to the first CPU, at the same time (the kernel time-slices them
  milliseconds apart: smoke-ab's duet on one core);
- ``one after the other``: A alone on the first CPU; consecutive windows compared, as interleaved
  rounds compare A's block with B's block measured just after it.

Also printed: the sd of one side's window speed (how much the machine itself moves) and, for two
cores, the correlation of the two cores' speeds over 0.25 s bins.

    python benchmarks/core_speed.py [--seconds 60] [--window-s 3]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

WORK_UNITS = 60_000
"""Loop iterations per timed unit: ~2.5 ms of pure Python here."""


def _spin(cpu: int, seconds: float, out: "mp.Queue[list[tuple[float, float]]]") -> None:
    os.sched_setaffinity(0, {cpu})
    rows: list[tuple[float, float]] = []
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.time()
        s = 0
        for i in range(WORK_UNITS):
            s += i * i
        rows.append((t0, time.time() - t0))
    out.put(rows)


def _run(cpus: list[int], seconds: float) -> list[list[tuple[float, float]]]:
    """Run one spinner per entry of ``cpus`` at once; their (start, duration) rows."""
    ctx = mp.get_context("fork")
    out: "mp.Queue[list[tuple[float, float]]]" = ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(cpu, seconds, out), daemon=True) for cpu in cpus]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=seconds + 60) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return results


def _windows(rows: list[tuple[float, float]], t0: float, window_s: float) -> dict[int, float]:
    bins: dict[int, list[float]] = {}
    for start, took in rows:
        k = int((start - t0) // window_s)
        if k >= 0:
            bins.setdefault(k, []).append(took)
    last = max(bins, default=-1)
    return {k: statistics.median(v) for k, v in bins.items() if len(v) >= 5 and k != last}  # the last is partial


def _sd(logs: list[float]) -> float:
    return statistics.stdev(logs) if len(logs) > 1 else math.nan


def _pair_sd(a: list[tuple[float, float]], b: list[tuple[float, float]], window_s: float) -> tuple[float, int]:
    t0 = max(a[0][0], b[0][0])
    wa, wb = _windows(a, t0, window_s), _windows(b, t0, window_s)
    keys = sorted(set(wa) & set(wb))
    logs = [math.log(wb[k] / wa[k]) for k in keys]
    return _sd(logs), len(logs)


def _side_sd(rows: list[tuple[float, float]], window_s: float) -> float:
    w = _windows(rows, rows[0][0], window_s)
    return _sd([math.log(v) for v in w.values()])


def _consecutive_sd(rows: list[tuple[float, float]], window_s: float) -> tuple[float, int]:
    w = _windows(rows, rows[0][0], window_s)
    keys = sorted(w)
    logs = [math.log(w[k2] / w[k1]) for k1, k2 in zip(keys, keys[1:]) if k2 == k1 + 1]
    return _sd(logs), len(logs)


def _correlation(a: list[tuple[float, float]], b: list[tuple[float, float]], bin_s: float = 0.25) -> float:
    t0 = max(a[0][0], b[0][0])
    wa, wb = _windows(a, t0, bin_s), _windows(b, t0, bin_s)
    keys = sorted(set(wa) & set(wb))
    if len(keys) < 3:
        return math.nan
    return statistics.correlation([math.log(wa[k]) for k in keys], [math.log(wb[k]) for k in keys])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds per arrangement")
    parser.add_argument("--window-s", type=float, default=3.0, help="seconds per window (a paired round)")
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("needs two CPUs this process may use", file=sys.stderr)
        return 2
    first, second = cpus[:2]
    print(f"CPUs {first} and {second}; {args.seconds:g} s per arrangement, {args.window_s:g} s windows; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'arrangement':38s} {'windows':>7} {'sd of B/A per window':>21} {'sd of one side':>15}")
    a, b = _run([first, second], args.seconds)
    sd, n = _pair_sd(a, b, args.window_s)
    print(f"{'two cores at once (duet, disjoint CPUs)':38s} {n:7d} {sd:21.1%} {_side_sd(a, args.window_s):15.1%}"
          f"   cores' correlation {_correlation(a, b):.2f}")
    a, b = _run([first, first], args.seconds)
    sd, n = _pair_sd(a, b, args.window_s)
    print(f"{'one core, time-sliced (duet, one CPU)':38s} {n:7d} {sd:21.1%} {_side_sd(a, args.window_s):15.1%}")
    (a,) = _run([first], args.seconds)
    sd, n = _consecutive_sd(a, args.window_s)
    print(f"{'one after the other (interleaved)':38s} {n:7d} {sd:21.1%} {_side_sd(a, args.window_s):15.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
