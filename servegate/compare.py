"""Compare a gate run with its baseline, metric by metric, from the raw samples.

For each gated metric (:data:`~servegate.gated_metrics.GATED_METRICS`) the current run's raw
samples (per request, per token, per scrape) are compared with the baseline runs' pooled raw
samples, through a confidence interval for the ratio of their statistics
(:mod:`servegate.bootstrap` holds the maths):

- **median metrics**: a two-stage percentile bootstrap (baseline runs, then samples; ITL per
  request), with the run-to-run noise term ``run_sd`` estimated from the baseline runs and
  floored by the figure ``servegate calibrate`` measured for the metric (``run_noise``).
- **tail metrics (p99)**: reported always, gated only when the sample size supports a bound:
  with exact order-statistic intervals an end is unbounded below ~440 samples (p99 at 95 %),
  and the row is ``report_only`` — a p99 from 16 requests is its maximum and gating on it only
  produces false alarms. Tails also get a wider minimum effect (:data:`DEFAULT_TAIL_BOUND`).
  For ITL the order-statistic interval only decides *whether* the tail is gated; its interval
  then comes from the per-request bootstrap at the 0.99 quantile.
- **one value per run** (the capacity sweep's ``capacity_rps``): the current run has one sample,
  so its interval is all run-to-run noise: the spread of the baseline runs' values (at least
  ``min_samples`` = 2 baseline runs, else ``insufficient_data``), floored by the calibrated figure.
  Its bound is at least one and a half sweep steps (from the widest last-good..first-bad bracket:
  23 % for growth 2 with 2 refine steps, whose step is 2**0.25): a capacity at the edge of a step
  moves by a whole step between runs of an unchanged worker, so one step is ``no_change`` and two
  steps are decided.

Decisions (:func:`decide_change`), with ``bound`` the minimum effect that matters
(``DEFAULT_BOUND`` = 5 %) — a non-inferiority test, so that "no regression" is shown, not assumed:

================== ====================================================================
regression         the whole interval is beyond the bound in the bad direction
improvement        the whole interval is beyond the bound in the good direction
no_change          the bad end of the interval is inside the bound (a regression of at
                   least ``bound`` is excluded)
inconclusive       the interval straddles the bound on the bad side (more samples needed)
insufficient_data  no baseline runs (too little history) or too few samples on a side
report_only        shown, not gated: a tail whose interval is unbounded at this sample
                   size, a one-batch case measured fewer than ``min_samples`` times, or a
                   metric declared ``report_only`` (start-up time, memory high-water mark,
                   cost per million output tokens: the reason says what its interval says)
suspicious         a regression by the interval, not yet called one by the history rule
                   (``compare.consecutive`` > 1, below): the gate is undecided, never a pass
================== ====================================================================

**The history rule** (``compare.consecutive`` = N, :func:`compare_run`; as PyTorch HUD's
regression policies): with no baseline build to re-measure, one night beyond the bound may be
a noisy machine, so a gated ``regression`` row stands only when the N-1 most recent earlier runs
of the gate key that compared the same metric and case decided it ``regression`` or
``suspicious`` too; its reason names them ("3 consecutive runs: this run, <ids>"). Otherwise the
row becomes ``suspicious``, its reason says how many of the last runs regressed and how many more
are needed. How the earlier runs are chosen:

- one per run group, its effective (latest) attempt, ordered by the group's original start: a
  re-run of a night is the same night measured again, not another night. The judged run's own
  group is left out (``exclude_run``), and a recorded run judged again sees only runs that
  started before it;
- only runs whose recorded ``comparison`` table has a row for the metric and case: a run that did
  not compare (compare disabled, a stage that failed before it) says nothing either way, so it is
  skipped, not counted;
- only runs after the key's last ``servegate baseline distribution-change``: an intentional shift
  starts every streak over;
- any other decision of that row breaks the streak: ``no_change``/``improvement`` (the change was
  excluded there), ``inconclusive`` (not shown there: counting it would let regressions nights
  apart, with undecided nights between, pass for consecutive ones), ``insufficient_data`` and
  ``report_only`` (nothing was decided there). Fewer than N-1 such runs also leave it
  ``suspicious``. The row's decision is what counts, whatever else that run's verdict said.

``suspicious`` rows fail the comparison suite's check with ``failure_means: suspicious``
(:mod:`servegate.verdict`): the verdict is inconclusive (exit 2), its reason says "suspicious",
and the run is not ``baseline_eligible``, so the baseline does not drift toward the regression
while the next runs decide.

The result is a DataFrame (the ``comparison`` table) that Great Expectations validates like
every other table, e.g. ``decision`` not in ``["regression"]`` and, on rows where ``gated``,
not in ``["insufficient_data"]``. :func:`compare_tables` works on tables in memory
(calibration uses it); :func:`compare_run` reads the baseline runs and the key's latest
calibration from the history database.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

from servegate.baseline import Baseline, BaselinePolicy, last_distribution_change, resolve_baseline, run_group_ids
from servegate.bootstrap import (DEFAULT_CONFIDENCE, DEFAULT_N_BOOT, Samples, between_run_sd, ratio_ci_median,
                                 ratio_ci_quantile, ratio_ci_quantile_clustered)
from servegate.errors import ConfigError
from servegate.hostcheck import environment_differences
from servegate.gated_metrics import (GATED_METRICS, Direction, GatedMetric, extract_requests, extract_samples,
                                     resolution_log)
from servegate.history import GateKey, RunRecord, Store
from servegate.tables import COMPARISON_COLUMNS

__all__ = [
    "DECISIONS",
    "DEFAULT_BOUND",
    "DEFAULT_TAIL_BOUND",
    "STREAK_DECISIONS",
    "apply_history_rule",
    "estimate_run_noise",
    "calibration_figures",
    "calibration_summary",
    "decide_change",
    "compare_tables",
    "compare_run",
]

DEFAULT_BOUND = 0.05
"""Minimum effect that counts as a change (5 %): run-to-run shifts smaller than this are
within the noise PyTorch's and vLLM's dashboards tolerate, and below what a nightly can act on."""
DEFAULT_TAIL_BOUND = 0.10
"""Tails move more between runs than medians; vLLM reviewers dropped p99 gating for this."""
DECISIONS = ("regression", "improvement", "no_change", "inconclusive", "insufficient_data", "report_only",
             "suspicious")
STREAK_DECISIONS = ("regression", "suspicious")
"""An earlier run's decisions that continue a streak of the history rule (module docstring)."""


