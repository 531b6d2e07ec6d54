"""A zoo member's solo effect on each named batch shape side by side (servegate.paired.solo.NAMED_ARRIVALS):
``served``, the first prompt alone and the rest one decode step later (what the gate's workers do with a
paired block, and what servegate.paired.solo measures by default); ``ragged``, one prompt admitted per
decode step; ``aligned``, the block's prompts admitted together (a mask-free decode batch). Both builds in
one process, decode steps alternated, pinned to CPU 0.

Why it exists (docs/paired.md, "Real regressions"): attention-bf16 read +22-25 % aligned and x0.974 ragged,
and the paired gate read it x0.99.

    python -P benchmarks/solo_arrivals.py TREE [--rounds 4]     # TREE: servegate.paired.zoo.build_tree(...)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from servegate.paired.solo import NAMED_ARRIVALS, measure_solo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    for shape in NAMED_ARRIVALS:
        effect = measure_solo(args.tree, rounds=args.rounds, arrivals=shape)
        print(f"{shape:<8} candidate/baseline decode step x{effect.ratio:.3f} [{effect.ci_low:.3f}, "
              f"{effect.ci_high:.3f}] ({effect.rounds} rounds; {effect.baseline_step_ms:.2f} -> "
              f"{effect.candidate_step_ms:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
