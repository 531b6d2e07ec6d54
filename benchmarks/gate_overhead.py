"""Where a smoke gate's wall time goes: measurement stages versus everything else.

Runs ``python -m servegate run --profile smoke --json`` as a subprocess (the way a nightly
pipeline runs it), timing it from just before the process starts to its exit, then reads
the run folder's ``manifest.json`` (``started_at``/``finished_at`` and one record per stage
with ``started_at``/``duration_s``) and splits the wall time into:

- start-up before the flow: interpreter, imports, Prefect's ephemeral API server, config
  (process start -> ``manifest.started_at``);
- each stage's own duration (launch: what is left of the worker's start-up when the flow gets
  there — ``servegate run`` starts the worker's process before Prefect and the flow are up, so
  the model load overlaps them; validate includes Great Expectations; flush/warmup are
  preparation, not measurement);
- orchestration: time inside the flow not covered by any stage record (Prefect task runs,
  state updates, artifacts);
- tear-down after the flow: report, Prefect shut-down, interpreter exit
  (``manifest.finished_at`` -> process exit).

Measurement = one_batch + serving + occupancy (+ quality when it ran). It prints the
non-measurement share (target <= 10 %) and the fixed start-up, process start -> first
measurement stage (target <= 10 s, issue 17), from the first measurement stage's ``started_at``
(stamped by ``GateRun.stage`` since issue 17; a run folder from before has none, and then the
durations of the stages before it are added up, which leaves out the gaps between them). It
also times the bare imports, to say what part of the start-up is Python importing Prefect/GX/torch.

``--prefect-server`` first starts a ``prefect server start`` (``benchmarks/prefect_startup.py``'s, on
loopback with its own home) and runs the gate with ``PREFECT_API_URL`` naming it, as a nightly
pipeline with a long-lived Prefect server does: the gate then starts no temporary API server. One
gate runs first and is discarded (a new server's first flow run registers the flow and warms its
database; right after its start the server's own services are still busy).

    python benchmarks/gate_overhead.py
    python benchmarks/gate_overhead.py --prefect-server
    python benchmarks/gate_overhead.py --set serving.num_prompts=48 --keep
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from servegate.proctree import terminate_tree

MEASUREMENT_STAGES = ("one_batch", "serving", "occupancy", "quality")
TARGET_SHARE = 0.10
TARGET_STARTUP_S = 10.0


def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def import_time(module: str, timeout_s: float = 300.0) -> float:
    """Wall seconds of ``python -c 'import module'`` in a fresh interpreter."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=timeout_s,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run_gate(profile: str, overrides: list[str], output_dir: Path, timeout_s: float,
             api_url: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", profile, "--json", "--output-dir", str(output_dir)]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    wall_start = time.time()
    t0 = time.perf_counter()
    # Its own session, so that a timeout can end the whole tree (worker, Prefect's server).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        terminate_tree(proc.pid, timeout_s=15)
        proc.communicate()
        raise SystemExit(f"the gate ran past {timeout_s} s and was ended; its run folder is under {output_dir} "
                         f"(analyse it with --run-dir)") from None
    wall = time.perf_counter() - t0
    folders = sorted(p for p in output_dir.iterdir() if (p / "manifest.json").exists())
    if not folders:
        raise SystemExit(f"the gate wrote no run folder (exit {proc.returncode}):\n{stderr[-3000:]}")
    manifest = json.loads((folders[-1] / "manifest.json").read_text())
    return {"cmd": cmd, "exit_code": proc.returncode, "wall_s": wall, "wall_start": wall_start,
            "manifest": manifest, "run_dir": str(folders[-1]), "worker_startup_s": _worker_startup_s(folders[-1])}


def _worker_startup_s(run_dir: Path) -> float | None:
    """The worker table's ``startup_s`` (process start -> ready), None without one."""
    import csv

    try:
        with open(run_dir / "worker.csv", newline="") as fh:
            return float(next(csv.DictReader(fh))["startup_s"])
    except (OSError, StopIteration, KeyError, ValueError):
        return None


