"""What one paired decision costs, round by round: launches and restarts, flushes, measurement.

Runs one real paired gate (``python -m servegate run --profile smoke-ab``, through
``gate_overhead.run_gate``: its own session, ended as a tree on ``--timeout-s``; nothing recorded in
the history database) or reads a finished run folder, and splits the paired stage with its tables:

- launch + warm-up of both workers: ``paired_workers`` (``launch_s`` + ``warmup_s`` per side and
  instance), the first instance apart from the restarts every ``rounds_per_worker`` rounds;
- rounds: ``paired_rounds.block_s`` (A's and B's block, each after a flush); within it, serving is
  estimated by the two blocks' median end-to-end latency, summed, or the larger of the two in a duet,
  where both blocks run at once (4 requests sent at once: a block lasts
  about its slowest request, so this is a lower bound of serving and the flush share an upper
  bound), the rest is flush, the settle pause after it (``Engine.idle_spin_s``: 0 for the embedded
  worker, 1.5 s per block for vLLM) and client overhead;
- the rest of the stage: stopping the workers, tables.

It also prints the decision (rounds, ``stopped_because``, ratio and interval of each gated metric)
and the noise the decision saw: the per-round sd of the ITL log ratio and the sd of the
per-instance means, which ``paired_sequential.py`` takes as ``--round-sd``/``--instance-sd``, with
the seconds per round and per restart it takes as ``--block-s``/``--restart-s``.

    python benchmarks/paired_cost.py
    python benchmarks/paired_cost.py --set 'worker.extra_args=["--fault-decode-slowdown-pct","3"]'
    python benchmarks/paired_cost.py --run-dir runs/<run folder>
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from gate_overhead import from_run_dir, run_gate  # benchmarks/ is on sys.path when run as a script


def _stage_seconds(manifest: dict[str, Any], name: str) -> float:
    return sum(float(s.get("duration_s") or 0.0) for s in manifest.get("stages", []) if s["stage"] == name)


def _instance_sd(by_instance: Any) -> dict[str, float]:
    """Within-instance sd of the log ratio, and the sd of an instance's offset: the spread of the
    instance means less what their rounds' own noise gives them (one-way random effects, moments)."""
    means, sizes = by_instance.mean(), by_instance.size()
    within_var = by_instance.var(ddof=1).mul(sizes - 1).sum() / max(1, int((sizes - 1).sum()))
    if len(means) < 2 or not math.isfinite(within_var):
        return {"itl_within_sd": math.sqrt(within_var) if math.isfinite(within_var) else math.nan,
                "itl_instance_sd": math.nan}
    offset_var = float(means.var(ddof=1)) - within_var * float((1.0 / sizes).mean())
    return {"itl_within_sd": math.sqrt(within_var), "itl_instance_sd": math.sqrt(max(0.0, offset_var))}


