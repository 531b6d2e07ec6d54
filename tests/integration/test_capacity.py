"""The capacity sweep on the embedded worker (a real process), and the capacity stage in real flow runs.

The tiny random-weight model with a fixed per-step cost (``--fault-decode-delay-ms 10``) and two
running requests keeps the sweep's rates low (up to ~32 req/s, 16 prompts a load) so that a busy
2-core client keeps its schedule; the slowed worker's steps cost four times as much (40 ms).
Measured here: capacity 16 req/s against 2 req/s (07:40 UTC, 2026-12-01), ~20 s per sweep.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from servegate.bench.capacity import CapacityResult, run_capacity
from servegate.bench.warmup import run_warmup
from servegate.config import GateConfig
from servegate.engines import get_engine
from servegate.errors import ConfigError
from servegate.launch import launch_worker
from servegate.tables import CAPACITY_COLUMNS, CAPACITY_STEP_COLUMNS

pytestmark = [pytest.mark.gate, pytest.mark.timeout(600)]

TARGET = 0.9


def _config(decode_delay_ms: float) -> GateConfig:
    return GateConfig.model_validate({
        "worker": {"model": "tiny-random",
                   "extra_args": ["--fault-decode-delay-ms", str(decode_delay_ms), "--max-running-requests", "2"]},
        "warmup": {"max_new_tokens": 4},
        "serving": {"random_input_len": 32, "random_output_len": 16, "random_range_ratio": 0.5,
                    "arrival": "poisson", "slo_ttft_ms": 500, "progress": False},
        "capacity": {"enabled": True, "start_rate": 1.5, "growth": 2.0, "refine_steps": 1, "max_rate": 64.0,
                     "num_prompts": 16, "goodput_target": TARGET, "request_timeout_s": 60},
    })


def _sweep(config: GateConfig, log: Path) -> CapacityResult:
    engine = get_engine("embedded")
    with launch_worker(config.worker, log) as worker:
        run_warmup(worker.base_url, engine, config.warmup)
        return run_capacity(worker.base_url, engine, config)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict[str, CapacityResult]:
    folder = tmp_path_factory.mktemp("capacity")
    return {name: _sweep(_config(delay), folder / f"{name}.log") for name, delay in (("normal", 10), ("slowed", 40))}


def _decided(steps: pd.DataFrame) -> pd.DataFrame:
    # A load whose client was not valid was run again at the same rate; its row stays, the rerun decides.
    return steps[steps["client_valid"].astype(bool)]


@pytest.mark.parametrize("name", ["normal", "slowed"])
@pytest.mark.exclusive
def test_the_sweep_finds_a_capacity_and_its_steps_are_consistent(sweeps, name: str) -> None:
    steps, capacity = sweeps[name].steps, sweeps[name].capacity
    assert list(steps.columns) == CAPACITY_STEP_COLUMNS and list(capacity.columns) == CAPACITY_COLUMNS
    assert len(capacity) == 1
    result = capacity.iloc[0]
    decided = _decided(steps)
    assert len(decided) == result["steps"] >= 2
    # Each load's goodput fraction is its good requests over those sent, judged against the target.
    assert (decided["num_prompts"] == 16).all()
    assert (decided["goodput_fraction"] == decided["good_completed"] / decided["num_prompts"]).all()
    assert (decided["meets_target"] == (decided["goodput_fraction"] >= TARGET)).all()
    # Grow: start_rate times growth**i, rising, all good but the last; then refine between them.
    grow, refine = decided[decided["phase"] == "grow"], decided[decided["phase"] == "refine"]
    assert list(grow["request_rate"]) == [1.5 * 2.0 ** i for i in range(len(grow))]
    assert grow["meets_target"].iloc[:-1].all() and not grow["meets_target"].iloc[-1], steps.to_string()
    last_good, first_bad = grow["request_rate"].iloc[-2], grow["request_rate"].iloc[-1]
    assert len(refine) == 1
    assert last_good < refine["request_rate"].iloc[0] < first_bad
    # The capacity is the highest rate that met the target; the first bad rate the lowest that did not.
    good = decided.loc[decided["meets_target"], "request_rate"]
    assert result["capacity_rps"] == good.max() > 0 and result["capacity_bound"] == "found"
    assert result["last_good_rate"] == good.max()
    assert result["first_bad_rate"] == decided.loc[~decided["meets_target"], "request_rate"].min()
    assert result["slo_ttft_ms"] == 500 and math.isnan(result["slo_tpot_ms"]) and result["goodput_target"] == TARGET
    assert sweeps[name].remarks == []  # 16 prompts a load against 2 running requests: loads queue


@pytest.mark.exclusive
def test_a_decode_slowdown_lowers_the_capacity(sweeps) -> None:
    normal = sweeps["normal"].capacity.iloc[0]["capacity_rps"]
    slowed = sweeps["slowed"].capacity.iloc[0]["capacity_rps"]
    # Four times the per-step cost: 16 against 2 req/s measured; a strict drop is all that is asserted.
    assert slowed < normal, (sweeps["normal"].steps.to_string(), sweeps["slowed"].steps.to_string())


GATE = ["worker.model=tiny-random",
        'worker.extra_args=["--fault-decode-delay-ms", "10", "--max-running-requests", "4"]', "warmup.max_new_tokens=4",
        "capacity.start_rate=4", "capacity.max_rate=16", "capacity.num_prompts=4", "report.html=false"]


def test_capacity_gate_passes_records_its_tables_and_reruns(prefect_server, tmp_path: Path, monkeypatch) -> None:
    from servegate.flows.gate import regression_gate
    from servegate.flows.rerun import rerun_stages

    monkeypatch.setenv("SERVEGATE_DB", str(tmp_path / "history.db"))
    result = regression_gate(profile="smoke-capacity", overrides=[*GATE, f"output_dir={tmp_path}"])
    assert result["verdict"]["status"] == "pass", json.dumps(result["verdict"], indent=1)
    run_dir = Path(result["run_dir"])
    stages = json.loads((run_dir / "stages.json").read_text())
    assert stages["flush:capacity"]["status"] == "ok" and stages["capacity"]["status"] == "ok"
    assert sorted(stages["capacity"]["tables"]) == ["capacity", "capacity_steps"]
    # 4 prompts a load and 4 running requests: every load is one burst, and the run says so.
    assert any("fits in one batch" in r for r in stages["capacity"]["remarks"]), stages["capacity"]
    for stage in ("one_batch", "serving", "occupancy", "quality"):
        assert stages[stage]["status"] == "skipped", stages[stage]
    table = pd.read_parquet(run_dir / "capacity.parquet")
    assert table.iloc[0]["capacity_rps"] > 0
    outcomes = json.loads((run_dir / "expectations.json").read_text())
    assert any(o["table"] == "capacity" and o["column"] == "capacity_rps" and o["success"] for o in outcomes)

    # Re-run the capacity stage alone: a new attempt with its own sweep.
    again = rerun_stages(str(run_dir), ["capacity"], ["capacity.refine_steps=0", "capacity.num_prompts=8"])
    assert again["verdict"]["status"] == "pass" and again["stages"] == ["capacity"]
    attempt = Path(again["run_dir"])
    assert attempt.parent == run_dir / "attempts"
    steps = pd.read_parquet(attempt / "capacity_steps.parquet")
    # The overrides took effect: re-measured, not carried.
    assert (steps["phase"] == "grow").all() and (steps["num_prompts"] == 8).all()
    assert json.loads((attempt / "stages.json").read_text())["capacity"]["remarks"] == []
    # A serving override would change what the capacity tables answer: refused when capacity is carried.
    with pytest.raises(ConfigError, match="capacity"):
        rerun_stages(str(run_dir), ["serving"], ["serving.enabled=true", "serving.slo_ttft_ms=100"])


def test_capacity_without_an_slo_is_refused_before_a_worker_starts(prefect_server, tmp_path: Path) -> None:
    from servegate.flows.gate import regression_gate

    with pytest.raises(ConfigError, match="capacity.enabled needs an SLO"):
        regression_gate(profile="smoke-capacity", overrides=[
            *GATE, f"output_dir={tmp_path}", "serving.slo_ttft_ms=null", "serving.slo_tpot_ms=null"])
    assert not any(tmp_path.iterdir())  # no run folder: nothing was launched
