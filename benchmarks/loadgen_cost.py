"""Client CPU per streamed chunk of servegate's load generator (and optionally another client).

Starts ``benchmarks/near_free_server.py`` in its own process, then runs the client in a
fresh process per measurement — a short run and a long run, several times — under a small
wrapper process that reads ``getrusage(RUSAGE_CHILDREN)`` after the client exits: the
kernel's user+sys CPU time of the client and of the children it reaped, nothing else. The
marginal cost is::

    (cpu_long - cpu_short) / (chunks_long - chunks_short)

so interpreter start-up, imports and per-run set-up cancel out. Defaults follow issue 7:
256-token outputs, concurrency 32, both protocols.

    python benchmarks/loadgen_cost.py                       # servegate, native + openai
    python benchmarks/loadgen_cost.py --other-client \\
        "python -m sglang.bench_serving --backend {sglang_backend} --base-url {base_url} \\
         --dataset-name random --random-input-len 16 --random-output-len {output_len} \\
         --random-range-ratio 1 --num-prompts {num_prompts} --max-concurrency {concurrency} \\
         --request-rate inf --tokenizer /path/to/tokenizer --disable-tqdm"

Placeholders in ``--other-client`` (split with shlex into an argument list, no shell):
``{base_url} {host} {port} {num_prompts} {output_len} {concurrency} {protocol}
{sglang_backend}`` (``sglang`` for native, ``sglang-oai`` for openai).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROTOCOLS = ("native", "openai")
TARGET_US = {"native": 14.0, "openai": 8.0}
SGLANG_BACKEND = {"native": "sglang", "openai": "sglang-oai"}


def start_server(tokens: int, step_ms: float) -> tuple[subprocess.Popen[str], int]:
    """The near-free server in its own process; returns it and its port."""
    proc = subprocess.Popen([sys.executable, str(HERE / "near_free_server.py"), "--port", "0",
                             "--tokens", str(tokens), "--step-ms", str(step_ms)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "READY":
        proc.kill()
        raise SystemExit(f"near_free_server did not start (said {line!r})")
    return proc, int(line[1])


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def run_client(argv: list[str], timeout_s: float) -> tuple[dict[str, Any], float, str]:
    """Run one wrapped client (see ``wrapped``); (its report with ``cpu_s``, wall s, stdout).

    A failed client stops the benchmark: a figure from a run that lost chunks means nothing.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise SystemExit(f"client timed out after {timeout_s} s: {argv}") from None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"client exited {proc.returncode}: {argv}\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1]), wall, out


def servegate_client_argv(base_url: str, protocol: str, num_prompts: int, output_len: int,
                          concurrency: int) -> list[str]:
    return [sys.executable, __file__, "--_client", "--base-url", base_url, "--protocol", protocol,
            "--num-prompts", str(num_prompts), "--output-len", str(output_len),
            "--concurrency", str(concurrency)]


def wrapped(argv: list[str]) -> list[str]:
    """Run ``argv`` under a wrapper that prints the CPU time of it and its reaped children."""
    return [sys.executable, __file__, "--_rusage", "--", *argv]


def _rusage_main(argv: list[str]) -> int:
    import resource

    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return proc.returncode
    report: dict[str, Any] = {}
    lines = proc.stdout.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        try:
            report = json.loads(lines[-1])
        except json.JSONDecodeError:
            report = {}
    report["cpu_s"] = ru.ru_utime + ru.ru_stime
    print(json.dumps(report))
    return 0


def _client_main(args: argparse.Namespace) -> int:
    """One servegate serving run against the near-free server; checks every chunk arrived.

    Prints the CPU time of ``run_serving`` alone too (``cpu_run_s``), a cross-check of the
    whole-process figure that is free of the interpreter's start-up noise, and the share of
    chunks that arrived in the same read as the previous one (``coalesced_frac``: a client
    falling behind the server reads several chunks at once, which makes each one cheaper).
    """
    import resource

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np

    from servegate.bench.serving import run_serving
    from servegate.config import ServingConfig
    from servegate.engines import SGLangEngine, VLLMEngine

    engine = SGLangEngine() if args.protocol == "native" else VLLMEngine()
    cfg = ServingConfig(dataset="random", num_prompts=args.num_prompts, random_input_len=16,
                        random_output_len=args.output_len, random_range_ratio=1.0, arrival="all-at-once",
                        max_concurrency=args.concurrency, progress=False)
    before = resource.getrusage(resource.RUSAGE_SELF)
    res = run_serving(args.base_url, engine, cfg)
    after = resource.getrusage(resource.RUSAGE_SELF)
    s = res.summary.iloc[0]
    expected = args.num_prompts * args.output_len
    if int(s["completed"]) != args.num_prompts or int(s["total_output_tokens"]) != expected:
        print(f"incomplete run: {int(s['completed'])} completed, {int(s['total_output_tokens'])} tokens "
              f"of {expected}", file=sys.stderr)
        return 1
    itls = np.concatenate([np.asarray(x, dtype=float) for x in res.requests["itls_ms"]])
    print(json.dumps({
        "chunks": expected,
        "cpu_run_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "coalesced_frac": float(np.mean(itls == 0.0)),
        "event_loop": res.meta.get("event_loop"),
    }))
    return 0


