"""Batched and chunked prefill in the embedded worker: this checkout against an earlier revision, side by side.

Starts two embedded workers as the smoke gate does (profile smoke's worker: SmolLM2-135M, memory
profile cpu-small, default threads): one from this checkout, one from ``git archive REV servegate``
(``--before-rev``: the worker that prefilled one request per forward pass). Both stay up, but
only one is measured at a time; the order alternates per round so that warm-up and machine
noise hit both alike. Per round and worker, after a flush:

* ``burst_last_ttft_s``: 8 simultaneous ``/generate`` requests of 32 random prompt tokens
  (distinct per request and round, one output token each, so an answer arrives with its first
  token): seconds from the common send to the last answer;
* ``quality_stage_s`` (``--quality-rounds``, each about a minute): the smoke profile's quality
  stage (:func:`servegate.bench.quality.stage.run_quality`: accuracy and reference agreement,
  its in-process reference included) against the worker.

Prints the medians side by side (before, after, after/before) and, with ``--json PATH``, writes
every round.

    python benchmarks/worker_prefill.py --before-rev b864013 --rounds 5 --quality-rounds 2

Measured on the 2-core development machine while other jobs ran on it (load average 5-10),
b864013 (one request per prefill pass) against batched prefill (1722687), medians:

    figure                    before     after  after/before
    burst_last_ttft_s          1.919     1.001         0.521   (5 rounds: 1.51-2.04 s vs 0.71-1.12 s)
    quality_stage_s          258.545   169.821         0.657   (2 rounds: 211, 307 s vs 145, 194 s)

The quality stage's absolute time follows the machine's load (a smoke gate's quality stage took
53.9 s at load 1.3 before the change); read the ratio, measured with both workers alternating.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

import requests

from servegate.bench.quality.stage import run_quality
from servegate.config import load_config
from servegate.engines import get_engine
from servegate.launch import WorkerHandle, launch_worker

REPO = Path(__file__).resolve().parents[1]
BURST_REQUESTS = 8
BURST_PROMPT_TOKENS = 32


def _extract_revision(rev: str, into: Path) -> Path:
    """``servegate/`` as of ``rev`` under ``into`` (``git archive``: the working tree is not touched)."""
    out = subprocess.run(["git", "archive", rev, "servegate"], cwd=REPO, capture_output=True, timeout=120, check=False)
    if out.returncode != 0:
        raise SystemExit(f"git archive {rev} failed: {out.stderr.decode(errors='replace').strip()}; give a commit of "
                         f"this repository as --before-rev")
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def _flush(url: str) -> None:
    response = requests.post(url + "/flush_cache", timeout=60)
    if response.status_code != 200:
        raise SystemExit(f"POST {url}/flush_cache -> {response.status_code}: the worker is not idle")


def _burst(url: str, rng: random.Random, vocab: int) -> float:
    prompts = [[rng.randrange(100, vocab) for _ in range(BURST_PROMPT_TOKENS)] for _ in range(BURST_REQUESTS)]
    start: list[float] = []
    # The barrier's action runs once every thread is ready, just before it releases them all.
    barrier = threading.Barrier(BURST_REQUESTS, action=lambda: start.append(time.perf_counter()))
    body = {"sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}

    def one(ids: list[int]) -> float:
        with requests.Session() as session:
            barrier.wait()
            response = session.post(url + "/generate", json={**body, "input_ids": ids}, timeout=300)
            done = time.perf_counter()
        response.raise_for_status()
        if response.json()["meta_info"]["completion_tokens"] != 1:
            raise SystemExit(f"expected one output token from {url}, got {response.json()['meta_info']}")
        return done

    with ThreadPoolExecutor(BURST_REQUESTS) as pool:
        ends = list(pool.map(one, prompts))
    return max(ends) - start[0]


def _quality(handle: WorkerHandle, cfg) -> float:
    start = time.perf_counter()
    run_quality(handle.base_url, handle.engine, cfg.quality)
    return time.perf_counter() - start


def _chunked_prefill_reported(url: str) -> bool:
    return "chunked_prefill_size" in requests.get(url + "/get_server_info", timeout=30).json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before-rev", required=True, help="the commit to compare with (its servegate/ worker)")
    parser.add_argument("--rounds", type=int, default=5, help="burst rounds per worker")
    parser.add_argument("--quality-rounds", type=int, default=1, help="quality stages per worker (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write every round here as JSON")
    args = parser.parse_args()
    # SIGTERM (e.g. from `timeout`) must still run the finally blocks that stop the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    cfg = load_config(profile="smoke")
    engine = get_engine(cfg.worker.engine)
    scratch = Path(tempfile.mkdtemp(prefix="servegate-prefill-bench-"))
    before_tree = _extract_revision(args.before_rev, scratch / "before")
    # `python -m` puts the working directory first on sys.path: run the workers from a folder
    # without a servegate/ in it, so that PYTHONPATH decides which tree each one runs.
    os.chdir(scratch)
    specs = {"before": cfg.worker.model_copy(update={"env": {"PYTHONPATH": str(before_tree)}}),
             "after": cfg.worker}
    rng = random.Random(args.seed)
    vocab = 49152  # SmolLM2's; prompts stay below it
    rounds: dict[str, dict[str, list[float]]] = {side: {"burst_last_ttft_s": [], "quality_stage_s": []}
                                                 for side in specs}
    with launch_worker(specs["before"], scratch / "before.log", engine=engine) as before, \
            launch_worker(specs["after"], scratch / "after.log", engine=engine) as after:
        handles = {"before": before, "after": after}
        if _chunked_prefill_reported(before.base_url) or not _chunked_prefill_reported(after.base_url):
            raise SystemExit(f"the 'before' worker reports chunked_prefill_size or the 'after' one does not: "
                             f"{args.before_rev} must predate batched prefill and this checkout have it")
        for side, handle in handles.items():  # first-call costs (allocations, lazy imports) out of the figures
            _burst(handle.base_url, rng, vocab)
        for r in range(max(args.rounds, args.quality_rounds)):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for side in order:
                url = handles[side].base_url
                if r < args.rounds:
                    _flush(url)
                    rounds[side]["burst_last_ttft_s"].append(_burst(url, rng, vocab))
                if r < args.quality_rounds:
                    _flush(url)
                    rounds[side]["quality_stage_s"].append(_quality(handles[side], cfg))
                print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rounds[side].items()
                                                            if len(v) > r), flush=True)
    rows = []
    print(f"\n{'figure (median)':<22}{'before':>10}{'after':>10}{'after/before':>14}")
    for figure in ("burst_last_ttft_s", "quality_stage_s"):
        if not rounds["after"][figure]:
            continue
        b, a = median(rounds["before"][figure]), median(rounds["after"][figure])
        rows.append({"figure": figure, "before": b, "after": a, "ratio": a / b})
        print(f"{figure:<22}{b:>10.3f}{a:>10.3f}{a / b:>14.3f}")
    meta = {"before_rev": args.before_rev, "rounds": args.rounds, "quality_rounds": args.quality_rounds,
            "model": cfg.worker.model, "memory_profile": cfg.worker.memory_profile, "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0], "machine": platform.processor() or platform.machine()}
    print(json.dumps({"meta": meta, "rows": rows}))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