def from_run_dir(run_dir: Path) -> dict[str, Any]:
    """A finished (or interrupted) run folder without process timing: the flow's own span."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    start = _ts(manifest["started_at"])
    end = _ts(manifest.get("finished_at")) or (run_dir / "manifest.json").stat().st_mtime
    return {"cmd": ["(run folder)", str(run_dir)], "exit_code": None, "wall_s": end - start, "wall_start": start,
            "manifest": manifest, "run_dir": str(run_dir), "worker_startup_s": _worker_startup_s(run_dir)}


def breakdown(result: dict[str, Any]) -> dict[str, Any]:
    m = result["manifest"]
    start, wall = result["wall_start"], result["wall_s"]
    flow_start, flow_end = _ts(m.get("started_at")), _ts(m.get("finished_at"))
    stages = [(s["stage"], s.get("status"), float(s.get("duration_s") or 0.0), _ts(s.get("started_at")))
              for s in m.get("stages", [])]
    in_stages = sum(d for _, _, d, _ in stages)
    measured = sum(d for name, _, d, _ in stages if name in MEASUREMENT_STAGES)
    flow_end = flow_end or (start + wall)
    flow_start = flow_start or start
    # Fixed start-up: process start -> first measurement stage. Stage records carry their
    # start time when the flow stamps it; otherwise add up the stages that ran before.
    firsts = [t for name, _, _, t in stages if name in MEASUREMENT_STAGES and t is not None]
    if firsts:
        fixed = min(firsts) - start
    else:
        fixed = flow_start - start
        for name, _, d, _ in stages:
            if name in MEASUREMENT_STAGES:
                break
            fixed += d
    return {
        "wall_s": wall,
        "startup_before_flow_s": flow_start - start,
        "stages": stages,
        "orchestration_s": (flow_end - flow_start) - in_stages,
        "teardown_after_flow_s": start + wall - flow_end,
        "measurement_s": measured,
        "non_measurement_share": 1.0 - measured / wall,
        "fixed_startup_s": fixed,
        "startup_from_stamp": bool(firsts),
        "worker_startup_s": result.get("worker_startup_s"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="split a smoke gate's wall time into stages and overhead")
    parser.add_argument("--profile", default="smoke")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--keep", action="store_true", help="keep the run folder (printed)")
    parser.add_argument("--no-imports", action="store_true", help="skip timing the bare imports")
    parser.add_argument("--run-dir", type=Path, help="analyse this run folder instead of running a gate "
                        "(the flow's span only: no process start-up or exit)")
    parser.add_argument("--prefect-server", action="store_true",
                        help="run the gate against a `prefect server start` started first (PREFECT_API_URL)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    if args.run_dir:
        args.no_imports, args.keep = True, True
    imports = {} if args.no_imports else {
        mod: import_time(mod) for mod in ("servegate.cli", "prefect", "great_expectations", "torch", "transformers")}
    if args.run_dir:
        result = from_run_dir(args.run_dir)
    else:
        out = Path(tempfile.mkdtemp(prefix="servegate-overhead-"))
        server = None
        try:
            api_url = None
            if args.prefect_server:
                from prefect_startup import _base_env, start_server

                (out / "prefect").mkdir()
                server = start_server(out / "prefect", _base_env(out / "prefect"))
                api_url = server[1]
                warm_up = out / "warm-up"
                warm_up.mkdir()
                run_gate(args.profile, args.overrides, warm_up, args.timeout_s, api_url)
            result = run_gate(args.profile, args.overrides, out, args.timeout_s, api_url)
            result["prefect_api"] = api_url or "a temporary API server the gate starts"
        finally:
            if server is not None:
                terminate_tree(server[0].pid, timeout_s=15)
                server[2].close()
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    b = breakdown(result)
    load_after = os.getloadavg()[0]

    print(f"load average before {load_before:.2f}, after {load_after:.2f}; "
          f"`{' '.join(result['cmd'][1:])}` exit {result['exit_code']}")
    if result.get("prefect_api"):
        print(f"Prefect API: {result['prefect_api']}")
    if args.keep:
        print(f"run folder: {result['run_dir']}")
    w = b["wall_s"]
    print(f"{'wall time':34s} {w:8.2f} s  100.0 %")
    rows = [("start-up before the flow", b["startup_before_flow_s"])]
    rows += [(f"stage {name} ({status})", d) for name, status, d, _ in b["stages"]]
    rows += [("orchestration between stages", b["orchestration_s"]),
             ("tear-down after the flow", b["teardown_after_flow_s"])]
    for label, secs in rows:
        print(f"{label:34s} {secs:8.2f} s  {secs / w * 100:5.1f} %")
    print(f"{'measurement (' + '+'.join(MEASUREMENT_STAGES) + ')':34s} {b['measurement_s']:8.2f} s")
    if b["worker_startup_s"] is not None:
        print(f"{'worker start-up (startup_s)':34s} {b['worker_startup_s']:8.2f} s  (process start -> ready; "
              f"overlaps the start-up before the flow)")
    if not b["startup_from_stamp"]:
        print("(the run folder's stage records carry no started_at: start-up is the stages before the first "
              "measurement added up, without the gaps between them)")
    share, startup = b["non_measurement_share"], b["fixed_startup_s"]
    share_met = "met" if share <= TARGET_SHARE else "NOT met"
    print(f"non-measurement share {share:.1%} (target <= {TARGET_SHARE:.0%}: {share_met}); "
          f"fixed start-up to the first measurement {startup:.1f} s "
          f"(target <= {TARGET_STARTUP_S:.0f} s: {'met' if startup <= TARGET_STARTUP_S else 'NOT met'})")
    if imports:
        print("bare import wall times: " + ", ".join(f"{k} {v:.1f} s" for k, v in imports.items()))
    if args.json:
        print(json.dumps({**b, "imports_s": imports, "exit_code": result["exit_code"]}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
