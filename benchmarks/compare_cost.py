"""Cost of the baseline comparison: wall time of ``compare_tables`` for growing serving runs,
and of the ITL interval per token (flat) versus per request (clustered), side by side.

Synthetic runs shaped like the ``serving_requests`` table (a per-request level shared by its
tokens, as real batches give); 5 baseline runs, one current run; 2000 bootstrap replicates.

    python benchmarks/compare_cost.py                    # 64 ... 4096 requests of 128 tokens
    python benchmarks/compare_cost.py --tokens 512 --requests 256 1024

Prints per size: the whole comparison table's time, the ITL interval's time both ways, and
how much wider the per-request interval is (the correlation the flat bootstrap ignores).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from servegate.bootstrap import ratio_ci_median
from servegate.compare import compare_tables
from servegate.gated_metrics import GATED_METRICS, extract_requests


def _serving(rng: np.random.Generator, n: int, tokens: int) -> pd.DataFrame:
    level = rng.lognormal(np.log(40.0), 0.15, n)
    itls = [list(lvl * rng.lognormal(0, 0.05, tokens)) for lvl in level]
    ttft = rng.lognormal(np.log(150.0), 0.2, n)
    return pd.DataFrame({"ttft_ms": ttft, "itls_ms": itls, "tpot_ms": [float(np.mean(x)) for x in itls],
                         "e2e_latency_ms": ttft + np.array([sum(x) for x in itls]), "success": True})


def _best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--repeat", type=int, default=3, help="timings per figure (the best is printed)")
    args = parser.parse_args()
    itl = next(m for m in GATED_METRICS if m.list_column and m.statistic == "median")
    rng = np.random.default_rng(0)
    print(f"{'requests':>8} {'tokens/run':>10} {'table s':>8} {'ITL flat s':>10} {'ITL per-req s':>13} "
          f"{'width ratio':>11}")
    for n in args.requests:
        current = {"serving_requests": _serving(rng, n, args.tokens)}
        baseline = [(f"b{i}", {"serving_requests": _serving(rng, n, args.tokens)}) for i in range(5)]
        table_s = _best_of(lambda: compare_tables(current, baseline), args.repeat)
        cur_c = extract_requests(itl, current)[""]
        base_c = [extract_requests(itl, t)[""] for _, t in baseline]
        flat = (np.concatenate(cur_c), [np.concatenate(b) for b in base_c])
        flat_s = _best_of(lambda: ratio_ci_median(*flat), args.repeat)
        clus_s = _best_of(lambda: ratio_ci_median(cur_c, base_c), args.repeat)
        _, lo_f, hi_f = ratio_ci_median(*flat)
        _, lo_c, hi_c = ratio_ci_median(cur_c, base_c)
        print(f"{n:>8} {n * args.tokens:>10} {table_s:>8.2f} {flat_s:>10.3f} {clus_s:>13.3f} "
              f"{(hi_c - lo_c) / (hi_f - lo_f):>11.1f}")


if __name__ == "__main__":
    main()
