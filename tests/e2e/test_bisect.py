"""`servegate bisect` end to end (issue 18): eight synthetic builds of the real embedded worker, a
slowdown that begins at build 5 and a build that does not start, each step a real paired gate run
(Prefect, GX, the history database).

The slowdown is a +100 % forward-pass sleep (ITL about +60-100 %) against a 30 % bound, and the workers
are not restarted (the rounds are the samples), so every
step decides in a few rounds on a busy machine; the broken build (an option the worker refuses)
lies on the search path, so the bisection has to step around it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2eutil import REPO, gate_env, stdout_json, worker_processes

pytestmark = [pytest.mark.timeout(1500)]

SLOW = '["--fault-decode-slowdown-pct", "100"]'
BROKEN = '["--no-such-option"]'
FAST = ["--set", "paired.bound=0.3", "--set", "paired.min_rounds=4", "--set", "paired.min_units=4",
        "--set", "paired.max_rounds=8", "--set", "paired.rounds_per_worker=200", "--set", "paired.output_len=16",
        "--set", "paired.requests_per_block=2", "--set", "paired.max_measure_s=180", "--set", "host.enabled=false"]


def _builds(path: Path) -> Path:
    lines = []
    for n in range(1, 9):
        args = SLOW if n >= 5 else "[]"
        if n == 6:
            args = BROKEN  # on the search path: b8, b4, then b6 is the middle
        lines += ["[[builds]]", f'ref = "b{n}"', f"extra_args = {args}", ""]
    path.write_text("\n".join(lines))
    return path


@pytest.mark.gate
def test_a_slowdown_from_build_5_of_8_is_bisected_to_it_around_a_broken_build(tmp_path: Path):
    builds = _builds(tmp_path / "builds.toml")
    cmd = [sys.executable, "-m", "servegate", "bisect", "--profile", "smoke-ab", "--builds", str(builds),
           "--output-dir", str(tmp_path / "runs"), "--json", *FAST]
    proc = subprocess.run(cmd, cwd=REPO, env=gate_env(tmp_path), capture_output=True, text=True, timeout=1400)
    result = stdout_json(proc)
    steps = [(s["ref"], s["outcome"]) for s in result["steps"]]
    assert proc.returncode == 0, f"{steps}\n{result['reason']}\n{proc.stderr[-3000:]}"
    assert result["status"] == "found" and result["first_bad"] == ["b5"] and result["last_good"] == "b4", steps
    # The endpoints first, then binary search; the broken build is reported, never guessed.
    assert steps == [("b8", "bad"), ("b4", "good"), ("b6", "skipped"), ("b5", "bad")]
    skipped = result["steps"][2]
    assert "did not start" in skipped["why"] and skipped["verdict"] == "inconclusive"

    # The effect: the first bad build against the good one, decided a regression beyond the bound.
    (itl,) = [m for m in result["effect"] if m["metric"] == "itl_median_ms"]
    assert itl["decision"] == "regression" and itl["ci_low"] > 1.3

    # Stored: the bisection's record and one gate run folder per measured step, in the history
    # under their own gate name.
    bisect_dir = Path(result["bisect_dir"])
    assert json.loads((bisect_dir / "bisect.json").read_text())["first_bad"] == ["b5"]
    assert "first bad**: b5" in (bisect_dir / "summary.md").read_text()
    for step in result["steps"]:
        config = json.loads((Path(step["run_dir"]) / "config.json").read_text())
        assert config["name"] == "smoke-ab-bisect" and config["baseline"]["extra_args"] == []
    from servegate.history import Store

    with Store(str(tmp_path / "history.db")) as store:
        assert sorted(str(r.key).split("/")[0] for r in store.runs()) == ["smoke-ab-bisect"] * 4
    assert not worker_processes(tmp_path)


def test_a_bad_builds_file_is_a_clear_error_with_exit_2(tmp_path: Path):
    builds = tmp_path / "builds.toml"
    builds.write_text('refs = ["a", "b"]\n[template]\npython = "/opt/venv/bin/python"\n')
    proc = subprocess.run([sys.executable, "-m", "servegate", "bisect", "--profile", "smoke-ab", "--builds",
                           str(builds)], cwd=REPO, env=gate_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "never mentions {ref}" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "servegate", "bisect", "--profile", "smoke", "--builds",
                           str(_builds(builds)), "--output-dir", str(tmp_path / "runs")],
                          cwd=REPO, env=gate_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "[baseline]" in proc.stderr
    assert not (tmp_path / "runs").exists()
