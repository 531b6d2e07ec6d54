"""Does the paired e2e test still see a regression? A mutation check (issue 38).

Copies this servegate package into a temporary folder (``servegate.paired.zoo.copy_package``, as the zoo's
trees are made), adds ``--pct`` % of each decode step's own CPU time
as more computation in the copy's scheduler (``Scheduler._decode_step``: a real code change, not a fault
switch), and runs the paired e2e test's gate — ``servegate run --profile smoke-ab`` with
tests/e2e/test_paired_gate.py's short design — with the copy on the candidate's ``PYTHONPATH``. Prints the
gate's exit code, verdict and ITL reading: a +30 % mutation must exit 1 (regression), as the test's real
slower kernel (+9 % solo) does.

    python benchmarks/paired_mutation.py [--pct 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from servegate.paired.zoo import copy_package

REPO = Path(__file__).resolve().parents[1]
# tests/e2e/test_paired_gate.py's FAST design and the real-kernel test's own settings.
DESIGN = ["paired.bound=0.05", "paired.max_measure_s=300", "paired.min_rounds=6", "paired.min_units=6",
          "paired.max_rounds=16"]
ANCHOR = "        fwd_cpu_s = time.thread_time() - fwd_cpu_start\n"


def mutate(dest: Path, pct: float) -> Path:
    """``dest/servegate``: this package with each decode step ``pct`` % more CPU work; returns ``dest``."""
    dest = copy_package(dest)
    scheduler = dest / "servegate" / "worker" / "scheduler.py"
    source = scheduler.read_text()
    if source.count(ANCHOR) != 1:
        raise SystemExit(f"the decode step of {scheduler} changed: update ANCHOR in {__file__}")
    scheduler.write_text(source.replace(ANCHOR, ANCHOR + f"        burn_cpu_for(fwd_cpu_s * {pct / 100.0!r})\n"))
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pct", type=float, default=30.0, help="extra CPU work per decode step, in %% (default 30)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="servegate-mutation-") as tmp:
        tree = mutate(Path(tmp) / "candidate", args.pct)
        cmd = [sys.executable, "-m", "servegate", "run", "--profile", "smoke-ab", "--json",
               "--output-dir", str(Path(tmp) / "runs"),
               *(a for s in [*DESIGN, f'worker.env={{"PYTHONPATH": "{tree}"}}'] for a in ("--set", s))]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
        wall = time.monotonic() - started
        try:
            verdict = json.loads(proc.stdout)
        except json.JSONDecodeError:
            print(f"exit {proc.returncode}, no verdict on stdout:\n{proc.stderr[-3000:]}")
            return 2
        paired = Path(verdict["run_dir"]) / "paired.parquet"
        print(f"mutation: +{args.pct:g} % CPU work per decode step in the candidate's scheduler")
        print(f"gate: exit {proc.returncode}, {verdict['status']} in {wall:.0f} s: {verdict['reason']}")
        if paired.is_file():
            table = pd.read_parquet(paired).set_index("metric")
            for metric in ("itl_median_ms", "cpu_ms_per_token"):
                if metric in table.index:
                    row = table.loc[metric]
                    print(f"  {metric:<18} x{row['ratio']:.4f} [{row['ci_low']:.4f}, {row['ci_high']:.4f}] "
                          f"{row['decision']} after {int(row['rounds'])} rounds")
        return 0 if proc.returncode == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