def decide_change(ci_low: float, ci_high: float, direction: Direction, bound: float) -> str:
    """regression | improvement | no_change | inconclusive from a ratio interval (see module doc)."""
    if direction == "lower_is_better":
        bad_end, good_end = ci_high, ci_low
        if math.isfinite(good_end) and good_end > 1 + bound:
            return "regression"
        if math.isfinite(bad_end) and bad_end < 1 - bound:
            return "improvement"
        if math.isfinite(bad_end) and bad_end <= 1 + bound:
            return "no_change"
        return "inconclusive"
    bad_end, good_end = ci_low, ci_high
    if math.isfinite(good_end) and good_end < 1 - bound:
        return "regression"
    if math.isfinite(bad_end) and bad_end > 1 + bound:
        return "improvement"
    if math.isfinite(bad_end) and bad_end >= 1 - bound:
        return "no_change"
    return "inconclusive"



# ---- the comparison table -----------------------------------------------------------------
def _resolution_bound(metric: GatedMetric, bound: float, current: Mapping[str, pd.DataFrame],
                      baseline: Sequence[Mapping[str, pd.DataFrame]]) -> float:
    """The minimum effect for a per-run value known only within a bracket (the sweep's last good ..
    first bad rate): no smaller than one and a half brackets (the widest, in log). A capacity that
    sits at the edge of a sweep step moves by one whole step between runs of an unchanged worker,
    so a change of one step is not a regression; two steps are."""
    widths = [resolution_log(metric, t) for t in (current, *baseline)]
    widths = [w for w in widths if math.isfinite(w)]
    return max(bound, 1 - math.exp(-1.5 * max(widths))) if widths else bound


