"""The paired stage's profile when the engines have no profiler: not applicable, said per side and in
the remarks, no operator table; and how the report shows it."""

from __future__ import annotations

from pathlib import Path

from servegate.config import load_config
from servegate.paired.rounds import PairedMeasurement
from servegate.report import _profile_section
from servegate.tables import PAIRED_PROFILE_COLUMNS


def test_engines_without_a_profiler_make_the_profile_not_applicable(tmp_path: Path):
    config = load_config(profile="transformers-cpu", overrides=["baseline.engine=transformers",
                                                               "baseline.model=smollm2-135m"])
    tables: dict = {}
    m = PairedMeasurement(config, tmp_path, register=lambda handle: None, tables=tables)
    assert config.paired.profile and not m.profilable()
    m.profile()  # what run() does after a confirmed regression; launches nothing here
    rows = tables["paired_profiles"]
    assert list(rows.columns) == PAIRED_PROFILE_COLUMNS and list(rows["side"]) == ["baseline", "candidate"]
    assert set(rows["status"]) == {"not_applicable"} and "profile_ops" not in tables
    assert all(r == "engine transformers has no profiler endpoints servegate can drive" for r in rows["reason"])
    assert m.remarks == [f"profile not applicable ({side}): engine transformers has no profiler endpoints servegate "
                         f"can drive" for side in ("baseline", "candidate")]
    shown = "\n".join(_profile_section(tables))
    assert "Operators whose time changed most" in shown and "no trace, not applicable" in shown
    assert "No operator comparison" in shown
