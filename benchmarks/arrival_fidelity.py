"""Arrival fidelity of servegate's load generator: does it send Poisson arrivals on time?

For each rate, one serving run (Poisson arrivals, seeded) against
``benchmarks/near_free_server.py`` in its own process. Prints the dispatch lag (actual minus
scheduled send) p50/p99/max, and the Kolmogorov–Smirnov p-value of the dispatched
inter-arrival gaps against Exponential(rate) — next to the p-value of the seeded plan
itself, so a rejection can be told apart from an unlucky seed — and the run's own verdict
on itself (``client_valid``: not ``client_fell_behind`` and not ``arrival_fit_rejected``).

    python benchmarks/arrival_fidelity.py                     # rates 10 50 100 200, ~10 s each
    python benchmarks/arrival_fidelity.py --rates 200 400 --duration-s 20

Target (issue 7): at 200 req/s, p99 lag <= 2 ms and the fit not rejected at 1 %.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from loadgen_cost import start_server, stop  # noqa: E402  (benchmarks/ is not a package)

TARGET_RATE = 200.0
TARGET_P99_MS = 2.0
TARGET_ALPHA = 0.01


def run_rate(base_url: str, rate: float, num_prompts: int, output_len: int, seed: int,
             max_lag_ms: float) -> dict[str, Any]:
    from servegate.bench.serving import run_serving
    from servegate.config import ServingConfig
    from servegate.engines import SGLangEngine

    cfg = ServingConfig(dataset="random", num_prompts=num_prompts, random_input_len=16,
                        random_output_len=output_len, random_range_ratio=1.0, arrival="poisson",
                        request_rate=rate, seed=seed, progress=False, max_dispatch_lag_p99_ms=max_lag_ms)
    res = run_serving(base_url, SGLangEngine(), cfg)
    s = res.summary.iloc[0]
    return {
        "rate": rate, "num_prompts": num_prompts, "completed": int(s["completed"]),
        "achieved_rate": float(num_prompts / res.requests["dispatched_s"].max()),
        "lag_p50_ms": float(s["dispatch_lag_p50_ms"]), "lag_p99_ms": float(s["dispatch_lag_p99_ms"]),
        "lag_max_ms": float(s["dispatch_lag_max_ms"]), "ks_pvalue": float(s["arrival_ks_pvalue"]),
        "scheduled_ks_pvalue": float(s["scheduled_arrival_ks_pvalue"]),
        "client_fell_behind": bool(s["client_fell_behind"]),
        "arrival_fit_rejected": bool(s["arrival_fit_rejected"]), "client_valid": bool(s["client_valid"]),
        "event_loop": res.meta.get("event_loop"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="dispatch lag and Poisson fit at several rates")
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 50.0, 100.0, 200.0])
    parser.add_argument("--duration-s", type=float, default=10.0, help="planned length of each run")
    parser.add_argument("--min-prompts", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=32, help="tokens per request (1 ms per token)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-lag-ms", type=float, default=TARGET_P99_MS,
                        help="the run's own client_fell_behind limit (ServingConfig.max_dispatch_lag_p99_ms)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    server, port = start_server(args.output_len, 1.0)
    rows = []
    try:
        load_before = os.getloadavg()[0]
        for rate in args.rates:
            n = max(args.min_prompts, int(rate * args.duration_s))
            rows.append(run_rate(f"http://127.0.0.1:{port}", rate, n, args.output_len, args.seed, args.max_lag_ms))
        load_after = os.getloadavg()[0]
    finally:
        stop(server)

    print(f"load average before {load_before:.2f}, after {load_after:.2f}; {args.output_len}-token outputs, "
          f"seed {args.seed}, event loop {rows[0]['event_loop']}")
    print(f"{'rate':>6} {'n':>5} {'achieved':>8} {'lag p50':>8} {'lag p99':>8} {'lag max':>8} "
          f"{'KS p':>7} {'plan KS p':>9} {'valid':>5}")
    for r in rows:
        print(f"{r['rate']:6.0f} {r['num_prompts']:5d} {r['achieved_rate']:8.1f} {r['lag_p50_ms']:7.3f}ms "
              f"{r['lag_p99_ms']:7.3f}ms {r['lag_max_ms']:7.2f}ms {r['ks_pvalue']:7.3f} "
              f"{r['scheduled_ks_pvalue']:9.3f} {str(r['client_valid']):>5}")
    for r in rows:
        if r["rate"] == TARGET_RATE:
            met = r["lag_p99_ms"] <= TARGET_P99_MS and r["ks_pvalue"] >= TARGET_ALPHA
            print(f"target at {TARGET_RATE:.0f} req/s (p99 lag <= {TARGET_P99_MS} ms, KS p >= {TARGET_ALPHA}): "
                  f"{'met' if met else 'NOT met'}")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