def _row(metric: GatedMetric, case: str, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {c: math.nan for c in COMPARISON_COLUMNS}
    row.update(metric=metric.metric, table=metric.table, case=case, statistic=metric.statistic, unit=metric.unit,
               direction=metric.direction, n_baseline=0, n_current=0, n_baseline_runs=0, gated=True, reason=None)
    row.update(values)
    return row


def _report_only(row: dict[str, Any]) -> None:
    """A report-only metric's row: shown with its interval, never gated, whatever the interval says."""
    said = row["decision"]
    why = row["reason"] if isinstance(row["reason"], str) else ""
    row.update(gated=False, decision="report_only",
               reason=f"report-only metric, never gated (its interval: {said})" + (f"; {why}" if why else ""))


def compare_tables(current: Mapping[str, pd.DataFrame], baseline_runs: Sequence[tuple[str, Mapping[str, pd.DataFrame]]],
                   *, metrics: Sequence[GatedMetric] = GATED_METRICS, bound: float = DEFAULT_BOUND,
                   tail_bound: float = DEFAULT_TAIL_BOUND, confidence: float = DEFAULT_CONFIDENCE,
                   n_boot: int = DEFAULT_N_BOOT, seed: int = 0, baseline_policy: str = "",
                   baseline_reason: str | None = None, run_noise: Mapping[str, float] | None = None) -> pd.DataFrame:
    """The comparison table of ``current`` tables against ``baseline_runs`` = [(run_id, tables)].

    No store needed (calibration compares in memory). A metric whose table the current run
    did not produce gives no row; one the baseline lacks gives ``insufficient_data``.
    ``run_noise``: metric (``serving.itl_ms.median``) -> calibrated between-run sd of log
    medians, the floor of the run-to-run noise term (module docstring).
    """
    run_noise = dict(run_noise or {})
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence!r}")
    if not (0 <= bound < 1 and 0 <= tail_bound < 1):
        raise ConfigError(f"bounds are fractions in [0, 1), got bound={bound!r}, tail_bound={tail_bound!r}")
    run_ids = ",".join(rid for rid, _ in baseline_runs)
    rows: list[dict[str, Any]] = []
    for m_index, metric in enumerate(metrics):
        cur_cases = extract_samples(metric, current)
        if not cur_cases:
            continue
        base_by_run = [extract_samples(metric, tables) for _, tables in baseline_runs]
        # Tokens of one request are not independent: list-column metrics are resampled by request.
        cur_requests = extract_requests(metric, current)
        base_requests = [extract_requests(metric, tables) for _, tables in baseline_runs]
        metric_bound = tail_bound if metric.statistic != "median" else bound
        if metric.resolution_columns is not None:
            metric_bound = _resolution_bound(metric, metric_bound, current, [t for _, t in baseline_runs])
        first_row = len(rows)
        for c_index, (case, cur) in enumerate(cur_cases.items()):
            groups = [b[case] for b in base_by_run if case in b]
            n_base = int(sum(g.size for g in groups))
            common = dict(bound=metric_bound, confidence=confidence, n_current=int(cur.size), n_baseline=n_base,
                          n_baseline_runs=len(groups), current_median=float(np.median(cur)),
                          current_value=float(np.quantile(cur, metric.quantile)), baseline_policy=baseline_policy,
                          baseline_runs=run_ids)
            if groups:
                pooled = np.concatenate(groups)
                common.update(baseline_median=float(np.median(pooled)),
                              baseline_value=float(np.quantile(pooled, metric.quantile)))
            if not metric.gate_below_min and cur.size < metric.min_samples:
                # Not gated at this run's sample size whatever the history holds: say so the same way
                # on the first night as on the tenth.
                rows.append(_row(metric, case, decision="report_only", gated=False,
                                 reason=f"{cur.size} sample(s) in this run, {metric.min_samples} needed; "
                                        f"repeat each case to gate it", **common))
                continue
            if not groups:
                reason = baseline_reason or ("no baseline run has this metric" if baseline_runs
                                             else "no baseline runs: too little history")
                rows.append(_row(metric, case, decision="insufficient_data", reason=reason, **common))
                continue
            if metric.per_run and len(groups) < metric.min_samples:
                rows.append(_row(metric, case, decision="insufficient_data",
                                 reason=f"one value per run: {len(groups)} baseline run(s) have it, "
                                        f"{metric.min_samples} needed to know its run-to-run spread", **common))
                continue
            if not metric.per_run and min(cur.size, n_base) < metric.min_samples:
                short = (f"{min(cur.size, n_base)} sample(s) on a side, {metric.min_samples} needed")
                if not metric.gate_below_min:
                    rows.append(_row(metric, case, decision="report_only", gated=False,
                                     reason=f"{short}; repeat each case to gate it", **common))
                else:
                    rows.append(_row(metric, case, decision="insufficient_data", reason=short, **common))
                continue
            cur_side: Samples = cur
            base_sides: Sequence[Samples] = groups
            if metric.list_column:
                cur_side = cur_requests.get(case, [cur])
                base_sides = [b[case] for b in base_requests if case in b]
            if metric.statistic == "median":
                rng = np.random.default_rng(seed + 7919 * m_index + c_index)
                run_sd = max(between_run_sd(base_sides, rng), float(run_noise.get(metric.metric, 0.0)))
                ratio, low, high = ratio_ci_median(cur_side, base_sides, confidence=confidence, n_boot=n_boot,
                                                   seed=seed + 1009 * m_index + c_index, run_sd=run_sd)
                common["run_sd"] = run_sd
                gated, reason = True, None
            else:
                ratio, low, high = ratio_ci_quantile(cur, np.concatenate(groups), metric.quantile,
                                                     confidence=confidence)
                gated = math.isfinite(low) and math.isfinite(high)
                reason = None if gated else (f"{metric.statistic} of n={cur.size} vs n={n_base} has no finite "
                                             f"order-statistic bound at {confidence:.0%}; reported, not gated")
                if gated and metric.list_column:
                    # The order-statistic interval assumes independent samples; a request's tokens are
                    # not, so a tail of tokens is bounded by resampling requests instead.
                    low, high = ratio_ci_quantile_clustered(cur_side, base_sides, metric.quantile, confidence=confidence,
                                                            n_boot=n_boot, seed=seed + 1009 * m_index + c_index)
            if not math.isfinite(ratio):
                rows.append(_row(metric, case, decision="insufficient_data", ratio=ratio, ci_low=low, ci_high=high,
                                 reason="baseline statistic is 0: a ratio is undefined", **common))
                continue
            decision = decide_change(low, high, metric.direction, metric_bound) if gated else "report_only"
            rows.append(_row(metric, case, ratio=ratio, ci_low=low, ci_high=high, gated=gated, decision=decision,
                             reason=reason, **common))
        if metric.report_only:
            for row in rows[first_row:]:
                _report_only(row)
    df = pd.DataFrame(rows, columns=COMPARISON_COLUMNS)
    for col in ("n_baseline", "n_current", "n_baseline_runs"):
        df[col] = df[col].astype("int64")
    df["gated"] = df["gated"].astype(bool)
    return df


