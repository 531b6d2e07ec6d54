"""A zoo member's solo effect on two batch shapes: the block's prompts admitted together (an aligned decode
batch, what servegate.paired.solo measures today) and one prompt admitted per decode step (a ragged batch,
as requests reach a serving worker). Both builds in one process, decode steps alternated, pinned to CPU 0.

Why it exists (docs/paired.md, "Real regressions"): attention-bf16 read +22-25 % aligned and x0.974 ragged,
and the paired gate read it x0.99.

    python -P benchmarks/solo_arrivals.py TREE [--rounds 4]     # TREE: servegate.paired.zoo.build_tree(...)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from pathlib import Path

import torch

from servegate.models import ensure_model
from servegate.paired.solo import _import_build, _Side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    path = ensure_model("smollm2-135m")
    sides = [_Side(_import_build(None), path, 4096), _Side(_import_build(args.tree.resolve()), path, 4096)]
    vocab = int(sides[0].scheduler.tokenizer.vocab_size)
    with torch.inference_mode():
        for shape in ("aligned", "ragged"):
            ratios = []
            for r in range(args.rounds + 1):  # round 0 warms up
                rng = random.Random(r)
                prompts = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(4)]
                for side in sides:
                    side.step_s.clear()
                    if shape == "aligned":
                        side.submit(prompts, 64)
                for k in range(4 if shape == "ragged" else 0):
                    for side in sides:
                        side.submit([prompts[k]], 64)
                        if side.running:
                            side.step()
                while any(side.running for side in sides):
                    for side in sides:
                        if side.running:
                            side.step()
                if r:
                    ratios.append(statistics.median(sides[1].step_s) / statistics.median(sides[0].step_s))
            print(f"{shape:<8} candidate/baseline decode step x{statistics.median(ratios):.3f} "
                  f"(rounds {' '.join(f'{x:.3f}' for x in ratios)})", flush=True)


if __name__ == "__main__":
    main()
