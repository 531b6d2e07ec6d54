"""Embedded worker throughput through HTTP vs the same model's in-process batched ``generate``.

Starts ``python -m servegate worker`` as a real process, loads the same model in this
process, and alternates the two measurements round by round on the same cores (never
at the same time) so that machine noise hits both alike:

* HTTP: ``concurrency`` simultaneous ``/generate`` requests (``ignore_eos``, greedy,
  ``output_len`` tokens each, distinct random prompts of ``input_len`` tokens);
  output tok/s = all output tokens / wall time from the first send to the last answer.
* in-process: one ``model.generate`` on the same prompts as a batch of ``concurrency``.

Prints one row per concurrency with the medians over rounds and their ratio (the goal
is >= 0.9 at concurrency 8), and writes the rows as JSON with ``--json PATH``.

    python benchmarks/worker_throughput.py --model smollm2-135m --concurrency 1 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import requests


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_worker(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "servegate", "worker", "--model", args.model, "--dtype", args.dtype,
           "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", str(args.max_total_tokens),
           "--max-running-requests", str(max(args.concurrency)), *args.worker_arg]
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"worker exited with {proc.returncode}; log: {log_path}")
        try:
            if requests.get(url + "/health_generate", timeout=30).status_code == 200:
                return proc
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"worker not ready after 300 s; log: {log_path}")


def _stop(proc: subprocess.Popen) -> None:
    try:
        parent = psutil.Process(proc.pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        p.kill()


def _http_round(url: str, prompts: list[list[int]], output_len: int, stream: bool) -> float:
    body = {"sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
            "stream": stream}

    def one(ids: list[int]) -> int:
        resp = requests.post(url + "/generate", json={**body, "input_ids": ids}, timeout=600, stream=stream)
        resp.raise_for_status()
        if not stream:
            return resp.json()["meta_info"]["completion_tokens"]
        last = None
        for line in resp.iter_lines(decode_unicode=True):
            if line and line.startswith("data: {"):
                last = line
        return json.loads(last[len("data: "):])["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    if tokens != output_len * len(prompts):
        raise SystemExit(f"expected {output_len * len(prompts)} output tokens, got {tokens}")
    return tokens / elapsed


def _generate_round(model, prompts: list[list[int]], output_len: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=model.config.eos_token_id)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == output_len
    return output_len * len(prompts) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--stream", action="store_true", help="stream the HTTP responses (SSE)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads on both sides (default: torch's own choice, all cores)")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (repeatable)")
    args = parser.parse_args()
    # SIGTERM (e.g. from `timeout`) must still run the finally that stops the worker.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    from servegate.models import ensure_model, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
        args.worker_arg += ["--num-threads", str(args.threads)]
    model, _ = load_model(ensure_model(args.model), args.dtype)
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    log_path = Path(tempfile.mkdtemp(prefix="servegate-bench-")) / "worker.log"
    port = _free_port()
    proc = _start_worker(args, port, log_path)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for c in args.concurrency:
            http, gen = [], []
            # One warm-up of each path at this batch size (allocations, first-call overhead).
            warm = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(c)]
            _http_round(url, warm, 8, args.stream)
            _generate_round(model, warm, 8)
            for _ in range(args.rounds):
                prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(c)]
                requests.post(url + "/flush_cache", timeout=60)
                http.append(_http_round(url, prompts, args.output_len, args.stream))
                gen.append(_generate_round(model, prompts, args.output_len))
            row = {"concurrency": c, "http_output_tok_per_s": float(np.median(http)),
                   "generate_output_tok_per_s": float(np.median(gen)),
                   "ratio": float(np.median(http) / np.median(gen)),
                   "http_rounds": http, "generate_rounds": gen}
            rows.append(row)
            print(f"concurrency {c:3d}: HTTP {row['http_output_tok_per_s']:8.1f} tok/s   in-process generate "
                  f"{row['generate_output_tok_per_s']:8.1f} tok/s   ratio {row['ratio']:.3f}", flush=True)
    finally:
        _stop(proc)
    meta = {"model": args.model, "dtype": args.dtype, "input_len": args.input_len, "output_len": args.output_len,
            "rounds": args.rounds, "stream": args.stream, "threads": torch.get_num_threads(), "cpus": psutil.cpu_count(),
            "load_avg_1m": os.getloadavg()[0], "machine": platform.processor() or platform.machine()}
    print(json.dumps({"meta": meta, "rows": rows}))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
