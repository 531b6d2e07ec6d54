"""A build's real worker, alone on its CPU, serving the paired workload block after block: each block's median
ITL and the worker's minor page faults, from its first block on.

What docs/paired.md's "attention-eager: the worker's process, not the step" rests on: the in-process solo
harness (servegate/paired/solo.py) read that zoo member x1.02-1.03 while its worker, served alone, read
x1.07-1.09 from its second block on and x1.14-1.33 on its first; its worker took thousands of minor page
faults per block where the baseline's took tens. Each build gets its own fresh worker (smoke-ab's worker
spec: pinned to CPU 0, one torch thread; the load generator on CPU 1), one after the other, so the two
columns are minutes apart: read each column down (its first block against its later ones), and the ratio
of their steady blocks only as a rough size (the paired stage's interleaved mode alternates them).

    python benchmarks/worker_blocks.py [--members attention-eager] [--blocks 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from servegate.bench.serving import run_serving
from servegate.config import load_config
from servegate.engines import get_engine
from servegate.launch import launch_worker
from servegate.paired.rounds import block_config
from servegate.paired.zoo import ZOO, build_tree


def _minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` and its children so far (``/proc/PID/stat`` fields 10 and 11)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[8])


def _blocks(config, tree: Path | None, blocks: int, log: Path) -> list[tuple[float, int]]:
    spec = config.worker if tree is None else config.worker.model_copy(
        update={"env": {**config.worker.env, "PYTHONPATH": str(tree)}})
    engine = get_engine(spec.engine)
    out = []
    with launch_worker(spec, log) as handle:
        assert handle.pid is not None
        if config.paired.client_cpus:
            os.sched_setaffinity(0, set(config.paired.client_cpus))
        for k in range(blocks):
            before = _minor_faults(handle.pid)
            result = run_serving(handle.base_url, engine, block_config(config, k))
            out.append((float(result.summary.iloc[0]["median_itl_ms"]), _minor_faults(handle.pid) - before))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="attention-eager", help="comma-separated zoo members")
    parser.add_argument("--profile", default="smoke-ab")
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args(argv)
    config = load_config(profile=args.profile)
    p = config.paired
    print(f"workload: {p.requests_per_block} requests x {p.input_len} prompt + {p.output_len} output tokens "
          f"per block; worker on CPU(s) {config.worker.cpus}, load generator on {p.client_cpus}")
    with tempfile.TemporaryDirectory(prefix="servegate-blocks-") as tmp:
        columns = {"baseline": _blocks(config, None, args.blocks, Path(tmp) / "baseline.log")}
        for name in args.members.split(","):
            if name not in ZOO:
                parser.error(f"unknown zoo member {name!r}; valid: {', '.join(ZOO)}")
            columns[name] = _blocks(config, build_tree(name, Path(tmp) / name), args.blocks, Path(tmp) / f"{name}.log")
    print(f"{'block':>5}  " + "  ".join(f"{n + ' ITL ms':>24} {'faults':>7}" for n in columns))
    for k in range(args.blocks):
        print(f"{k + 1:>5}  " + "  ".join(f"{c[k][0]:>24.2f} {c[k][1]:>7d}" for c in columns.values()))
    base_steady = statistics.median(itl for itl, _ in columns["baseline"][1:])
    for name, c in columns.items():
        steady = statistics.median(itl for itl, _ in c[1:])
        print(f"{name}: first block {c[0][0]:.2f} ms, later blocks (median) {steady:.2f} ms "
              f"(x{steady / base_steady:.3f} of the baseline's); faults per later block "
              f"{statistics.median(f for _, f in c[1:]):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
