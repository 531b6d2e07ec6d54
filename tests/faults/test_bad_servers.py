"""The gate against servers that misbehave: it attaches (engine external) to a real HTTP server
(``tests/integration/sim_server.py``, run in this process) that lies, stalls, breaks its streams
or answers with errors and HTML.

Each scenario: never a pass; exit 1 only where the server demonstrably served wrong answers
(failed requests are a breach of the "no failed requests" expectation), 2 where nothing could be
measured; a one-line reason; the verdict's text escaped wherever it is rendered; no process left;
the history database intact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from faultutil import REPO, db_state, gate_env, survivors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from sim_server import SimServer, SimState  # noqa: E402

pytestmark = [pytest.mark.gate, pytest.mark.timeout(300)]

HTML = '<img src=x onerror="alert(1)">'
EXTERNAL = [
    "--set", "worker.engine=external",
    "--set", "one_batch.batch_sizes=[1, 2]",
    "--set", "one_batch.input_lens=[16]",
    "--set", "one_batch.output_lens=[8]",
    "--set", "serving.num_prompts=12",
    "--set", "serving.random_input_len=16",
    "--set", "serving.random_output_len=8",
    "--set", "serving.request_rate=20",
    "--set", "serving.progress=false",
    "--set", "warmup.request_timeout_s=4",
    "--set", "one_batch.request_timeout_s=4",
    "--set", "serving.request_timeout_s=4",
    "--set", "stage_max_s=60",
]

# scenario -> (what the server does, expected exit, a word the reason or verdict must carry)
SCENARIOS = {
    "lying-token-counts": (dict(claim_factor=3), 2, "completion tokens"),
    "garbage-sse": (dict(garbage_stream=True), 2, "JSON"),
    "stream-cut": (dict(cut_stream_after_tokens=3), 2, "stream"),
    "5xx-burst": (dict(error_burst=(8, 4)), 1, "failed"),
    "all-5xx-html": (dict(generate_status=502, error_body=f"<html>{HTML}</html>"), 2, "502"),
    "hang": (dict(hang_routes={"/v1/completions"}), 2, "deadline"),
    "drip": (dict(drip_routes={"/v1/completions"}, drip_interval_s=0.5), 2, "deadline"),
    "html-model-name": (dict(model=HTML), 0, ""),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_gate_against_a_misbehaving_server(tmp_path: Path, scenario: str) -> None:
    behaviour, want_exit, word = SCENARIOS[scenario]
    with SimServer(SimState(per_token_delay_s=0.002, **behaviour)) as sim:
        proc = subprocess.run(
            [sys.executable, "-m", "servegate", "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"),
             "--json", *EXTERNAL, "--set", f"worker.url={sim.base_url}"],
            cwd=REPO, env=gate_env(tmp_path), capture_output=True, text=True, timeout=240)
    start = proc.stdout.find("{")
    assert start >= 0, f"no verdict on stdout (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    verdict = json.loads(proc.stdout[start:])
    shown = json.dumps({k: verdict[k] for k in ("status", "reason", "breaches", "infra_errors")}, indent=1)[:4000]
    assert proc.returncode == want_exit, f"{scenario}: exit {proc.returncode}, wanted {want_exit}\n{shown}"
    assert verdict["status"] == {0: "pass", 1: "fail", 2: "inconclusive"}[want_exit], shown
    if want_exit:
        said = " ".join([verdict["reason"], *verdict["infra_errors"], *(json.dumps(b) for b in verdict["breaches"])])
        assert word.lower() in said.lower(), f"{scenario}: {word!r} not in the verdict\n{shown}"
    run_dir = Path(verdict["run_dir"])
    for rendered in ("summary.md", "report.html"):
        text = (run_dir / rendered).read_text(encoding="utf-8") if (run_dir / rendered).is_file() else ""
        assert "<img" not in text, f"{rendered} carries the server's HTML raw:\n{text[:3000]}"
    assert not survivors(tmp_path, within_s=20)
    db = db_state(tmp_path)
    assert db.integrity == "ok" and db.runs == 1, db