def compare_run(store: Store, run: str | Mapping[str, pd.DataFrame], key: GateKey | None = None, *,
                policy: BaselinePolicy | None = None, metrics: Sequence[GatedMetric] = GATED_METRICS,
                bound: float = DEFAULT_BOUND, tail_bound: float = DEFAULT_TAIL_BOUND,
                confidence: float = DEFAULT_CONFIDENCE, n_boot: int = DEFAULT_N_BOOT, seed: int = 0,
                exclude_run: str | None = None, calibration: Mapping[str, Any] | None = None,
                environment: Mapping[str, Any] | Any | None = None, consecutive: int = 1) -> pd.DataFrame:
    """Compare a run with its key's baseline (chosen by ``policy``) and return the comparison table.

    ``run``: a recorded run id (its tables are read from the store, its key and run group
    found there) or the tables of a run not yet recorded (then ``key`` is required; pass its
    ``exclude_run`` when it is a re-run of a recorded run, to keep its own group out).
    The table's ``attrs["baseline"]`` holds :meth:`Baseline.as_dict`, ``attrs["calibration"]``
    :func:`calibration_summary` of the key's latest calibration (``calibration``, when given,
    is used instead of the stored one); its run noise floors the run-to-run term.
    ``attrs["environment"]``: one line per thing that moves the figures and differs between the run's
    environment record (``environment``, a recorded run's own by default) and the baseline runs'
    (:func:`servegate.hostcheck.environment_differences`): said, never a failure.
    ``consecutive`` (``compare.consecutive``): the history rule of the module docstring, applied by
    :func:`apply_history_rule` to the finished table; 1 leaves every decision as the interval made it.
    """
    _check_consecutive(consecutive)
    started_before = None
    if isinstance(run, str):
        record = store.get_run(run)
        if key is not None and key != record.key:
            raise ConfigError(f"run {run} belongs to gate {record.key}, not {key}")
        key, current, exclude_run = record.key, store.tables(run), run
        started_before = record.started_at
        if environment is None:
            environment = record.manifest.get("environment")
    else:
        if key is None:
            raise ConfigError("compare_run with tables needs the gate key (GateKey.from_run(manifest, config))")
        current = run
    baseline: Baseline = resolve_baseline(store, key, policy, exclude_run=exclude_run)
    baseline_tables = [(r.run_id, store.tables(r.run_id, {m.table for m in metrics})) for r in baseline.runs]
    if not baseline.sufficient:
        baseline_tables = []
    if calibration is None:
        calibration = store.latest_calibration(key)
    run_noise, figures = calibration_figures(calibration, bound, tail_bound)
    df = compare_tables(current, baseline_tables, metrics=metrics, bound=bound, tail_bound=tail_bound,
                        confidence=confidence, n_boot=n_boot, seed=seed, baseline_policy=baseline.policy,
                        baseline_reason=baseline.reason, run_noise=run_noise)
    for i, (metric, case) in enumerate(zip(df["metric"], df["case"])):
        fig = figures.get((metric, case))
        if fig is not None:
            for col in ("false_alarm_upper95", "min_detectable"):
                value = fig.get(col)
                df.loc[df.index[i], col] = math.nan if value is None else float(value)
    df.attrs["baseline"] = baseline.as_dict()
    df.attrs["environment"] = environment_differences(
        environment, [(r.run_id, r.manifest.get("environment")) for r in baseline.runs] if baseline_tables else [])
    df.attrs["calibration"] = calibration_summary(calibration, bound, tail_bound)
    apply_history_rule(df, store, key, consecutive, exclude_run=exclude_run, started_before=started_before)
    return df


