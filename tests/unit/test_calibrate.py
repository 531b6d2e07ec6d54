"""Calibration: run schedule, per-run config, and the false-alarm / power figures from run tables."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from scipy.stats import beta

from servegate.calibrate import (SLOWDOWN_FLAG, Arm, CalibrationPlan, CalibrationRun, analyse, format_calibration,
                                 measurement_seconds, previous_runs, remaining_schedule, run_config, schedule,
                                 summarise, write_setup)
from servegate.compare import calibration_figures, calibration_summary, compare_run, compare_tables
from servegate.config import load_config
from servegate.errors import ConfigError, InfraError, InsufficientDataError
from servegate.history import GateKey, Store
from servegate.render import calibration_text


def _tables(seed: int, slowdown: float = 0.0, night: float = 1.0) -> dict[str, pd.DataFrame]:
    """One run's compared tables: 64 requests of 24 tokens, a per-request level, a night effect."""
    rng = np.random.default_rng(seed)
    factor = (1 + slowdown) * night
    level = rng.lognormal(0, 0.1, 64)
    itls = [list(40.0 * factor * lvl * rng.lognormal(0, 0.05, 24)) for lvl in level]
    ttft = rng.lognormal(np.log(150.0), 0.2, 64) * night
    serving = pd.DataFrame({"ttft_ms": ttft, "itls_ms": itls, "tpot_ms": [np.mean(x) for x in itls],
                            "e2e_latency_ms": ttft + [sum(x) for x in itls], "success": True})
    one_batch = pd.DataFrame([{"batch_size": 1, "input_len": 64, "output_len": 16, "status": "measured",
                               "latency": 0.4 * factor, "output_throughput": 40 / factor}])
    occupancy = pd.DataFrame({"fwd_occupancy": rng.normal(95.0, 1.0, 30)})
    return {"serving_requests": serving, "one_batch": one_batch, "occupancy_samples": occupancy}


def _runs(plan: CalibrationPlan, night_sd: float = 0.01) -> list[CalibrationRun]:
    rng = np.random.default_rng(42)
    runs = []
    for i, arm in enumerate(schedule(plan)):
        pct = arm.slowdown_pct
        night = float(np.exp(rng.normal(0, night_sd)))
        runs.append(CalibrationRun(i, pct, run_dir=f"/runs/{i}", status="pass", measurement_s=30.0 + i,
                                   tables=_tables(100 + i, pct / 100, night)))
    return runs


def _pcts(arms: list[Arm]) -> list[float]:
    assert not any(a.regression for a in arms)
    return [a.slowdown_pct for a in arms]


