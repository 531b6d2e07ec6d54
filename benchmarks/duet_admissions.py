"""How a paired block's requests join each worker's batch: the admission pattern the solo harness replays.

The solo effect of a zoo member (servegate.paired.solo) is only comparable to what the gate reads when the
solo harness decodes the batch the gate's workers decode: which of the block's requests are admitted at
which scheduler step decides whether the decode batch is aligned (one prefill of all: no attention mask) or
ragged (rows at different positions: the masked kernel). This script reads it off real paired runs whose
workers logged at debug level (the scheduler's ``Prefill batch.`` line, with its decode step count):

    servegate run --profile smoke-ab --set 'worker.extra_args=["--log-level","debug"]' \\
        --set 'baseline.extra_args=["--log-level","debug"]' --set paired.max_rounds=10 --set paired.min_rounds=10
    python benchmarks/duet_admissions.py runs/<that run>

and prints, per side, how often each pattern was seen: the requests admitted at each scheduler turn of the
measured block, from its first admission (``1,3``: one request, one decode step, then the other three;
``4``: all together, an aligned batch; ``1,0,3``: two decode steps between).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

LAUNCH = "# servegate: launching"
PREFILL = re.compile(r"Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #running-req: (\d+), "
                     r"#queue-req: (\d+), #decode-steps: (\d+)")


def block_patterns(log: Path, requests: int, input_len: int) -> list[str]:
    """One pattern per worker instance in ``log``: the measured block's admissions (the first ``requests``
    requests of ``input_len``-token prompts after the warmup), as counts per scheduler turn."""
    patterns: list[str] = []
    instance: list[tuple[int, int]] = []  # (admitted, decode steps before) of the block's prompts

    def close() -> None:
        if sum(n for n, _ in instance) >= requests:
            first = instance[0][1]
            counts = [0] * (instance[-1][1] - first + 1)
            for n, step in instance:
                counts[step - first] += n
            patterns.append(",".join(map(str, counts)))

    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(LAUNCH):
            close()
            instance = []
            continue
        m = PREFILL.search(line)
        if m is None:
            continue
        seqs, tokens, steps = int(m.group(1)), int(m.group(2)), int(m.group(5))
        if tokens != seqs * input_len or sum(n for n, _ in instance) >= requests:
            continue  # the warmup's prompts, or the filler load after the block
        instance.append((seqs, steps))
    close()
    return patterns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="paired run folders (worker.log, baseline-worker.log)")
    parser.add_argument("--requests", type=int, default=4, help="paired.requests_per_block")
    parser.add_argument("--input-len", type=int, default=64, help="paired.input_len")
    args = parser.parse_args(argv)
    for side, name in (("baseline", "baseline-worker.log"), ("candidate", "worker.log")):
        seen: collections.Counter[str] = collections.Counter()
        for run in args.runs:
            if (run / name).is_file():
                seen.update(block_patterns(run / name, args.requests, args.input_len))
        total = sum(seen.values())
        if not total:
            print(f"{side}: no measured block found (were the workers started with --log-level debug?)")
            continue
        shown = ", ".join(f"{p} {n}/{total}" for p, n in seen.most_common())
        print(f"{side}: {total} blocks: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
