"""find_change_points on series with a known step, a known creep, and none (seeded noise).

Each property is checked on one series and, where noise decides, over 100 seeded series with the
rate measured (docs/dashboard.md quotes these figures)."""

from __future__ import annotations

import numpy as np
import pytest

from servegate.dashboard.changepoints import ChangePoint, find_change_points, noise_sigma
from servegate.errors import ConfigError

N = 30


def noisy(seed: int, sd: float = 0.02, level: float = 100.0) -> np.ndarray:
    return level * (1 + np.random.default_rng(seed).normal(0, sd, N))


def with_step(seed: int, at: int = 15, size: float = 0.12) -> np.ndarray:
    return noisy(seed) * np.where(np.arange(N) >= at, 1 + size, 1.0)


def with_creep(seed: int, began: int = 20, rate: float = 0.02) -> np.ndarray:
    i = np.arange(N)
    return noisy(seed) * np.where(i >= began, (1 + rate) ** (i - began + 1), 1.0)


def test_step_at_15_is_found_at_15_as_a_step() -> None:
    found = find_change_points(with_step(seed=7))
    assert len(found) == 1
    cp = found[0]
    assert abs(cp.index - 15) <= 1 and cp.kind == "step"
    assert 0.07 < cp.change < 0.17  # +12 % injected


def test_creep_beginning_at_20_is_found_where_it_began() -> None:
    found = find_change_points(with_creep(seed=1))
    assert found, "a 2 %/run creep over 10 runs was not marked"
    cp = found[-1]
    assert abs(cp.index - 20) <= 2 and cp.kind == "trend"
    assert cp.change > 0.1  # 1.02**10 - 1 = 22 % by the latest run


def test_pure_noise_with_2_percent_sd_has_no_change_point() -> None:
    assert find_change_points(noisy(seed=3)) == []


def test_rates_over_seeded_series() -> None:
    step = sum(len(c := find_change_points(with_step(2000 + s))) == 1 and abs(c[0].index - 15) <= 1
               for s in range(100))
    creep = sum(bool(c := find_change_points(with_creep(s))) and abs(c[-1].index - 20) <= 2 for s in range(100))
    false_alarms = sum(bool(find_change_points(noisy(1000 + s))) for s in range(100))
    # measured: step 93, creep 95, false alarms 5 (of 100)
    assert step >= 88 and creep >= 90 and false_alarms <= 8, (step, creep, false_alarms)


def test_falling_creep_in_a_higher_is_better_metric_and_a_second_change() -> None:
    i = np.arange(40)
    values = noisy(11, sd=0.01)[np.arange(40) % N] * np.where(i >= 12, 1.15, 1.0) \
        * np.where(i >= 28, 0.98 ** (i - 27), 1.0)
    found = find_change_points(values)
    assert [cp.kind for cp in found] == ["step", "trend"]
    assert abs(found[0].index - 12) <= 1 and abs(found[1].index - 28) <= 2
    assert found[0].change > 0 and found[1].change < 0


def test_short_constant_and_quantised_series() -> None:
    assert find_change_points(noisy(0)[:9]) == []  # under MIN_POINTS runs: not searched
    assert find_change_points(np.full(N, 4.0)) == []  # no noise at all: nothing changed
    rates = np.where(np.random.default_rng(5).random(N) < 0.8, 4.0, 4.76)  # a capacity sweep's steps
    assert find_change_points(rates) == []
    assert noise_sigma(np.log(rates)) > 0


def test_non_positive_values_are_searched_on_their_own_scale() -> None:
    values = np.random.default_rng(4).normal(0, 1, N) + np.where(np.arange(N) >= 15, 8.0, 0.0)
    found = find_change_points(values)
    assert len(found) == 1 and abs(found[0].index - 15) <= 1


@pytest.mark.parametrize("bad, message", [
    ([1.0, float("nan")] * 10, "finite values"),
    (np.ones((10, 2)), "1-D"),
])
def test_bad_series_is_refused_with_what_to_do(bad: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        find_change_points(bad)  # type: ignore[arg-type]


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ConfigError, match="min_size"):
        find_change_points(noisy(0), min_size=2)
    with pytest.raises(ConfigError, match="penalty_factor"):
        find_change_points(noisy(0), penalty_factor=0)
    assert ChangePoint(3, "step", 0.0, 1.0).change != ChangePoint(3, "step", 0.0, 1.0).change  # NaN, not an error


# Issue 42: each change point carries a test between its segments, and one that does not hold is not drawn.
NIGHTS = 60


def nightly(seed: int, sd: float = 0.01) -> np.ndarray:
    return 100.0 * (1 + np.random.default_rng(seed).normal(0, sd, NIGHTS))


def test_an_8_percent_step_is_a_change_point_with_its_interval_and_p_below_001() -> None:
    series = nightly(11) * np.where(np.arange(NIGHTS) >= 30, 1.08, 1.0)
    (cp,) = find_change_points(series)
    assert abs(cp.index - 30) <= 1 and cp.kind == "step" and cp.p_value < 0.01
    assert cp.ratio_low < 1.08 < cp.ratio_high and cp.ratio_low > 1.05  # the step's size, within its interval


def test_a_half_percent_a_night_creep_is_a_change_point_with_p_below_001() -> None:
    i = np.arange(NIGHTS)
    found = find_change_points(nightly(12) * np.where(i >= 30, 1.005 ** (i - 29), 1.0))
    assert found and found[-1].p_value < 0.01 and found[-1].ratio > 1.03
    assert abs(found[-1].index - 30) <= 5


def test_sixty_flat_noisy_nights_show_none_and_a_change_that_does_not_test_is_dropped() -> None:
    assert find_change_points(nightly(13)) == []
    # What PELT proposes at its most permissive is kept only where the segments' test holds.
    series = nightly(14)
    proposed = find_change_points(series, penalty_factor=0.05, alpha=0.999999)
    kept = find_change_points(series, penalty_factor=0.05)
    assert proposed and len(kept) < len(proposed) and all(cp.p_value < 0.01 for cp in kept)


def test_rates_over_sixty_night_histories() -> None:
    i = np.arange(NIGHTS)
    step = sum(any(abs(c.index - 30) <= 1 and c.p_value < 0.01 for c in
                   find_change_points(nightly(2000 + s) * np.where(i >= 30, 1.08, 1.0))) for s in range(100))
    creep = sum(any(c.p_value < 0.01 and c.ratio > 1 for c in
                    find_change_points(nightly(3000 + s) * np.where(i >= 30, 1.005 ** (i - 29), 1.0)))
                for s in range(100))
    false_alarms = sum(bool(find_change_points(nightly(4000 + s))) for s in range(100))
    # measured: step 100, creep 100, false alarms 0 (of 100; 1 % night-to-night noise)
    assert step >= 97 and creep >= 97 and false_alarms <= 2, (step, creep, false_alarms)
