"""The ``transformers`` engine end to end: ``servegate run --profile transformers-cpu`` launches a real
``transformers serve --continuous-batching`` (SmolLM2-135M, CPU) and gates it, as CI does.

One gate run (about a minute here) is shared by the tests below. What the engine's capabilities say
must show in the run: no metrics and no log-probabilities make occupancy and quality *not applicable*
(never a breach), no flush route makes the flush a warning, and the server is gone when the gate ends.

The load generator speaks the "openai-text" dialect to it (docs/adding-an-engine.md, "What the OpenAI
protocol assumes"): random token-id prompts decoded with SmolLM2's tokenizer before the clock, no
``ignore_eos``, a stream that ends at its finish chunk; one-batch is off in the profile and would be
not applicable (the engine takes no list of prompts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # the e2e tests' helpers
from e2eutil import REPO, gate_env, marked_processes, stdout_json  # noqa: E402

pytestmark = [pytest.mark.gate, pytest.mark.engine, pytest.mark.exclusive]

GATE_TIMEOUT_S = 420  # ~1 min here; the profile's own max_wall_s is 900


def _model_cached() -> bool:
    from servegate.errors import ModelUnavailableError
    from servegate.models import ensure_model

    try:
        ensure_model("smollm2-135m", allow_fetch=False)
    except ModelUnavailableError:
        return False
    return True


def _serving_installed() -> bool:
    from transformers.utils.import_utils import is_serve_available

    return is_serve_available()


def _skip_or_fail(reason: str) -> None:
    # CI installs both (`scripts/setup.sh --tests`): there a missing one is a broken set-up, not a skip.
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


class GateRun:
    def __init__(self, proc: subprocess.CompletedProcess, tmp: Path, wall_s: float) -> None:
        self.proc, self.tmp, self.wall_s = proc, tmp, wall_s
        self.verdict: dict[str, Any] = stdout_json(proc)
        self.run_dir = Path(self.verdict["run_dir"])
        self.stages: dict[str, Any] = json.loads((self.run_dir / "stages.json").read_text())

    def status(self, stage: str) -> str:
        return self.stages[stage]["status"]

    def explain(self) -> str:
        stages = {name: (s["status"], s["error"]) for name, s in self.stages.items()}
        return (f"exit {self.proc.returncode}, verdict {self.verdict.get('status')}: {self.verdict.get('reason')}\n"
                f"stages: {json.dumps(stages, indent=1)}\nstderr tail:\n{self.proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> GateRun:
    if not _serving_installed():
        _skip_or_fail("transformers serve lacks its serving dependencies (openai); `pip install -e .` installs them")
    if not _model_cached():
        _skip_or_fail("SmolLM2 is not cached; run `servegate model fetch --model smollm2-135m`")
    tmp = tmp_path_factory.mktemp("transformers-gate")
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "transformers-cpu", "--json",
           "--output-dir", str(tmp / "runs")]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=gate_env(tmp), capture_output=True, text=True, timeout=GATE_TIMEOUT_S)
    return GateRun(proc, tmp, time.monotonic() - started)


def test_launch_warmup_and_capabilities(gate: GateRun) -> None:
    """What works against transformers serve today: launch (readiness on /health), warm-up over
    /v1/completions naming the model /v1/models lists, and the capabilities, stage by stage."""
    assert gate.status("launch") == "ok", gate.explain()
    assert gate.status("warmup") == "ok", gate.explain()  # /v1/models listed servegate/smollm2-135m
    assert gate.status("one_batch") == "skipped" and gate.stages["one_batch"]["error"] == "disabled in config"
    # No flush route: the flush "succeeds" by measuring unflushed, and says so.
    assert gate.status("flush:serving") == "ok", gate.explain()
    assert "has no flush endpoint; measuring without flushing" in gate.proc.stderr
    assert gate.stages["occupancy"] == {
        "stage": "occupancy", "status": "not_applicable", "duration_s": 0.0, "tables": [], "remarks": [],
        "error": "engine transformers exposes no Prometheus metrics the gate can rely on"}
    assert gate.stages["quality"] == {
        "stage": "quality", "status": "not_applicable", "duration_s": 0.0, "tables": [], "remarks": [],
        "error": "engine transformers does not promise the prompt log-probabilities the quality stage scores"}
    assert not any(b.get("table", "").startswith(("occupancy", "quality")) for b in gate.verdict["breaches"])
    assert json.loads((gate.run_dir / "config.json").read_text())["worker"]["engine"] == "transformers"
    assert "Application startup complete" in (gate.run_dir / "worker.log").read_text()  # uvicorn, in transformers serve


def test_no_server_survives_the_gate(gate: GateRun) -> None:
    leftover = marked_processes(gate.tmp, "transformers.cli.transformers", "serve")
    for p in leftover:
        p.kill()
    assert not leftover, f"transformers serve survived the gate: {[p.pid for p in leftover]}"


def test_the_gate_passes_end_to_end(gate: GateRun) -> None:
    assert gate.proc.returncode == 0, gate.explain()
    assert gate.verdict["status"] == "pass", gate.explain()
    assert {name: s["status"] for name, s in gate.stages.items()} == {
        "host": "ok", "launch": "ok", "warmup": "ok", "one_batch": "skipped", "flush:serving": "ok", "serving": "ok",
        "occupancy": "not_applicable", "quality": "not_applicable", "capacity": "skipped", "paired": "skipped",
        "compare": "skipped", "validate": "ok"}  # capacity: off by default; paired: no baseline worker configured
    import pandas as pd

    summary = pd.read_parquet(gate.run_dir / "serving_summary.parquet").iloc[0]
    assert (summary["completed"], summary["failed"]) == (12, 0)
    assert summary["protocol"] == "openai-text"
    assert gate.wall_s < 180, f"the gate took {gate.wall_s:.0f} s; CI's budget for it is ~2 minutes"
