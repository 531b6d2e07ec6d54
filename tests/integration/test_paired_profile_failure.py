"""A profile that cannot be recorded, against real embedded workers (tiny-random): workers launched
without their profiler answer /start_profile with 404; the paired stage records that per side and as
a remark, and raises nothing (a profile never decides anything)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servegate.config import load_config
from servegate.paired.rounds import PairedMeasurement

pytestmark = [pytest.mark.gate, pytest.mark.timeout(300)]


def test_a_profiler_route_that_refuses_is_a_failed_row_and_a_remark_not_an_error(tmp_path: Path):
    config = load_config(profile="smoke-ab", overrides=["worker.model=tiny-random", "baseline.model=tiny-random",
                                                        "warmup.num_requests=1", "paired.output_len=8",
                                                        "paired.input_len=8"])
    launched: list = []
    tables: dict = {}
    m = PairedMeasurement(config, tmp_path, register=launched.append, tables=tables)
    try:
        m.start_instances()  # profiling off: no --profiler-dir
        m.profiling = True  # as if the engine's profiler had been asked for: its routes answer 404
        m.profile()
    finally:
        m._stop_all()
    rows = tables["paired_profiles"].set_index("side")
    assert list(rows["status"]) == ["failed", "failed"] and "profile_ops" not in tables
    for side in ("baseline", "candidate"):
        assert "/start_profile answered 404" in rows.loc[side, "reason"], rows.loc[side, "reason"]
        assert "profiler enabled" in rows.loc[side, "reason"]
    assert len(m.remarks) == 2 and m.remarks[0].startswith("profile failed (baseline): no profile of the baseline")
    assert not list(tmp_path.rglob("*.trace.json*"))
    assert all(not handle.is_alive() for handle in launched)
