"""The cost per million output tokens (servegate/cost.py) and its config section ([cost])."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from servegate.config import load_config
from servegate.cost import cost_per_mtok, cost_table
from servegate.errors import ConfigError, InsufficientDataError
from servegate.tables import COST_COLUMNS


def test_cost_per_million_output_tokens_from_price_per_hour_and_throughput():
    # 2.5 an hour at 100 tok/s: 360,000 tokens an hour, so 10**6 tokens take 2.78 h = 6.944...
    assert cost_per_mtok(2.5, 100.0) == pytest.approx(2.5 * 1e6 / 360_000, rel=1e-12)
    assert cost_per_mtok(2.5, 100.0) == pytest.approx(6.9444444, rel=1e-6)
    # Twice the throughput halves the cost; twice the price doubles it.
    assert cost_per_mtok(2.5, 200.0) == pytest.approx(cost_per_mtok(2.5, 100.0) / 2)
    assert cost_per_mtok(5.0, 100.0) == pytest.approx(cost_per_mtok(2.5, 100.0) * 2)


@pytest.mark.parametrize("throughput", [0.0, -3.0, math.nan, math.inf])
def test_no_throughput_is_an_error_never_a_cost_of_zero_or_infinity(throughput):
    with pytest.raises(InsufficientDataError, match="no output-token throughput"):
        cost_per_mtok(2.5, throughput)


def test_cost_table_is_one_row_with_its_price_and_throughput_and_none_without_a_price():
    summary = pd.DataFrame([{"output_throughput": 180.0}])
    cfg = load_config(profile="smoke", overrides=["cost.price_per_hour=3.6", "cost.currency=EUR"]).cost
    table = cost_table(summary, cfg)
    assert list(table.columns) == COST_COLUMNS
    assert table.iloc[0].to_dict() == {"price_per_hour": 3.6, "currency": "EUR", "output_throughput": 180.0,
                                       "cost_per_mtok_output": pytest.approx(3.6 * 1e6 / (180.0 * 3600))}
    assert cost_table(summary, load_config(profile="smoke").cost) is None  # unset price: no cost, not 0


@pytest.mark.parametrize("bad,shown,allowed", [
    ("0", "0", "finite number > 0"), ("-2.5", "-2.5", "finite number > 0"), ("nan", "nan", "finite number > 0"),
    ("inf", "inf", "finite number > 0"), ("true", "True", "must be a number"), ("cheap", "'cheap'", "valid number"),
])
def test_price_per_hour_rejects_zero_negative_nan_inf_bool(bad, shown, allowed):
    with pytest.raises(ConfigError) as err:
        load_config(profile="smoke", overrides=[f"cost.price_per_hour={bad}"])
    text = str(err.value)
    assert f"cost.price_per_hour = {shown}" in text and allowed in text, text


@pytest.mark.parametrize("bad", ["usd", "US", "DOLLARS", "1"])
def test_currency_is_an_iso_code(bad):
    with pytest.raises(ConfigError, match="cost.currency"):
        load_config(profile="smoke", overrides=[f"cost.currency={bad}"])


def test_price_defaults_to_unset_and_accepts_a_finite_positive_number():
    assert load_config(profile="smoke").cost.price_per_hour is None
    cfg = load_config(profile="smoke", overrides=["cost.price_per_hour=2.5"]).cost
    assert (cfg.price_per_hour, cfg.currency) == (2.5, "USD")


def test_a_rerun_that_carries_the_serving_stage_refuses_a_new_price():
    """The cost table is the serving stage's: re-priced, it would no longer match the carried load."""
    from servegate.rerun import _check_overrides

    with pytest.raises(ConfigError, match=r"stage serving is carried .* depend on cost\.\*"):
        _check_overrides(["cost.price_per_hour=3.0"], ["serving"])
    _check_overrides(["cost.price_per_hour=3.0"], ["one_batch"])  # re-measured serving prices it anew