def test_schedule_starts_with_two_a_runs_then_interleaves() -> None:
    plan = CalibrationPlan(aa_runs=4, slowdowns_pct=(5, 30), runs_per_slowdown=3)
    assert _pcts(schedule(plan)) == [0, 0, 0, 5, 30, 0, 5, 30, 5, 30]
    assert _pcts(schedule(CalibrationPlan(aa_runs=3, slowdowns_pct=()))) == [0, 0, 0]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"aa_runs": 1}, "at least 2 A/A runs"),
    ({"slowdowns_pct": (0.0,)}, "percentages > 0"),
    ({"bounds": (1.5,)}, "fractions in"),
    ({"runs_per_slowdown": 0}, "runs-per-slowdown"),
    ({"baseline_n": 0}, "baseline-n"),
])
def test_plan_refuses_what_cannot_be_measured(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CalibrationPlan(**kwargs)


def test_run_config_measures_only_and_injects_the_slowdown(tmp_path: Path) -> None:
    config = load_config(profile="smoke")
    a = run_config(config, Arm(0), tmp_path)
    b = run_config(config, Arm(10), tmp_path)
    assert a.worker.extra_args == [] and b.worker.extra_args == [SLOWDOWN_FLAG, "10"]
    for cfg in (a, b):
        assert not cfg.compare.enabled and not cfg.store.enabled and not cfg.quality.enabled
        assert not cfg.report.html and cfg.output_dir == str(tmp_path) and cfg.name == config.name
    with pytest.raises(ConfigError, match="embedded worker's decode fault"):
        run_config(load_config(profile="sglang-h100"), Arm(10), tmp_path)
    assert run_config(load_config(profile="sglang-h100"), Arm(0), tmp_path).worker.engine == "sglang"
    faulty = load_config(profile="smoke", overrides=[f'worker.extra_args=["{SLOWDOWN_FLAG}", "5"]'])
    with pytest.raises(ConfigError, match="unchanged worker"):
        run_config(faulty, Arm(0), tmp_path)


def test_measurement_seconds_counts_only_measurement_stages_that_ran() -> None:
    stages = {"launch": {"status": "ok", "duration_s": 20}, "one_batch": {"status": "ok", "duration_s": 5},
              "serving": {"status": "ok", "duration_s": 10.5}, "occupancy": {"status": "failed", "duration_s": 3},
              "quality": {"status": "ok", "duration_s": 40}}
    assert measurement_seconds(stages) == 15.5


def test_aa_runs_do_not_alarm_and_a_clear_slowdown_is_detected() -> None:
    plan = CalibrationPlan(aa_runs=6, slowdowns_pct=(2.0, 40.0), runs_per_slowdown=2, bounds=(0.02, 0.05),
                           baseline_n=5, n_boot=500)
    runs = _runs(plan)
    figures, comparisons, noise = analyse(runs, plan)
    assert set(comparisons["run"]) == set(range(1, len(runs)))  # every run after the first A run
    itl = figures[(figures["metric"] == "serving.itl_ms.median") & (figures["bound"] == 0.05)].iloc[0]
    assert itl["aa_comparisons"] == 5 and itl["false_alarms"] == 0 and itl["false_alarm_rate"] == 0
    assert 0 < itl["false_alarm_upper95"] < 0.5  # 0/5: an honest, wide bound
    assert itl["detected_40pct"] == 1.0 and itl["detected_2pct"] < 0.95
    assert itl["min_detected_injected"] == pytest.approx(0.40) and 1.3 < itl["ratio_40pct"] < 1.5
    assert 0.05 < itl["min_detectable"] < 0.40  # at least the bound, well under the clear slowdown
    # A smaller minimum effect makes smaller changes detectable.
    itl_2 = figures[(figures["metric"] == "serving.itl_ms.median") & (figures["bound"] == 0.02)].iloc[0]
    assert itl_2["min_detectable"] < itl["min_detectable"]
    # Tails are calibrated once, at the tail bound; the prefill metric is not slowed by a decode fault.
    assert set(figures.loc[figures["statistic"] == "p99", "bound"]) == {0.10}
    ttft = figures[(figures["metric"] == "serving.ttft_ms.median") & (figures["bound"] == 0.05)].iloc[0]
    assert ttft["detected_40pct"] == 0 and math.isnan(ttft["min_detected_injected"])
    assert set(noise) >= {"serving.itl_ms.median", "serving.ttft_ms.median", "one_batch.latency.median"}
    summary = summarise(runs, figures, comparisons, plan)
    assert summary["aa_runs"] == 6 and summary["ab_runs"] == 4
    assert summary["gate_false_alarms"]["0.05"]["comparisons"] == 5
    assert summary["measurement_s_per_decision"] == pytest.approx(6 * np.median([r.measurement_s for r in runs
                                                                                 if r.slowdown_pct == 0]))
    text = format_calibration(figures, summary)
    assert "serving.itl_ms.median" in text and "detected +40%" in text and "gate-level false alarms" in text


def test_noisy_nights_raise_run_sd_and_the_detectable_change() -> None:
    plan = CalibrationPlan(aa_runs=6, slowdowns_pct=(), bounds=(0.05,), n_boot=500)
    quiet, _, _ = analyse(_runs(plan, night_sd=0.005), plan)
    noisy, _, _ = analyse(_runs(plan, night_sd=0.08), plan)

    def row(df: pd.DataFrame) -> pd.Series:
        return df[df["metric"] == "serving.tpot_ms.median"].iloc[0]

    assert row(noisy)["run_sd"] > 3 * row(quiet)["run_sd"]
    assert row(noisy)["min_detectable"] > row(quiet)["min_detectable"]


def test_analysis_needs_two_a_runs_with_tables() -> None:
    plan = CalibrationPlan(aa_runs=2, slowdowns_pct=(30.0,), runs_per_slowdown=1)
    runs = _runs(plan)
    runs[1].tables = {}  # its gate run broke: left out
    with pytest.raises(InfraError, match="1 A/A run"):
        analyse(runs, plan)


def test_stored_calibration_floors_run_noise_and_annotates_the_comparison(tmp_path: Path) -> None:
    plan = CalibrationPlan(aa_runs=4, slowdowns_pct=(), bounds=(0.02, 0.05), n_boot=300)
    runs = _runs(plan, night_sd=0.05)
    figures, comparisons, _ = analyse(runs, plan)
    summary = summarise(runs, figures, comparisons, plan)
    key = GateKey("smoke", "embedded", "cpu-2core", "smollm2-135m")
    current, baseline = _tables(7), _tables(8)
    with Store(str(tmp_path / "h.db")) as store:
        before = compare_run(store, current, key, calibration={}, n_boot=300)
        assert before["min_detectable"].isna().all() and before.attrs["calibration"] is None
        store.record_calibration(key, plan=plan.as_dict(), summary=summary,
                                 metrics=figures.replace({np.nan: None}).to_dict("records"))
        stored = store.latest_calibration(key)
    noise, best = calibration_figures(stored, 0.05)
    tpot = best[("serving.tpot_ms.median", "")]
    assert tpot["bound"] == 0.05 and noise["serving.tpot_ms.median"] > 0
    # The comparison of a later run: noise floored, rows carry the calibrated figures.
    with Store(str(tmp_path / "h.db")) as store:
        df = compare_tables(current, [("b", baseline)], run_noise=noise, n_boot=300)
        row_of = df.set_index("metric").loc["serving.tpot_ms.median"]
        assert row_of["run_sd"] == pytest.approx(noise["serving.tpot_ms.median"])
        annotated = compare_run(store, current, key, n_boot=300)  # no history: insufficient data, still annotated
        assert (annotated["decision"][annotated["gated"]] == "insufficient_data").all()
        tpot_row = annotated.set_index("metric").loc["serving.tpot_ms.median"]
        assert tpot_row["min_detectable"] == pytest.approx(tpot["min_detectable"])
    carried = calibration_summary(stored, 0.05)
    assert carried["aa_runs"] == 4 and carried["bound"] == 0.05
    assert {m["metric"] for m in carried["metrics"]} >= {"serving.itl_ms.median", "serving.tpot_ms.median"}
    text = calibration_text(carried)
    assert "4 A/A" in text and "false alarms 0/3" in text and "serving.tpot_ms.median" in text


# ---- paired mode --------------------------------------------------------------------------------
def _paired_table(itl: tuple[float, float, float], decision: str, rounds: int, measure_s: float,
                  bound: float = 0.015) -> pd.DataFrame:
    """A paired stage's table: ITL gated (ratio, interval, decision), TTFT reported only."""
    from servegate.paired.stats import METHOD
    from servegate.tables import PAIRED_COLUMNS

    common = {"rounds": rounds, "measure_s": measure_s, "bound": bound, "confidence": 0.95,
              "stopped_because": f"every gated metric decided after {rounds} rounds", "instances": 2,
              "mode": "interleaved", "order": "abba", "rounds_per_worker": 4,
              "method": METHOD}
    ratio, lo, hi = itl
    rows = [{**common, "metric": "itl_median_ms", "column": "median_itl_ms", "unit": "ms",
             "direction": "lower_is_better", "gated": True, "ratio": ratio, "ci_low": lo, "ci_high": hi,
             "decision": decision, "paired_decision": decision},
            {**common, "metric": "ttft_median_ms", "column": "median_ttft_ms", "unit": "ms",
             "direction": "lower_is_better", "gated": False, "ratio": 1.0, "ci_low": 0.9, "ci_high": 1.1,
             "decision": "report_only", "paired_decision": "inconclusive"}]
    return pd.DataFrame(rows, columns=PAIRED_COLUMNS)


def _paired_runs() -> list[CalibrationRun]:
    plan = CalibrationPlan(aa_runs=3, slowdowns_pct=(3.0, 30.0), runs_per_slowdown=2, mode="paired")
    outcome = {0.0: [((1.002, 0.99, 1.012), "no_change", 8), ((1.01, 0.995, 1.03), "inconclusive", 40),
                     ((1.03, 1.016, 1.045), "regression", 12)],
               3.0: [((1.025, 1.017, 1.035), "regression", 14), ((1.02, 1.005, 1.035), "inconclusive", 40)],
               30.0: [((1.28, 1.2, 1.35), "regression", 6), ((1.3, 1.22, 1.38), "regression", 6)]}
    runs = []
    for i, arm in enumerate(schedule(plan)):
        pct = arm.slowdown_pct
        itl, decision, rounds = outcome[pct].pop(0)
        runs.append(CalibrationRun(i, pct, run_dir=f"/runs/{i}", status="pass", measurement_s=100.0 + i,
                                   tables={"paired": _paired_table(itl, decision, rounds, 9.0 * rounds)}))
    return runs


def test_paired_schedule_interleaves_from_the_first_decision() -> None:
    plan = CalibrationPlan(aa_runs=3, slowdowns_pct=(3.0, 30.0), runs_per_slowdown=2, mode="paired")
    assert _pcts(schedule(plan)) == [0, 3, 30, 0, 3, 30, 0]
    assert _pcts(schedule(CalibrationPlan(aa_runs=1, slowdowns_pct=(), mode="paired"))) == [0]
    with pytest.raises(ConfigError, match="at least 1 A/A"):
        CalibrationPlan(aa_runs=0, mode="paired")
    with pytest.raises(ConfigError, match="'history' or 'paired'"):
        CalibrationPlan(mode="bayes")  # type: ignore[arg-type]


def test_paired_run_config_slows_the_candidate_only_and_measures_the_paired_stage_only(tmp_path: Path) -> None:
    config = load_config(profile="smoke-ab")
    a = run_config(config, Arm(0), tmp_path, "paired")
    b = run_config(config, Arm(3), tmp_path, "paired")
    assert a.worker.extra_args == [] and b.worker.extra_args == [SLOWDOWN_FLAG, "3"]
    assert a.baseline is not None and b.baseline is not None
    assert a.baseline.extra_args == b.baseline.extra_args == []
    for cfg in (a, b):
        assert cfg.is_paired and not cfg.compare.enabled and not cfg.store.enabled
        assert not (cfg.one_batch.enabled or cfg.serving.enabled or cfg.occupancy.enabled or cfg.quality.enabled)
        # The gate's paired rule as is (smoke-ab's: no confirmation), without the profile of a confirmed
        # regression: a diagnosis, not part of a decision.
        assert cfg.paired == config.paired.model_copy(update={"profile": False})
        assert config.paired.profile and not config.paired.confirm and not cfg.paired.confirm
    confirming = load_config(profile="smoke-ab", overrides=["paired.confirm=true"])
    assert run_config(confirming, Arm(3), tmp_path, "paired").paired.confirm  # a gate that confirms is calibrated so
    # History calibration does not run the paired stage: its table is not what it compares.
    assert not run_config(config, Arm(0), tmp_path).paired.enabled
    with pytest.raises(ConfigError, match=r"needs a baseline worker.*smoke-ab"):
        run_config(load_config(profile="smoke"), Arm(0), tmp_path, "paired")
    release = load_config(profile="smoke-ab", overrides=["baseline.python=/opt/old/bin/python"])
    with pytest.raises(ConfigError, match=r"same build; they differ in \['python'\]"):
        run_config(release, Arm(0), tmp_path, "paired")


def test_paired_figures_per_arm_false_alarms_detections_rounds() -> None:
    from servegate.calibrate import analyse_paired, summarise_paired

    runs = _paired_runs()
    plan = CalibrationPlan(aa_runs=3, slowdowns_pct=(3.0, 30.0), runs_per_slowdown=2, mode="paired")
    figures, decisions = analyse_paired(runs, plan)
    assert len(decisions) == 2 * len(runs)  # every metric of every decision, gated or not
    assert list(figures["arm"]) == ["A/A", "+3%", "+30%"] and set(figures["metric"]) == {"itl_median_ms"}
    aa, three, thirty = (figures.iloc[i] for i in range(3))
    assert aa["decisions"] == 3 and aa["regressions"] == 1 and aa["no_change"] == 1 and aa["inconclusive"] == 1
    assert aa["false_alarm_upper95"] == pytest.approx(beta.ppf(0.95, 1 + 1, 3 - 1))  # exact, one-sided: 1 of 3
    assert aa["bound"] == 0.015 and aa["median_rounds"] == 12 and aa["median_measure_s"] == pytest.approx(108)
    assert three["regression_rate"] == 0.5 and math.isnan(three["false_alarm_upper95"])
    assert three["rate_low95"] < 0.5 < three["rate_high95"]
    assert thirty["regression_rate"] == 1.0 and thirty["rate_high95"] == 1.0
    assert thirty["rate_low95"] == pytest.approx(0.025 ** 0.5)  # 2/2: the exact lower bound
    assert thirty["median_itl_ratio"] == pytest.approx(1.29) and thirty["median_rounds"] == 6
    summary = summarise_paired(runs, figures, decisions, plan)
    assert summary["mode"] == "paired" and summary["bound"] == 0.015
    assert summary["aa_runs"] == 3 and summary["ab_runs"] == 4 and summary["left_out"] == 0
    assert summary["gate_false_alarms"]["0.015"]["false_alarms"] == 1
    assert summary["gate_detections"]["30"]["detections"] == 2
    first = summary["runs"][0]
    assert first["gate_decision"] == "pass" and first["rounds"] == 8
    assert first["metrics"]["itl_median_ms"] == {"decision": "no_change", "ratio": 1.002, "ci_low": 0.99,
                                                 "ci_high": 1.012}
    text = format_calibration(figures, summary)
    assert "+30%" in text and "2/2 = 100.0%" in text and "gate-level false alarms at bound 1.5%: 1/3" in text


def test_a_broken_paired_decision_is_left_out_and_none_is_an_infra_error() -> None:
    from servegate.calibrate import analyse_paired, summarise_paired

    plan = CalibrationPlan(aa_runs=3, slowdowns_pct=(3.0, 30.0), runs_per_slowdown=2, mode="paired")
    runs = _paired_runs()
    runs[1].tables = {}  # its worker died: no table
    figures, decisions = analyse_paired(runs, plan)
    assert figures.set_index("arm").loc["+3%", "decisions"] == 1
    summary = summarise_paired(runs, figures, decisions, plan)
    assert summary["left_out"] == 1 and summary["runs"][1]["gate_decision"] is None
    for run in runs:
        if run.slowdown_pct == 0:
            run.tables = {}
    with pytest.raises(InfraError, match="no A/A paired decision"):
        analyse_paired(runs, plan)


def test_a_stored_paired_calibration_reads_as_one(tmp_path: Path) -> None:
    from servegate.calibrate import analyse_paired, figures_records, summarise_paired

    plan = CalibrationPlan(aa_runs=3, slowdowns_pct=(3.0, 30.0), runs_per_slowdown=2, mode="paired")
    runs = _paired_runs()
    figures, decisions = analyse_paired(runs, plan)
    summary = summarise_paired(runs, figures, decisions, plan)
    key = GateKey("smoke-ab", "embedded", "cpu-2core", "smollm2-135m")
    with Store(str(tmp_path / "h.db")) as store:
        store.record_calibration(key, plan=plan.as_dict(), summary=summary, metrics=figures_records(figures))
        stored = store.latest_calibration(key, mode="paired")
        assert store.latest_calibration(key) is None  # a paired calibration is no figure for history comparisons
    assert stored is not None and stored["plan"]["mode"] == "paired" and stored["summary"]["mode"] == "paired"
    assert "bounds" not in stored["plan"]  # the decisions were made against paired.bound (summary["bound"])
    assert [m["arm"] for m in stored["metrics"]] == ["A/A", "+3%", "+30%"]
    noise, _ = calibration_figures(stored, 0.015)
    assert noise == {}  # no run noise: nothing to floor a history comparison with
    carried = calibration_summary(stored, 0.015)
    assert carried["aa_runs"] == 3 and carried["gate_false_alarms_at_bound"]["false_alarms"] == 1
    assert "3 A/A" in calibration_text(carried)



# ---- resuming a calibration ------------------------------------------------------------------------
def test_a_resumed_plan_runs_only_what_is_missing_in_the_plan_s_order() -> None:
    plan = CalibrationPlan(aa_runs=3, slowdowns_pct=(3.0,), runs_per_slowdown=3, mode="paired")
    assert _pcts(schedule(plan)) == [0, 3, 0, 3, 0, 3]
    done = [CalibrationRun(0, 0.0), CalibrationRun(1, 3.0), CalibrationRun(2, 0.0)]
    assert _pcts(remaining_schedule(plan, done)) == [3, 0, 3]
    assert remaining_schedule(plan, []) == schedule(plan)
    grown = CalibrationPlan(aa_runs=4, slowdowns_pct=(3.0, 5.0), runs_per_slowdown=3, mode="paired")
    assert _pcts(remaining_schedule(grown, done)) == [5, 3, 5, 0, 3, 5, 0]
    assert remaining_schedule(plan, done + [CalibrationRun(3, 3.0), CalibrationRun(4, 0.0),
                                            CalibrationRun(5, 3.0)]) == []


def _stopped_calibration(out: Path, config, plan: CalibrationPlan) -> list[dict]:
    """A calibration folder as one stopped after two runs leaves it: its setup, a kept A/A decision with
    its run folder, and a broken slowdown decision (left out)."""
    from servegate import jsonio
    from servegate.results import RunFolder

    out.mkdir()
    write_setup(out, config, plan)
    folder = RunFolder.create(out / "runs", config.name)
    folder.write_table("paired", _paired_table((1.002, 0.99, 1.012), "no_change", 20, 180.0))
    records = [CalibrationRun(0, 0.0, run_dir=str(folder.path), status="pass", measurement_s=180.0,
                              tables={"paired": pd.DataFrame()}).record(),
               CalibrationRun(1, 3.0, run_dir=str(out / "runs" / "gone"), status="inconclusive",
                              measurement_s=12.0).record()]
    assert [r["kept"] for r in records] == [True, False]
    (out / "runs.json").write_text(jsonio.dumps(records, indent=True))
    return records


def test_a_stopped_calibration_resumes_with_its_runs_and_their_tables(tmp_path: Path) -> None:
    config = load_config(profile="smoke-ab")
    plan = CalibrationPlan(aa_runs=2, slowdowns_pct=(3.0,), runs_per_slowdown=2, mode="paired")
    out = tmp_path / "cal"
    _stopped_calibration(out, config, plan)
    # More decisions and another store may be asked for; the runs so far count.
    more = CalibrationPlan(aa_runs=5, slowdowns_pct=(3.0,), runs_per_slowdown=2, mode="paired")
    elsewhere = load_config(profile="smoke-ab", overrides=["store.url=sqlite:////elsewhere.db", "output_dir=/x"])
    runs = previous_runs(out, elsewhere, more, resume=True)
    assert [(r.index, r.slowdown_pct, r.status) for r in runs] == [(0, 0.0, "pass"), (1, 3.0, "inconclusive")]
    assert list(runs[0].tables) == ["paired"] and runs[0].tables["paired"]["decision"].iloc[0] == "no_change"
    assert runs[1].tables == {}  # broken: still left out of the figures, not re-run
    assert _pcts(remaining_schedule(more, runs)) == [0, 3, 0, 0, 0]


def test_resume_refuses_what_would_mix_two_calibrations_before_running_anything(tmp_path: Path) -> None:
    config = load_config(profile="smoke-ab")
    plan = CalibrationPlan(aa_runs=2, slowdowns_pct=(3.0,), runs_per_slowdown=2, mode="paired")
    out = tmp_path / "cal"
    with pytest.raises(ConfigError, match="nothing to resume in .*calibration-setup.json"):
        previous_runs(out, config, plan, resume=True)
    assert previous_runs(out, config, plan, resume=False) == []  # a new calibration: nothing there yet
    _stopped_calibration(out, config, plan)
    with pytest.raises(ConfigError, match="already holds a calibration .*--resume"):
        previous_runs(out, config, plan, resume=False)
    other = load_config(profile="smoke-ab", overrides=["paired.bound=0.03"])
    with pytest.raises(ConfigError, match=r"differs in paired.bound \(0.015 then, 0.03 now\)"):
        previous_runs(out, other, plan, resume=True)
    with pytest.raises(ConfigError, match=r"differs in mode \('paired' then, 'history' now\)"):
        previous_runs(out, config, CalibrationPlan(aa_runs=2, slowdowns_pct=(3.0,)), resume=True)
    with pytest.raises(ConfigError, match=r"arms \['\+3%'\] that this plan \(\['A', '\+5%'\]\) leaves out"):
        previous_runs(out, config, CalibrationPlan(aa_runs=2, slowdowns_pct=(5.0,), mode="paired"), resume=True)
    # A kept run's folder must still be there: its tables are the calibration's figures.
    records = json.loads((out / "runs.json").read_text())
    shutil.rmtree(records[0]["run_dir"])
    with pytest.raises(ConfigError, match="calibration run 0 \\(A\\) cannot be read again"):
        previous_runs(out, config, plan, resume=True)


def test_resume_refuses_a_calibration_made_on_another_cpu(tmp_path: Path) -> None:
    # The zoo calibration of 2026-12-05/06 was resumed on an Intel Xeon after 18 decisions on an AMD EPYC,
    # where the same patch costs another share of a step: its figures mixed two machines.
    config = load_config(profile="smoke-ab")
    plan = CalibrationPlan(aa_runs=2, slowdowns_pct=(3.0,), runs_per_slowdown=2, mode="paired")
    out = tmp_path / "cal"
    _stopped_calibration(out, config, plan)
    setup = json.loads((out / "calibration-setup.json").read_text())
    here = setup["machine"]
    assert here["cpu_model"] and here["cpu_count_logical"] >= 1  # this machine, recorded before the first run
    other = "Intel Xeon" if "AMD" in here["cpu_model"] else "AMD EPYC"  # never this machine's own model
    setup["machine"] = {**here, "cpu_model": other}
    (out / "calibration-setup.json").write_text(json.dumps(setup))
    with pytest.raises(ConfigError, match=rf"made on another machine \(cpu_model \('{other}' then, .* now\)\)"):
        previous_runs(out, config, plan, resume=True)
    del setup["machine"]  # a folder from before the machine was recorded: nothing to hold it against
    (out / "calibration-setup.json").write_text(json.dumps(setup))
    assert len(previous_runs(out, config, plan, resume=True)) == 2


# ---- real code regressions (the zoo) ---------------------------------------------------------------
def test_zoo_regressions_are_arms_of_a_paired_plan_scheduled_and_resumed_like_slowdowns() -> None:
    plan = CalibrationPlan(aa_runs=2, slowdowns_pct=(3.0,), runs_per_slowdown=2, mode="paired",
                           regressions=("linears-unpacked", "sampler-one-path"))
    assert [a.label for a in schedule(plan)] == ["A", "+3%", "linears-unpacked", "sampler-one-path",
                                                 "A", "+3%", "linears-unpacked", "sampler-one-path"]
    done = [CalibrationRun(0, 0.0), CalibrationRun(1, 3.0), CalibrationRun(2, 0.0, "linears-unpacked")]
    assert [a.label for a in remaining_schedule(plan, done)] == [
        "sampler-one-path", "A", "+3%", "linears-unpacked", "sampler-one-path"]
    with pytest.raises(ConfigError, match="add --paired"):
        CalibrationPlan(regressions=("linears-unpacked",))
    with pytest.raises(ConfigError, match="twice"):
        CalibrationPlan(mode="paired", regressions=("linears-unpacked", "linears-unpacked"))


def test_a_zoo_regression_runs_its_tree_on_the_candidate_s_pythonpath_only(tmp_path: Path) -> None:
    config = load_config(profile="smoke-ab")
    tree = tmp_path / "zoo" / "linears-unpacked"
    cfg = run_config(config, Arm(regression="linears-unpacked"), tmp_path, "paired", tree)
    assert cfg.worker.env == {"PYTHONPATH": str(tree)} and cfg.worker.extra_args == []
    assert cfg.baseline is not None and "PYTHONPATH" not in cfg.baseline.env
    with pytest.raises(ConfigError, match="needs its built tree"):
        run_config(config, Arm(regression="linears-unpacked"), tmp_path, "paired")
    with pytest.raises(ConfigError, match=r"unknown zoo regression 'faster'; valid: linears-unpacked, "):
        run_config(config, Arm(regression="faster"), tmp_path, "paired", tree)
    with pytest.raises(ConfigError, match="calibrate it with --paired and the embedded worker"):
        run_config(config, Arm(regression="linears-unpacked"), tmp_path, "history", tree)


def test_a_zoo_arm_shows_its_solo_effect_beside_what_the_gate_read() -> None:
    from servegate.calibrate import analyse_paired, summarise_paired

    plan = CalibrationPlan(aa_runs=1, slowdowns_pct=(), runs_per_slowdown=2, mode="paired",
                           regressions=("linears-unpacked",))
    runs = [CalibrationRun(0, 0.0, run_dir="/runs/0", status="pass", measurement_s=100.0,
                           tables={"paired": _paired_table((1.001, 0.99, 1.012), "no_change", 10, 90.0)}),
            CalibrationRun(1, 0.0, "linears-unpacked", run_dir="/runs/1", status="fail", measurement_s=100.0,
                           tables={"paired": _paired_table((1.10, 1.08, 1.12), "regression", 10, 90.0)}),
            CalibrationRun(2, 0.0, "linears-unpacked", run_dir="/runs/2", status="fail", measurement_s=100.0,
                           tables={"paired": _paired_table((1.08, 1.06, 1.10), "regression", 10, 90.0)})]
    solo = {"linears-unpacked": {"ratio": 1.09, "ci_low": 1.088, "ci_high": 1.092,
                                 "worker": {"ratio": 1.06, "ci_low": 1.05, "ci_high": 1.07}}}
    figures, decisions = analyse_paired(runs, plan, solo)
    zoo = figures.set_index("arm").loc["linears-unpacked"]
    assert zoo["decisions"] == 2 and zoo["regressions"] == 2 and zoo["solo_ratio"] == 1.09
    assert zoo["read_of_solo"] == pytest.approx(math.log(1.09) / math.log(1.09))  # the median read x1.09
    assert zoo["worker_solo_ratio"] == 1.06 and zoo["worker_solo_ci_high"] == 1.07
    assert zoo["read_of_worker_solo"] == pytest.approx(math.log(1.09) / math.log(1.06))
    assert math.isnan(figures.set_index("arm").loc["A/A", "solo_ratio"])
    assert math.isnan(figures.set_index("arm").loc["A/A", "read_of_worker_solo"])
    assert list(decisions["regression"]) == ["", "", "linears-unpacked", "linears-unpacked",
                                             "linears-unpacked", "linears-unpacked"]
    summary = summarise_paired(runs, figures, decisions, plan)
    assert summary["gate_detections"]["linears-unpacked"]["detections"] == 2 and summary["ab_runs"] == 2
    text = format_calibration(figures, summary)
    assert "x1.0900, read 1.00 of it" in text and "x1.0600, read 1.48 of it" in text
    assert "solo in the worker" in text and "solo decode step" in text


def test_the_worker_solo_effect_is_the_geometric_mean_of_the_rounds_with_a_t_interval() -> None:
    from servegate.calibrate import worker_solo_effect

    b = [1.05, 1.07, 1.06, 1.08]
    rounds = pd.DataFrame({"metric": ["itl_median_ms"] * 4 + ["ttft_median_ms"] * 4,
                           "a_value": [20.0] * 4 + [100.0] * 4, "b_value": [20.0 * x for x in b] + [300.0] * 4})
    effect = worker_solo_effect(rounds)
    logs = [math.log(x) for x in b]
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = stats.t.ppf(0.975, 3) * sd / 2
    assert effect["ratio"] == pytest.approx(math.exp(mean)) and effect["rounds"] == 4
    assert (effect["ci_low"], effect["ci_high"]) == (pytest.approx(math.exp(mean - half)), pytest.approx(math.exp(mean + half)))
    assert effect["baseline_median"] == 20.0 and effect["candidate_median"] == pytest.approx(20.0 * 1.065)
    with pytest.raises(InsufficientDataError, match="2 rounds of itl_median_ms"):
        worker_solo_effect(rounds.iloc[[0, 1]])


def test_the_worker_solo_config_alternates_the_two_workers_blocks_on_one_pair_of_instances(tmp_path: Path) -> None:
    from servegate.calibrate import WORKER_SOLO_ROUNDS, worker_solo_config

    config = load_config(profile="smoke-ab")
    cfg = worker_solo_config(config, "attention-eager", tmp_path / "tree", tmp_path / "out")
    p = cfg.paired
    assert (p.mode, p.rounds_per_worker, p.min_rounds, p.max_rounds) == ("interleaved", WORKER_SOLO_ROUNDS,
                                                                          WORKER_SOLO_ROUNDS, WORKER_SOLO_ROUNDS)
    assert not p.confirm and not p.profile and p.warmup_blocks == 1 and p.max_measure_s >= 900
    assert cfg.worker.env["PYTHONPATH"] == str(tmp_path / "tree") and "PYTHONPATH" not in cfg.baseline.env
    assert cfg.worker.cpus == cfg.baseline.cpus == [0] and p.client_cpus == [1]  # the gate's own placement
    assert cfg.output_dir == str(tmp_path / "out") and not cfg.store.enabled and not cfg.quality.enabled