def _check_consecutive(consecutive: int) -> None:
    if isinstance(consecutive, bool) or not isinstance(consecutive, int) or not 1 <= consecutive <= 10:
        raise ConfigError(f"consecutive must be an integer from 1 to 10 (compare.consecutive), got {consecutive!r}")


def _earlier_runs(store: Store, key: GateKey, exclude_run: str | None,
                  started_before: datetime | None) -> list[RunRecord]:
    """The history rule's candidates, newest first: one record per run group (its latest attempt),
    the judged run's group left out, after the key's last distribution change."""
    excluded = run_group_ids(store, exclude_run)
    change = last_distribution_change(store, key)
    return [r for r in store.runs(key, include_attempts=False)
            if r.root_id not in excluded and r.run_id not in excluded
            and (started_before is None or r.started_at < started_before)
            and (change is None or r.started_at > change["at"])]


def apply_history_rule(df: pd.DataFrame, store: Store, key: GateKey, consecutive: int, *,
                       exclude_run: str | None = None, started_before: datetime | None = None) -> None:
    """The history rule (module docstring) on the comparison table ``df``, in place: each gated
    ``regression`` row stays one when the ``consecutive`` - 1 earlier runs of ``key`` that compared
    its metric and case all decided it ``regression`` or ``suspicious``, else it becomes ``suspicious``.
    Reads the earlier runs' recorded ``comparison`` tables, only when a row needs them."""
    _check_consecutive(consecutive)
    flagged = [i for i in df.index if df.at[i, "decision"] == "regression" and bool(df.at[i, "gated"])]
    if consecutive == 1 or not flagged:
        return
    needed = consecutive - 1
    earlier = _earlier_runs(store, key, exclude_run, started_before)
    comparisons: dict[str, pd.DataFrame | None] = {}

    def decisions_of(metric: str, case: str) -> list[tuple[str, str]]:
        """(run id, decision) of the ``needed`` most recent earlier runs with a row for metric+case."""
        found: list[tuple[str, str]] = []
        for rec in earlier:
            if rec.run_id not in comparisons:
                comparisons[rec.run_id] = store.tables(rec.run_id, {"comparison"}).get("comparison")
            table = comparisons[rec.run_id]
            if table is None or table.empty:
                continue
            same = table[(table["metric"] == metric) & (table["case"].fillna("") == case)]
            if same.empty:
                continue
            found.append((rec.run_id, str(same["decision"].iloc[0])))
            if len(found) == needed:
                break
        return found

    for i in flagged:
        metric, case = str(df.at[i, "metric"]), df.at[i, "case"]
        found = decisions_of(metric, case if isinstance(case, str) else "")
        streak = 1
        for _, decision in found:
            if decision not in STREAK_DECISIONS:
                break
            streak += 1
        said = df.at[i, "reason"]
        said = f"; {said}" if isinstance(said, str) and said else ""
        if streak == consecutive:
            df.at[i, "reason"] = f"{consecutive} consecutive runs: this run, {', '.join(r for r, _ in found)}{said}"
            continue
        regressed = 1 + sum(d in STREAK_DECISIONS for _, d in found)
        if streak - 1 < len(found):
            run_id, decision = found[streak - 1]
            why = f"the streak breaks at run {run_id} ({decision})"
        else:
            why = f"only {len(found)} earlier run(s) of the gate key compared it"
        left = consecutive - streak
        df.at[i, "decision"] = "suspicious"
        df.at[i, "reason"] = (f"regression in {regressed} of the last {len(found) + 1} run(s) (compare.consecutive = "
                              f"{consecutive}; {why}): not yet called; "
                              + ("the next run decides" if left == 1 else f"{left} more runs in a row decide")
                              + said)