def measure(argv_for: Any, short: int, long: int, output_len: int, repeats: int,
            timeout_s: float) -> dict[str, Any]:
    """Median marginal µs/chunk over ``repeats`` (short, long) pairs, run alternately."""
    per_chunk, per_chunk_run, coalesced, walls = [], [], [], []
    extra_chunks = (long - short) * output_len
    for _ in range(repeats):
        r_short, _, _ = run_client(wrapped(argv_for(short)), timeout_s)
        r_long, wall_l, _ = run_client(wrapped(argv_for(long)), timeout_s)
        per_chunk.append((r_long["cpu_s"] - r_short["cpu_s"]) / extra_chunks * 1e6)
        if "cpu_run_s" in r_long:
            per_chunk_run.append((r_long["cpu_run_s"] - r_short["cpu_run_s"]) / extra_chunks * 1e6)
            coalesced.append(r_long["coalesced_frac"])
        walls.append(wall_l)
    out: dict[str, Any] = {"us_per_chunk_median": statistics.median(per_chunk), "us_per_chunk_runs": per_chunk,
                           "long_run_wall_s_median": statistics.median(walls)}
    if per_chunk_run:
        out["run_only_us_per_chunk_median"] = statistics.median(per_chunk_run)
        out["coalesced_frac_median"] = statistics.median(coalesced)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_rusage"]:
        return _rusage_main(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    parser = argparse.ArgumentParser(description="client CPU per streamed chunk")
    parser.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--short", type=int, default=32, help="requests in the short run")
    parser.add_argument("--long", type=int, default=544, help="requests in the long run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=1.0, help="near-free server's decode step")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--other-client", help="another client command (placeholders: see the module doc)")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    # internal: one servegate client run
    parser.add_argument("--_client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--protocol", help=argparse.SUPPRESS)
    parser.add_argument("--num-prompts", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._client:
        return _client_main(args)

    server, port = start_server(args.output_len, args.step_ms)
    base_url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"loadavg_before": os.getloadavg(), "output_len": args.output_len,
                               "concurrency": args.concurrency, "short": args.short, "long": args.long,
                               "repeats": args.repeats, "step_ms": args.step_ms}
    try:
        for protocol in args.protocols:
            def ours(n: int, protocol: str = protocol) -> list[str]:
                return servegate_client_argv(base_url, protocol, n, args.output_len, args.concurrency)

            row = {"servegate": measure(ours, args.short, args.long, args.output_len, args.repeats,
                                        args.timeout_s)}
            if args.other_client:
                def other(n: int, protocol: str = protocol) -> list[str]:
                    fields = {"base_url": base_url, "host": "127.0.0.1", "port": port, "num_prompts": n,
                              "output_len": args.output_len, "concurrency": args.concurrency,
                              "protocol": protocol, "sglang_backend": SGLANG_BACKEND[protocol]}
                    return [part.format(**fields) for part in shlex.split(args.other_client)]

                row["other"] = measure(other, args.short, args.long, args.output_len, args.repeats,
                                       args.timeout_s)
            results[protocol] = row
    finally:
        stop(server)
    results["loadavg_after"] = os.getloadavg()

    print(f"load average before {results['loadavg_before'][0]:.2f}, after {results['loadavg_after'][0]:.2f}; "
          f"{args.output_len}-token outputs, concurrency {args.concurrency}, runs of {args.short} and "
          f"{args.long} requests, {args.repeats} pairs, server step {args.step_ms} ms")
    for protocol in args.protocols:
        row = results[protocol]
        ours = row["servegate"]["us_per_chunk_median"]
        target = TARGET_US[protocol]
        runs = ", ".join(f"{x:.1f}" for x in row["servegate"]["us_per_chunk_runs"])
        print(f"{protocol:7s} servegate: {ours:6.2f} us/chunk (median; runs {runs}) "
              f"target <= {target:.0f}: {'met' if ours <= target else 'NOT met'}; run_serving alone "
              f"{row['servegate']['run_only_us_per_chunk_median']:.2f} us/chunk; "
              f"{row['servegate']['coalesced_frac_median']:.0%} of chunks shared a read")
        if "other" in row:
            theirs = row["other"]["us_per_chunk_median"]
            runs = ", ".join(f"{x:.1f}" for x in row["other"]["us_per_chunk_runs"])
            print(f"{protocol:7s} other:     {theirs:6.2f} us/chunk (median; runs {runs}); "
                  f"servegate/other = {ours / theirs:.2f}")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
