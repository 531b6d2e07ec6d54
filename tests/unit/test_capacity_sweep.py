"""The capacity sweep's decisions against recorded step outcomes (no worker: the rule alone)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from servegate.bench.capacity import Step, check_capacity_config, next_step, sweep_result
from servegate.compare import compare_tables
from servegate.config import CapacityConfig, GateConfig
from servegate.errors import ConfigError
from servegate.gated_metrics import GATED_METRICS
from servegate.tables import CAPACITY_COLUMNS

CFG = CapacityConfig(enabled=True, start_rate=1.0, growth=2.0, refine_steps=2, max_rate=64.0)


def _sweep(capacity: float, cfg: CapacityConfig = CFG) -> list[Step]:
    """The steps the rule takes against a worker whose goodput meets the target up to ``capacity``."""
    steps: list[Step] = []
    while (nxt := next_step(cfg, steps)) is not None:
        phase, rate = nxt
        steps.append(Step(phase, rate, rate <= capacity))
        assert len(steps) < 50
    return steps


def test_grows_by_the_factor_then_bisects_in_log_rate_between_last_good_and_first_bad() -> None:
    steps = _sweep(5.0)
    assert [(s.phase, s.rate) for s in steps[:4]] == [("grow", 1.0), ("grow", 2.0), ("grow", 4.0), ("grow", 8.0)]
    # refine: sqrt(4*8) = 5.66 fails, then sqrt(4*5.66) = 4.76 meets it
    assert [s.phase for s in steps[4:]] == ["refine", "refine"]
    assert steps[4].rate == pytest.approx(math.sqrt(32)) and not steps[4].meets_target
    assert steps[5].rate == pytest.approx(math.sqrt(4 * math.sqrt(32))) and steps[5].meets_target
    result = sweep_result(CFG, steps)
    assert result == {"capacity_rps": pytest.approx(steps[5].rate), "capacity_bound": "found",
                      "last_good_rate": pytest.approx(steps[5].rate), "first_bad_rate": pytest.approx(math.sqrt(32)),
                      "steps": 6}


def test_no_refinement_when_refine_steps_is_zero() -> None:
    cfg = CFG.model_copy(update={"refine_steps": 0})
    steps = _sweep(5.0, cfg)
    assert [s.rate for s in steps] == [1.0, 2.0, 4.0, 8.0]
    assert sweep_result(cfg, steps)["capacity_rps"] == 4.0


def test_the_last_grow_step_is_max_rate_and_a_capacity_above_it_is_at_least_max() -> None:
    cfg = CFG.model_copy(update={"max_rate": 10.0})
    steps = _sweep(1000.0, cfg)
    assert [s.rate for s in steps] == [1.0, 2.0, 4.0, 8.0, 10.0]
    result = sweep_result(cfg, steps)
    assert result["capacity_bound"] == "at_least_max" and result["capacity_rps"] == 10.0
    assert math.isnan(result["first_bad_rate"])


def test_a_first_rate_that_fails_ends_the_sweep_with_capacity_zero() -> None:
    steps = _sweep(0.5)
    assert [(s.phase, s.rate, s.meets_target) for s in steps] == [("grow", 1.0, False)]
    result = sweep_result(CFG, steps)
    assert result["capacity_rps"] == 0.0 and result["capacity_bound"] == "below_start"
    assert math.isnan(result["last_good_rate"]) and result["first_bad_rate"] == 1.0


def test_a_slower_worker_gets_a_lower_capacity_from_the_same_rule() -> None:
    fast, slow = (sweep_result(CFG, _sweep(c))["capacity_rps"] for c in (9.0, 3.0))
    assert slow < fast


def test_refine_follows_non_monotone_outcomes_and_reports_the_highest_good_rate() -> None:
    # A noisy step: 2 req/s failed although 4 later met the target is not possible (grow stops at
    # the first failure); within refine a failure lowers the upper end and a success raises the lower.
    steps = [Step("grow", 1.0, True), Step("grow", 2.0, True), Step("grow", 4.0, False)]
    assert next_step(CFG, steps) == ("refine", pytest.approx(math.sqrt(8)))
    steps.append(Step("refine", math.sqrt(8), True))
    phase, rate = next_step(CFG, steps)
    assert phase == "refine" and math.sqrt(8) < rate < 4.0
    steps.append(Step("refine", rate, False))
    assert next_step(CFG, steps) is None
    assert sweep_result(CFG, steps)["capacity_rps"] == pytest.approx(math.sqrt(8))


def _gate(**serving) -> GateConfig:
    return GateConfig.model_validate({"capacity": {"enabled": True}, "serving": serving})


def test_config_without_an_slo_or_with_a_rate_free_load_is_refused() -> None:
    with pytest.raises(ConfigError, match="serving.slo_ttft_ms"):
        check_capacity_config(_gate())
    with pytest.raises(ConfigError, match="all-at-once"):
        check_capacity_config(_gate(slo_ttft_ms=1000, arrival="all-at-once"))
    check_capacity_config(_gate(slo_e2e_ms=1000))  # one SLO is enough
    check_capacity_config(GateConfig())  # off: nothing to check


def _capacity_table(rps: float, lo: float, hi: float) -> dict[str, pd.DataFrame]:
    row = {c: math.nan for c in CAPACITY_COLUMNS}
    row.update(capacity_rps=rps, capacity_bound="found", last_good_rate=lo, first_bad_rate=hi)
    return {"capacity": pd.DataFrame([row], columns=CAPACITY_COLUMNS)}


CAPACITY_METRIC = [m for m in GATED_METRICS if m.table == "capacity"]


def _decision(current: float, baseline: list[float], step: float = 2 ** 0.25) -> pd.Series:
    runs = [(f"r{i}", _capacity_table(b, b, b * step)) for i, b in enumerate(baseline)]
    df = compare_tables(_capacity_table(current, current, current * step), runs, metrics=CAPACITY_METRIC)
    assert len(df) == 1
    return df.iloc[0]


def test_capacity_is_compared_over_baseline_runs_higher_is_better() -> None:
    assert CAPACITY_METRIC and CAPACITY_METRIC[0].direction == "higher_is_better"
    same = _decision(8.0, [8.0, 8.0, 8.0])
    assert same["decision"] == "no_change" and same["gated"] and same["n_baseline_runs"] == 3
    assert same["bound"] == pytest.approx(1 - 2 ** -0.375)  # 1.5 sweep steps, not the 5 % default
    # Two sweep steps down (2**-0.5 = 0.71): a regression; one step (0.84): within the sweep's resolution.
    assert _decision(8.0 * 2 ** -0.5, [8.0, 8.0, 8.0])["decision"] == "regression"
    assert _decision(8.0 * 2 ** -0.25, [8.0, 8.0, 8.0])["decision"] == "no_change"
    # Baseline runs that spread widen the interval: the same two-step drop is no longer decided.
    assert _decision(8.0 * 2 ** -0.5, [5.0, 8.0, 12.0])["decision"] == "inconclusive"
    assert _decision(16.0, [8.0, 8.0, 8.0])["decision"] == "improvement"


def test_capacity_needs_two_baseline_runs() -> None:
    row = _decision(8.0, [8.0])
    assert row["decision"] == "insufficient_data" and "baseline run" in row["reason"]
    assert np.isfinite(row["current_value"]) and row["n_current"] == 1
