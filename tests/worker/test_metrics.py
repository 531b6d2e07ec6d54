"""The decode windows behind the worker's gauges (servegate.worker.metrics), in process."""

from __future__ import annotations

import math

from servegate.worker.metrics import OccupancyWindow, ThroughputWindow


def test_throughput_is_tokens_over_the_window_wall_time() -> None:
    window = ThroughputWindow(3)
    assert window.value == 0.0
    assert not window.record_decode(10.0, 4, 10.5)
    assert not window.record_decode(10.5, 4, 11.0)
    assert window.record_decode(11.0, 4, 12.0)
    assert window.value == 12 / 2.0
    # The next window starts where the last one ended, not at the next step's start.
    window.record_decode(13.0, 2, 13.5)
    window.record_decode(13.5, 2, 14.0)
    assert window.record_decode(14.0, 2, 14.0)
    assert window.value == 6 / 2.0


def test_a_restart_begins_a_new_window_and_keeps_the_last_rate() -> None:
    window = ThroughputWindow(2)
    window.record_decode(0.0, 1, 1.0)
    window.record_decode(1.0, 1, 2.0)
    window.record_decode(2.0, 5, 3.0)  # half a window, then a prefill
    window.restart()
    assert window.value == 1.0
    window.record_decode(10.0, 3, 11.0)
    assert window.record_decode(11.0, 3, 12.0)
    assert window.value == 3.0  # the 5 tokens before the restart are not counted


def test_occupancy_reads_nan_until_a_window_completes() -> None:
    window = OccupancyWindow(2)
    assert not window.record_decode(0.0, 0.5, 1.0)
    assert math.isnan(window.value)
    assert window.record_decode(1.0, 0.5, 2.0)
    assert window.value == 50.0
    window.restart()
    assert math.isnan(window.value)