def estimate_run_noise(runs: Sequence[Mapping[str, pd.DataFrame]], metrics: Sequence[GatedMetric] = GATED_METRICS,
                       *, seed: int = 0) -> dict[str, float]:
    """Between-run noise (sd of log medians, sampling noise removed) of each median metric over
    runs of an unchanged worker; per-case metrics take their noisiest case."""
    out: dict[str, float] = {}
    for m_index, metric in enumerate(metrics):
        if metric.statistic != "median":
            continue
        per_run: list[dict[str, Samples]] = []
        for tables in runs:
            per_run.append(dict(extract_requests(metric, tables)) if metric.list_column
                           else dict(extract_samples(metric, tables)))
        cases = sorted({c for r in per_run for c in r})
        rng = np.random.default_rng(seed + 31 * m_index)
        sds = [between_run_sd([r[c] for r in per_run if c in r], rng) for c in cases]
        if sds:
            out[metric.metric] = max(out.get(metric.metric, 0.0), max(sds))
    return out



def calibration_figures(calibration: Mapping[str, Any] | None, bound: float,
                        tail_bound: float = DEFAULT_TAIL_BOUND) -> tuple[dict[str, float], dict[tuple[str, str], dict]]:
    """From a stored calibration (``Store.latest_calibration``): the run noise per metric, and per
    ``(metric, case)`` the figures recorded for the bound nearest to the one in force."""
    if not calibration:
        return {}, {}
    noise: dict[str, float] = {}
    best: dict[tuple[str, str], dict] = {}
    for rec in calibration.get("metrics") or []:
        sd = rec.get("run_sd")
        if sd is not None and math.isfinite(float(sd)):
            noise[rec["metric"]] = max(noise.get(rec["metric"], 0.0), float(sd))
        target = bound if rec.get("statistic") == "median" else tail_bound
        k = (rec["metric"], rec.get("case") or "")
        if k not in best or abs(rec["bound"] - target) < abs(best[k]["bound"] - target):
            best[k] = dict(rec)
    return noise, best



def calibration_summary(calibration: Mapping[str, Any] | None, bound: float = DEFAULT_BOUND,
                        tail_bound: float = DEFAULT_TAIL_BOUND) -> dict[str, Any] | None:
    """What a verdict carries about the key's calibration: when, how many runs, the gate-level
    false alarms, and per gated metric (at the bound in force, or the nearest calibrated one)
    its false-alarm bound and smallest detectable change."""
    if not calibration:
        return None
    _, figures = calibration_figures(calibration, bound, tail_bound)
    summary = calibration.get("summary") or {}
    at = calibration.get("at")
    gate_level = summary.get("gate_false_alarms") or {}
    nearest = min(gate_level, key=lambda b: abs(float(b) - bound)) if gate_level else None
    return {
        "id": calibration.get("id"),
        "bound": float(nearest) if nearest is not None else None,
        "gate_false_alarms_at_bound": gate_level.get(nearest) if nearest is not None else None,
        "at": at.isoformat() if hasattr(at, "isoformat") else at,
        "aa_runs": summary.get("aa_runs"),
        "ab_runs": summary.get("ab_runs"),
        "measurement_s_per_decision": summary.get("measurement_s_per_decision"),
        "gate_false_alarms": summary.get("gate_false_alarms"),
        "metrics": [{k: rec.get(k) for k in ("metric", "case", "bound", "run_sd", "false_alarms", "aa_comparisons",
                                             "false_alarm_upper95", "min_detectable", "min_detected_injected")}
                    for rec in figures.values() if rec.get("aa_comparisons")],
    }
