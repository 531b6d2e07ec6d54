"""False alarms and power of the paired decision rule under optional stopping, simulated.

The paired stage looks at its interval after every round from ``min_rounds`` on and stops at the
first round where every gated metric is decided, so its false-alarm rate is only α if the interval
is valid at a stopping time it chose itself. This script measures that rate with the gate's own
rule, imported from ``servegate.paired.rounds``: ``decide_metric`` (``ratio_interval`` and
``decide_change``, inconclusive before ``min_rounds``) and ``stop_reason`` (decided, ``max_rounds``,
the ``max_measure_s`` budget checked before each round with the next round's expected cost,
restart included). Only the workers and the clock are simulated, as ``PairedMeasurement.run``
drives them: restarts every ``rounds_per_worker`` rounds, the clock started after the first launch.

    log ratio of round r = log(true ratio) + offset of the worker instance + noise of the round

- noise: ``normal`` with sd ``--round-sd`` (2.6 %, the per-round sd of the ITL log ratio measured
  on the 2-core machine by smoke-ab when quiet; paired_cost.py saw 13 % at load 2 and 21 % at load
  5-8), or ``t3``: Student t with 3 df scaled to the same sd (heavy tails: a GC pause or a noisy
  neighbour in one block);
- offset: normal, sd ``--instance-sd`` (1 %), drawn again at every restart of the workers: what a
  fresh process pair does to the ratio (allocation, layout);
- time: ``--block-s`` per round and ``--restart-s`` per restart (both workers' launch + warm-up),
  constant, so the next round's expected cost (the gate: median of the last 4 rounds, plus the
  median restart) is exactly that; measure both with ``benchmarks/paired_cost.py``.

Per scenario it prints the share of decisions that were ``regression`` (with its exact one-sided
95 % upper bound), ``no_change``, ``inconclusive`` and ``improvement``, how often the final interval
covered the true ratio, and the rounds and seconds (medians) over all decisions (undecided ones ran
to the budget) and over the decided ones. At a true ratio of 1 + bound, ``regression`` is the
false-alarm rate the interval promises to keep at (1 - confidence) / 2.

    python benchmarks/paired_sequential.py                      # 20 000 decisions per scenario
    python benchmarks/paired_sequential.py --sims 2000 --ratios 1.0 1.015 --noise normal
    python benchmarks/paired_sequential.py --set paired.min_rounds=10 --json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import numpy as np
from scipy import stats

from servegate.config import PAIRED_METRICS, PairedConfig, load_config
from servegate.paired.rounds import decide_metric, stop_reason

NOISES = ("normal", "t3")


def _round_noise(rng: np.random.Generator, noise: str, sd: float) -> float:
    if noise == "normal":
        return float(rng.normal(0.0, sd))
    return float(rng.standard_t(3)) * sd / math.sqrt(3.0)  # the variance of t(3) is 3


def one_decision(p: PairedConfig, rng: np.random.Generator, *, true_ratio: float, noise: str, round_sd: float,
                 instance_sd: float, block_s: float, restart_s: float) -> tuple[str, Any, int, float, str]:
    """One paired decision over simulated workers: ``(decision, interval, rounds, seconds, why it stopped)``
    of the first gated metric (all gated metrics see the same draws)."""
    metric = p.gated[0]
    direction = PAIRED_METRICS[metric][1]
    log_true = math.log(true_ratio)
    offset = float(rng.normal(0.0, instance_sd))  # the first instances, launched before the clock starts
    logs: list[float] = []
    instances: list[int] = []
    elapsed = 0.0
    while True:
        r = len(logs)
        restart = r > 0 and r % p.rounds_per_worker == 0
        interval, decision = decide_metric(logs, direction, p, instances)
        reason = stop_reason(p, r, decided=decision != "inconclusive", elapsed_s=elapsed,
                             next_round_s=block_s + (restart_s if restart else 0.0))
        if reason is not None:
            return decision, interval, r, elapsed, reason
        if restart:
            offset = float(rng.normal(0.0, instance_sd))
            elapsed += restart_s
        logs.append(log_true + offset + _round_noise(rng, noise, round_sd))
        instances.append(r // p.rounds_per_worker)
        elapsed += block_s


def simulate(p: PairedConfig, *, true_ratio: float, noise: str, sims: int, seed: int, round_sd: float,
             instance_sd: float, block_s: float, restart_s: float) -> dict[str, Any]:
    """``sims`` decisions of one scenario; the figures of the table."""
    rng = np.random.default_rng(seed)
    decisions, rounds, seconds, covered = [], [], [], []
    for _ in range(sims):
        decision, iv, n_rounds, secs, _ = one_decision(p, rng, true_ratio=true_ratio, noise=noise,
                                                       round_sd=round_sd, instance_sd=instance_sd,
                                                       block_s=block_s, restart_s=restart_s)
        decisions.append(decision)
        rounds.append(n_rounds)
        seconds.append(secs)
        covered.append(iv.ci_low <= true_ratio <= iv.ci_high)
    d = np.array(decisions)
    n = len(d)
    k = int((d == "regression").sum())
    upper = float(stats.binomtest(k, n).proportion_ci(confidence_level=0.90, method="exact").high)
    r, sec = np.array(rounds), np.array(seconds)
    decided = d != "inconclusive"
    return {"noise": noise, "true_ratio": true_ratio, "sims": n, "regression": k / n, "regression_upper95": upper,
            "no_change": float((d == "no_change").mean()), "improvement": float((d == "improvement").mean()),
            "inconclusive": float((d == "inconclusive").mean()), "covered": float(np.mean(covered)),
            "rounds_median": float(np.median(r)), "seconds_median": float(np.median(sec)),
            "decided_rounds_median": float(np.median(r[decided])) if decided.any() else math.nan,
            "decided_rounds_p90": float(np.quantile(r[decided], 0.9, method="higher")) if decided.any() else math.nan,
            "decided_seconds_median": float(np.median(sec[decided])) if decided.any() else math.nan}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="smoke-ab", help="the paired gate whose paired settings are simulated")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (e.g. paired.min_rounds=10)")
    parser.add_argument("--sims", type=int, default=20000, help="decisions per scenario")
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 1.015, 1.03],
                        help="true candidate/baseline ratios (1.0: A/A; paired.bound above 1: at the bound)")
    parser.add_argument("--noise", nargs="+", choices=NOISES, default=list(NOISES))
    parser.add_argument("--round-sd", type=float, default=0.026, help="per-round sd of the log ratio")
    parser.add_argument("--instance-sd", type=float, default=0.01, help="sd of a worker instance's offset")
    # Seconds per round and per restart: smoke-ab on the 2-core machine at load ~2, measured by paired_cost.py
    # (medians of 40 rounds and 9 restarts, 2026-12-01): the 600 s budget holds ~40 rounds. Busy (load 5-8)
    # it measured 30.5 s and 43.5 s: ~15 rounds.
    parser.add_argument("--block-s", type=float, default=8.9, help="seconds per round (A and B blocks, flushes)")
    parser.add_argument("--restart-s", type=float, default=15.8, help="seconds per restart of both workers")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    config = load_config(profile=args.profile, overrides=args.overrides)
    p = config.paired
    print(f"paired rule of {args.profile}: gated {p.gated}, bound {p.bound:.1%}, confidence {p.confidence:.0%}, "
          f"min_rounds {p.min_rounds}, max_rounds {p.max_rounds}, max_measure_s {p.max_measure_s:g}, "
          f"rounds_per_worker {p.rounds_per_worker}, sd_floor {p.sd_floor:g}")
    print(f"noise: round sd {args.round_sd:.1%}, instance sd {args.instance_sd:.1%}; clock: {args.block_s:g} s per "
          f"round, {args.restart_s:g} s per restart; {args.sims} decisions per scenario, seed {args.seed}")
    print(f"{'':69s} {'all decisions':>13} {'decided ones':>18}")
    print(f"{'noise':>6} {'ratio':>6} {'regression':>10} {'(95% up)':>8} {'no_change':>9} {'inconcl.':>8} "
          f"{'improv.':>7} {'covered':>7} {'rounds':>6} {'s':>6} {'rounds':>6} {'p90':>4} {'s':>6} {'wall s':>6}")
    results = []
    for i, noise in enumerate(args.noise):
        for j, ratio in enumerate(args.ratios):
            t0 = time.perf_counter()
            res = simulate(p, true_ratio=ratio, noise=noise, sims=args.sims, seed=args.seed + 1000 * i + j,
                           round_sd=args.round_sd, instance_sd=args.instance_sd, block_s=args.block_s,
                           restart_s=args.restart_s)
            res["wall_s"] = time.perf_counter() - t0
            results.append(res)
            print(f"{noise:>6} {ratio:>6.3f} {res['regression']:>10.2%} {res['regression_upper95']:>8.2%} "
                  f"{res['no_change']:>9.2%} {res['inconclusive']:>8.2%} {res['improvement']:>7.2%} "
                  f"{res['covered']:>7.2%} {res['rounds_median']:>6g} {res['seconds_median']:>6.0f} "
                  f"{res['decided_rounds_median']:>6g} {res['decided_rounds_p90']:>4g} "
                  f"{res['decided_seconds_median']:>6.0f} {res['wall_s']:>6.0f}", flush=True)
    print(f"nominal: regression at a true ratio <= 1 + bound at most {(1 - p.confidence) / 2:.1%} (one side of "
          f"the {p.confidence:.0%} repeated interval); the interval covers the true ratio at least {p.confidence:.0%}")
    if args.json:
        print(json.dumps({"config": p.model_dump(mode="json"), "args": vars(args), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