def breakdown(run_dir: Path, manifest: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The cost figures of the paired stage of one run folder."""
    def table(name: str) -> pd.DataFrame:
        path = run_dir / f"{name}.parquet"
        if not path.is_file():
            raise SystemExit(f"{run_dir} has no {name}.parquet: not a paired run, or its paired stage broke "
                             f"(see its stages.json and worker logs)")
        return pd.read_parquet(path)

    summary, rounds, workers = table("paired"), table("paired_rounds"), table("paired_workers")
    per_round = rounds.drop_duplicates("round").set_index("round")
    e2e = rounds[rounds["metric"] == "e2e_median_ms"].set_index("round")
    # Interleaved, A's block then B's; in a duet (order "A+B") both at once, so the slower of the two.
    together = per_round["order"].reindex(e2e.index).eq("A+B")
    serving_s = e2e["a_value"].add(e2e["b_value"]).where(~together, e2e[["a_value", "b_value"]].max(axis=1)) / 1000.0
    itl = rounds[rounds["metric"] == "itl_median_ms"]
    by_instance = itl.groupby("instance")["log_ratio"]
    workers = workers.assign(cost_s=workers["launch_s"] + workers["warmup_s"])
    if "pair_s" in workers and workers["pair_s"].notna().all():
        # The pair's wall time (both start up side by side, the previous pair's stop included).
        pair_s = workers.groupby("instance")["pair_s"].first()
    else:  # a run folder from before pair_s: the two started one after the other
        pair_s = workers.groupby("instance")["cost_s"].sum()
    first = workers[workers["instance"] == 0]
    restarts = pair_s[pair_s.index > 0]
    n_rounds = len(per_round)
    block = per_round["block_s"]
    stage_s = _stage_seconds(manifest, "paired")
    accounted = pair_s.get(0, 0.0) + restarts.sum() + block.sum()
    gated = summary[summary["gated"].astype(bool)]
    return {
        "run_dir": str(run_dir), "wall_s": wall_s, "paired_stage_s": stage_s, "rounds": n_rounds,
        "instances": int(workers["instance"].nunique()),
        "measure_s": float(summary["measure_s"].iloc[0]), "stopped_because": summary["stopped_because"].iloc[0],
        "first_pair_s": float(pair_s.get(0, math.nan)), "first_launch_s": float(first["launch_s"].max()),
        "first_warmup_s": float(first["warmup_s"].max()),
        "restarts": len(restarts), "restart_s_total": float(restarts.sum()),
        "restart_s_median": float(restarts.median()) if len(restarts) else math.nan,
        "launch_s_per_worker_median": float(workers["launch_s"].median()),
        "warmup_s_per_worker_median": float(workers["warmup_s"].median()),
        "block_s_total": float(block.sum()), "block_s_median": float(block.median()),
        "serving_s_total": float(serving_s.sum()), "serving_s_median": float(serving_s.median()),
        "flush_and_overhead_s_total": float((block - serving_s).sum()),
        "flush_and_overhead_s_median": float((block - serving_s).median()),
        "rest_of_stage_s": stage_s - accounted,
        "round_s_with_restarts": (block.sum() + restarts.sum()) / n_rounds if n_rounds else math.nan,
        "itl_round_sd": float(itl["log_ratio"].std(ddof=1)) if len(itl) > 1 else math.nan,
        **_instance_sd(by_instance),
        "gated": [{"metric": r.metric, "decision": r.decision, "ratio": float(r.ratio), "ci_low": float(r.ci_low),
                   "ci_high": float(r.ci_high)} for r in gated.itertuples(index=False)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the cost of one paired decision, round by round")
    parser.add_argument("--profile", default="smoke-ab")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--keep", action="store_true", help="keep the run folder (printed)")
    parser.add_argument("--run-dir", type=Path, help="read this run folder instead of running a gate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    out = None
    try:
        if args.run_dir:
            result = from_run_dir(args.run_dir)
        else:
            out = Path(tempfile.mkdtemp(prefix="servegate-paired-cost-"))
            result = run_gate(args.profile, ["store.enabled=false", *args.overrides], out, args.timeout_s)
        b = breakdown(Path(result["run_dir"]), result["manifest"], result["wall_s"])
    finally:
        if out is not None and not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    load_after = os.getloadavg()[0]

    ran = ("read from the run folder" if args.run_dir else
           f"`{' '.join(result['cmd'][1:])}` exit {result['exit_code']}")
    print(f"load average before {load_before:.2f}, after {load_after:.2f}; {ran}")
    if args.keep or args.run_dir:
        print(f"run folder: {b['run_dir']}")
    n, stage = b["rounds"], b["paired_stage_s"]
    print(f"decision: {n} rounds on {b['instances']} worker instance(s), {b['stopped_because']}; "
          + "; ".join(f"{g['metric']} {g['decision']} x{g['ratio']:.4f} [{g['ci_low']:.4f}, {g['ci_high']:.4f}]"
                      for g in b["gated"]))
    print(f"{'':44s} {'total s':>8} {'per round':>9} {'median':>7} {'of stage':>8}")

    def line(label: str, total: float, median: float = math.nan) -> None:
        med = f"{median:7.2f}" if math.isfinite(median) else f"{'':7s}"
        print(f"{label:44s} {total:8.1f} {total / n if n else math.nan:9.2f} {med} {total / stage:8.1%}")

    line("first launch + warm-up (both workers)", b["first_pair_s"])
    line(f"restarts ({b['restarts']}: stop, launch + warm-up of both)", b["restart_s_total"], b["restart_s_median"])
    line("rounds (block_s: A and B)", b["block_s_total"], b["block_s_median"])
    line("  serving (median e2e: A + B, duet max)", b["serving_s_total"], b["serving_s_median"])
    line("  flush + settle + client overhead (rest)", b["flush_and_overhead_s_total"], b["flush_and_overhead_s_median"])
    line("rest of the stage (stops, tables)", b["rest_of_stage_s"])
    line("paired stage", stage)
    print(f"per worker: launch {b['launch_s_per_worker_median']:.1f} s, "
          f"warm-up {b['warmup_s_per_worker_median']:.1f} s "
          f"(medians); a round with its share of restarts {b['round_s_with_restarts']:.1f} s")
    print(f"to the decision: {b['measure_s']:.0f} s of measurement (first round to decision), paired stage "
          f"{stage:.0f} s, whole gate {b['wall_s']:.0f} s")
    print(f"noise seen: ITL log ratio sd per round {b['itl_round_sd']:.2%} (within an instance "
          f"{b['itl_within_sd']:.2%}), instance offset sd {b['itl_instance_sd']:.2%} from {b['instances']} instances "
          f"(paired_sequential.py --round-sd/--instance-sd; "
          f"--block-s {b['block_s_median']:.1f} --restart-s {b['restart_s_median']:.1f})")
    if args.json:
        print(json.dumps(b, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
