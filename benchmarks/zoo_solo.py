"""The solo effect of each regression-zoo member (servegate/paired/zoo.py), side by side.

Each member's patch is applied to a copy of this package, and its decode steps are alternated one by one
with the baseline's in one process (servegate/paired/solo.py), over several fresh processes that
alternate which build loads first: the size a regression has when nothing shares the core with it. What
`servegate calibrate --paired --regressions` holds the gate's reading against (it measures the same
thing itself, into its folder's solo.json); this script measures it alone, e.g. to size a new member.

    python benchmarks/zoo_solo.py [--members linears-unpacked,attention-bf16] [--processes 4] [--rounds 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from servegate.config import load_config
from servegate.paired.solo import run_solo
from servegate.paired.zoo import ZOO, build_tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default=",".join(ZOO), help="comma-separated zoo members (default: all)")
    parser.add_argument("--profile", default="smoke-ab", help="the paired profile whose workload is measured")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    config = load_config(profile=args.profile)
    p = config.paired
    cpu = config.worker.cpus[0] if config.worker.cpus else None
    print(f"workload: {p.requests_per_block} requests x {p.input_len} prompt + {p.output_len} output tokens, "
          f"pinned to CPU {cpu}; {args.processes} processes x {args.rounds} rounds per member")
    print(f"{'member':<20} {'kind':<18} {'solo effect':>12} {'95 % interval':>20} {'step ms A -> B':>18} "
          f"{'per process':<34} {'s':>5}")
    with tempfile.TemporaryDirectory(prefix="servegate-zoo-") as tmp:
        for name in args.members.split(","):
            started = time.monotonic()
            tree = build_tree(name, Path(tmp) / name)
            effect = run_solo(tree, model=config.worker.model, requests_per_block=p.requests_per_block,
                              input_len=p.input_len, output_len=p.output_len, rounds=args.rounds,
                              processes=args.processes, cpu=cpu, log_path=Path(tmp) / f"{name}.log")
            per = " ".join(f"{q['ratio']:.3f}" for q in effect["per_process"])
            print(f"{name:<20} {ZOO[name].kind:<18} {effect['ratio'] - 1:>+11.1%} "
                  f"[{effect['ci_low'] - 1:+7.1%}, {effect['ci_high'] - 1:+7.1%}] "
                  f"{effect['baseline_step_ms']:>7.2f} -> {effect['candidate_step_ms']:<7.2f} {per:<34} "
                  f"{time.monotonic() - started:>5.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
