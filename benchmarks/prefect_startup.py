"""A gate's start-up with Prefect's ephemeral server vs with a running ``prefect server start``.

Without ``PREFECT_API_URL``, every ``servegate run`` starts a temporary Prefect API server (a
uvicorn child on SQLite under ``PREFECT_HOME``) before its flow can begin, and stops it at the end.
With ``PREFECT_API_URL`` pointing at a long-lived server, the gate only talks to it. This script
starts one such server (``prefect server start`` on loopback; on the database named by
``PREFECT_API_DATABASE_CONNECTION_URL`` when that is set, else SQLite in a temporary home), then
runs the same tiny gate (``tiny-random`` embedded worker, 4 prompts: start-up, not measurement)
alternately in the two modes, A B A B ..., each a fresh ``python -m servegate run`` process, and
prints per mode the medians of:

- ``to_folder_s``: process start -> run folder created (``manifest.started_at``): interpreter,
  imports, config and Prefect's API (the ephemeral server's start-up lands here);
- ``to_first_stage_s``: process start -> the first stage (``host``, then ``launch``) started: the fixed cost
  before a gate does its own work (the stage's record appears in ``manifest.json`` when it ends,
  with its duration; the script polls for it, so this is to within ~20 ms);
- ``wall_s``: process start -> exit (the ephemeral server's shut-down lands here too);

and the saving per gate (ephemeral minus running). One discarded warm-up pair first (the
ephemeral server's SQLite file is created and migrated once per ``PREFECT_HOME``, as on a
laptop's first run). In running mode it checks that each gate's flow run is on the long-lived
server, so the figures are really those of a gate that started no temporary server.

    python benchmarks/prefect_startup.py                # 5 pairs
    python benchmarks/prefect_startup.py --pairs 8 --keep
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
TINY = ["worker.model=tiny-random", "warmup.num_requests=1", "warmup.max_new_tokens=4",
        "one_batch.batch_sizes=[1]", "one_batch.input_lens=[8]", "one_batch.output_lens=[4]",
        "serving.num_prompts=4", "serving.random_input_len=8", "serving.random_output_len=4",
        "serving.request_rate=inf", "occupancy.enabled=false", "quality.enabled=false", "report.html=false",
        "compare.enabled=false", "validate.expectation_profile=smoke",
        "host.enabled=false"]  # start-up, not a measurement: a busy host must not stop the run
MODES = ("ephemeral", "running")
SERVER_START_TIMEOUT_S = 180.0


def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _end_tree(pid: int) -> None:
    from servegate.proctree import terminate_tree

    terminate_tree(pid, timeout_s=15)


def _base_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
                "SERVEGATE_DB": f"sqlite:///{work / 'history.db'}"})
    # A gate talks to an API (its own temporary one, or PREFECT_API_URL); only the server opens a database.
    for name in ("PREFECT_API_URL", "SERVEGATE_DEVICE_SLOT", "PREFECT_API_DATABASE_CONNECTION_URL"):
        env.pop(name, None)
    return env


def start_server(work: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str, Any]:
    """``prefect server start`` on a free loopback port; returns it, its API URL and its open log."""
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    log = open(work / "server.log", "w")  # noqa: SIM115 - closed when the server is ended
    server = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], cwd=REPO,
                              env={**env, "PREFECT_HOME": str(work / "server-home")}, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    import requests

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.close()
            raise SystemExit(f"prefect server start exited {server.returncode}; see {work / 'server.log'}")
        try:
            if requests.get(f"{api}/health", timeout=2).status_code == 200:
                return server, api, log
        except requests.RequestException:
            pass
        time.sleep(0.5)
    _end_tree(server.pid)
    log.close()
    raise SystemExit(f"prefect server not healthy after {SERVER_START_TIMEOUT_S:.0f} s; see {work / 'server.log'}")


def run_gate(mode: str, api: str, work: Path, index: int, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    out = work / "runs" / f"{index:02d}-{mode}"
    out.mkdir(parents=True)
    env = _base_env(work)
    if mode == "running":
        env["PREFECT_API_URL"] = api
        env["PREFECT_HOME"] = str(work / "client-home")
    else:
        env["PREFECT_HOME"] = str(work / "ephemeral-home")  # one home: its SQLite file persists, as on a laptop
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "smoke", "--json", "--output-dir", str(out)]
    for item in [*TINY, *overrides]:
        cmd += ["--set", item]
    t_start = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    first_stage_ended: float | None = None
    try:
        first_stage_ended = _first_stage_seen(proc, out, t0 + timeout_s)
        _, stderr = proc.communicate(timeout=max(1.0, t0 + timeout_s - time.perf_counter()))
    except subprocess.TimeoutExpired:
        _end_tree(proc.pid)
        proc.communicate()
        raise SystemExit(f"a {mode} gate ran past {timeout_s:.0f} s and was ended; its folder is under {out}") from None
    except BaseException:  # Ctrl-C: the gate (its own session) and its worker end with this script
        _end_tree(proc.pid)
        raise
    wall = time.perf_counter() - t0
    folders = [p for p in out.iterdir() if (p / "manifest.json").exists()]
    if len(folders) != 1:
        raise SystemExit(f"the {mode} gate wrote {len(folders)} run folders (exit {proc.returncode}):\n"
                         f"{stderr[-3000:]}")
    manifest = json.loads((folders[0] / "manifest.json").read_text())
    if proc.returncode == 2 or first_stage_ended is None or not manifest["stages"]:
        raise SystemExit(f"the {mode} gate could not decide (exit {proc.returncode}) or ran no stage; "
                         f"its folder: {folders[0]}\n{stderr[-3000:]}")
    first = manifest["stages"][0]
    return {"mode": mode, "to_folder_s": _ts(manifest["started_at"]) - t_start,
            "to_first_stage_s": first_stage_ended - t0 - float(first["duration_s"]), "wall_s": wall,
            "first_stage": first["stage"], "exit_code": proc.returncode}


def _first_stage_seen(proc: subprocess.Popen, out: Path, deadline: float) -> float | None:
    """When (perf_counter) the run's manifest first held a stage record, polled every 20 ms.

    A stage's record is written the moment it ends, with its duration; its start is that moment
    minus the duration (to within the poll interval). None when the gate exited first.
    """
    while proc.poll() is None:
        if time.perf_counter() > deadline:
            raise subprocess.TimeoutExpired(proc.args, 0)
        for manifest in out.glob("*/manifest.json"):
            try:
                stages = json.loads(manifest.read_text()).get("stages")
            except (OSError, json.JSONDecodeError):  # written atomically, but a folder may be mid-creation
                continue
            if stages:
                return time.perf_counter()
        time.sleep(0.02)
    return None


def gate_runs_on_server(api: str) -> list[dict[str, Any]]:
    """The ``regression-gate`` flow runs the long-lived server knows (name and state)."""
    import requests

    reply = requests.post(f"{api}/flow_runs/filter", json={"flows": {"name": {"any_": ["regression-gate"]}}},
                          timeout=30)
    reply.raise_for_status()
    return [{"name": r["name"], "state": r["state_type"]} for r in reply.json()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="measured ephemeral/running pairs (default 5)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every gate")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per gate (default 600)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (run folders, server log)")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")

    work = Path(tempfile.mkdtemp(prefix="servegate-prefect-startup-"))
    server_env = _base_env(work)
    if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        server_env["PREFECT_API_DATABASE_CONNECTION_URL"] = os.environ["PREFECT_API_DATABASE_CONNECTION_URL"]
    server, api, log = start_server(work, server_env)
    db = os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL", "")
    backend = db.split(":", 1)[0] if db else "sqlite (temporary)"
    print(f"long-lived server: {api} on {backend}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    rows: list[dict[str, Any]] = []
    try:
        for index in range(args.pairs + 1):
            # A B A B ...: ephemeral, running, ephemeral, ...; the first pair (index 0) is a warm-up, not counted.
            for mode in MODES:
                row = run_gate(mode, api, work, index, args.overrides, args.timeout_s)
                row["warmup"] = index == 0
                rows.append(row)
                print(f"  {'warm-up' if index == 0 else f'pair {index}':>8} {mode:<9} "
                      f"to folder {row['to_folder_s']:6.2f} s  to first stage {row['to_first_stage_s']:6.2f} s  "
                      f"wall {row['wall_s']:6.2f} s  exit {row['exit_code']}", flush=True)
        on_server = gate_runs_on_server(api)
    finally:
        _end_tree(server.pid)
        log.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    running_runs = sum(1 for r in rows if r["mode"] == "running")
    if len(on_server) != running_runs or any(r["state"] != "COMPLETED" for r in on_server):
        print(f"error: {running_runs} gates ran against the server but it holds {on_server}: a gate with "
              f"PREFECT_API_URL set did not use that server", file=sys.stderr)
        return 2
    measured = [r for r in rows if not r["warmup"]]
    print(f"\nmedians over {args.pairs} pair(s), alternating; {running_runs} gate flow runs found on the server, "
          f"all COMPLETED; load {os.getloadavg()[0]:.2f}")
    print(f"{'':<22}{'ephemeral':>12}{'running':>12}{'saved':>12}")
    for metric in ("to_folder_s", "to_first_stage_s", "wall_s"):
        med = {m: statistics.median(r[metric] for r in measured if r["mode"] == m) for m in MODES}
        print(f"{metric:<22}{med['ephemeral']:>12.2f}{med['running']:>12.2f}{med['ephemeral'] - med['running']:>12.2f}")
    savings = [e["to_first_stage_s"] - r["to_first_stage_s"] for e, r in zip(
        (x for x in measured if x["mode"] == "ephemeral"), (x for x in measured if x["mode"] == "running"))]
    print(f"saving to first stage per pair: {', '.join(f'{s:.2f}' for s in savings)} s "
          f"(median {statistics.median(savings):.2f} s per gate)")
    if args.keep:
        print(f"work folder kept: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
