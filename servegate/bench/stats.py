"""Summary statistics of the serving benchmark, with SGLang's ``bench_serving`` names.

Everything is computed with numpy/scipy over the successful requests. An empty sample
raises ``InsufficientDataError``: a latency of "0 ms" because nothing finished is the
classic way a broken benchmark passes a gate (SGLang's own ``np.mean(x or 0)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from servegate.early_stopping import early_stopping_percentile
from servegate.errors import InsufficientDataError

__all__ = [
    "STAT_NAMES",
    "LATENCY_METRICS",
    "EARLY_STOPPING_QUANTILES",
    "describe",
    "latency_block",
    "goodput_mask",
    "ARRIVAL_KS_ALPHA",
    "arrival_ks_pvalue",
    "client_validity",
    "summarize_serving",
]

STAT_NAMES: Final = ("mean", "median", "std", "p90", "p95", "p99")
LATENCY_METRICS: Final = ("ttft", "tpot", "itl", "e2e_latency")
EARLY_STOPPING_QUANTILES: Final = (90, 95, 99)
"""The percentiles the serving summary also gives as early-stopping estimates (``es_p99_ttft_ms``)."""
ARRIVAL_KS_ALPHA: Final = 0.01
"""Arrival fit rejected below this KS p-value (issue 7: Poisson arrivals not rejected at 1 %)."""


def describe(values: Sequence[float] | np.ndarray, what: str) -> dict[str, float]:
    """mean, median, std (population, as numpy and SGLang), p90, p95, p99 and max of ``values``.

    NaN entries mean "not applicable to that item" (e.g. the TPOT of a one-token output) and
    are left out; if nothing is left, ``InsufficientDataError`` names ``what``.
    """
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        raise InsufficientDataError(f"no samples of {what}: nothing to compute statistics over; "
                                    f"check that requests succeeded (see the per-request errors)")
    p90, p95, p99 = np.percentile(arr, [90, 95, 99])
    return {
        "mean": float(np.mean(arr)),
        "median": float(np.median(arr)),
        "std": float(np.std(arr)),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
        "max": float(np.max(arr)),
    }


def latency_block(name: str, values_ms: Sequence[float] | np.ndarray) -> dict[str, float]:
    """``{mean,median,std,p90,p95,p99,max}_<name>_ms`` for latencies already in milliseconds, and
    ``es_{p90,p95,p99}_<name>_ms``: each percentile's early-stopping estimate (NaN below its floor of
    samples; :mod:`servegate.early_stopping`)."""
    d = describe(values_ms, f"{name} (ms)")
    block = {f"{stat}_{name}_ms": d[stat] for stat in (*STAT_NAMES, "max")}
    for q in EARLY_STOPPING_QUANTILES:
        estimate = early_stopping_percentile(values_ms, q / 100).value
        block[f"es_p{q}_{name}_ms"] = math.nan if estimate is None else estimate
    return block


def goodput_mask(requests: pd.DataFrame, slo_ttft_ms: float | None, slo_tpot_ms: float | None,
                 slo_e2e_ms: float | None) -> pd.Series:
    """Successful requests that meet every SLO that is set (vLLM's ``--goodput`` definition).

    A request without a TPOT (one output token) meets the TPOT SLO: it has no decode phase.
    """
    ok = requests["success"].astype(bool).copy()
    if slo_ttft_ms is not None:
        ok &= requests["ttft_ms"] <= slo_ttft_ms
    if slo_tpot_ms is not None:
        ok &= requests["tpot_ms"].isna() | (requests["tpot_ms"] <= slo_tpot_ms)
    if slo_e2e_ms is not None:
        ok &= requests["e2e_latency_ms"] <= slo_e2e_ms
    return ok


def arrival_ks_pvalue(send_times_s: Sequence[float] | np.ndarray, rate: float, burstiness: float = 1.0) -> float:
    """Kolmogorov–Smirnov p-value of the inter-arrival gaps against the law the schedule drew them from.

    ``burstiness`` 1 (Poisson arrivals): Exponential(rate). Otherwise (gamma arrivals, SGLang's and
    vLLM's ``--burstiness``): Gamma(shape=burstiness, scale=1/(rate*burstiness)), whose mean gap is
    still ``1/rate``. A small p-value says the client did not produce that arrival process (it fell
    behind, or batched its sends), so the measured latencies answer a different load.
    """
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    t = np.sort(np.asarray(send_times_s, dtype=float))
    gaps = np.diff(t)
    if gaps.size < 2:
        raise InsufficientDataError(f"{gaps.size} inter-arrival gap(s): too few for a KS test of the "
                                    f"arrival process; send more requests (serving.num_prompts)")
    if burstiness == 1.0:
        return float(scipy_stats.kstest(gaps, "expon", args=(0.0, 1.0 / rate)).pvalue)
    return float(scipy_stats.kstest(gaps, "gamma", args=(burstiness, 0.0, 1.0 / (rate * burstiness))).pvalue)


def client_validity(client_fell_behind: bool, arrival_pvalue: float) -> dict[str, bool]:
    """``arrival_fit_rejected`` and ``client_valid`` of a serving run.

    The fit is rejected when the KS p-value of the dispatched arrivals is below
    ``ARRIVAL_KS_ALPHA`` (NaN — not a Poisson or gamma run — is not a rejection). A run is valid when
    the client kept its schedule (``not client_fell_behind``) and its arrivals fit; an invalid
    run measured another load than the one asked for, so the gate must not trust it.
    """
    rejected = bool(not math.isnan(arrival_pvalue) and arrival_pvalue < ARRIVAL_KS_ALPHA)
    return {"arrival_fit_rejected": rejected, "client_valid": bool(not client_fell_behind and not rejected)}


def _concat(lists: Iterable[Any]) -> np.ndarray:
    arrays = [np.asarray(item, dtype=float) for item in lists if isinstance(item, (list, tuple, np.ndarray))]
    return np.concatenate(arrays) if arrays else np.zeros(0)


def summarize_serving(requests: pd.DataFrame, duration_s: float, *, slo_ttft_ms: float | None = None,
                      slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None,
                      max_dispatch_lag_p99_ms: float = 50.0) -> dict[str, Any]:
    """The ``serving_summary`` row from the ``serving_requests`` table.

    Throughputs divide by ``duration_s`` (first scheduled send to last completion). TTFT and
    E2E need at least one successful request, else ``InsufficientDataError``. TPOT and ITL
    exist only for outputs of two or more tokens; when no request had one they are NaN
    (not applicable, never 0) and ``tpot_itl_applicable`` is False. ``goodput`` is NaN when
    no SLO is set. Dispatch lag is over every request (client health does not depend on
    the server's answer).
    """
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise InsufficientDataError(f"benchmark duration {duration_s!r} s is not a positive number; "
                                    f"no request was timed")
    ok = requests[requests["success"].astype(bool)]
    n_ok = int(len(ok))
    if n_ok == 0:
        raise InsufficientDataError(f"all {len(requests)} requests failed; no latency can be computed. "
                                    f"First error: {_first_error(requests)}")
    total_in = int(ok["input_tokens"].fillna(0).sum())
    total_out = int(ok["output_tokens"].fillna(0).sum())
    row: dict[str, Any] = {
        "completed": n_ok,
        "failed": int(len(requests) - n_ok),
        "duration_s": float(duration_s),
        "request_throughput": n_ok / duration_s,
        "input_throughput": total_in / duration_s,
        "output_throughput": total_out / duration_s,
        "total_throughput": (total_in + total_out) / duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        # SGLang's "concurrency": mean number of requests in flight.
        "concurrency": float(ok["e2e_latency_ms"].sum() / 1000.0 / duration_s),
    }
    row.update(latency_block("ttft", ok["ttft_ms"].to_numpy(dtype=float)))
    row.update(latency_block("e2e_latency", ok["e2e_latency_ms"].to_numpy(dtype=float)))
    tpots = ok["tpot_ms"].to_numpy(dtype=float)
    itls = _concat(ok["itls_ms"])
    applicable = bool(np.any(~np.isnan(tpots))) and len(itls) > 0
    row["tpot_itl_applicable"] = applicable
    for name, values in (("tpot", tpots), ("itl", itls)):
        if applicable:
            row.update(latency_block(name, values))
        else:
            row.update({f"{stat}_{name}_ms": math.nan for stat in (*STAT_NAMES, "max")})
    if any(s is not None for s in (slo_ttft_ms, slo_tpot_ms, slo_e2e_ms)):
        good = goodput_mask(requests, slo_ttft_ms, slo_tpot_ms, slo_e2e_ms)
        row["goodput"] = int(good.sum()) / duration_s
        row["good_completed"] = int(good.sum())
    else:
        row["goodput"] = math.nan
        row["good_completed"] = math.nan
    lag = describe(requests["dispatch_lag_ms"].to_numpy(dtype=float), "dispatch lag (ms)")
    row["dispatch_lag_p50_ms"] = lag["median"]
    row["dispatch_lag_p99_ms"] = lag["p99"]
    row["dispatch_lag_max_ms"] = lag["max"]
    row["client_fell_behind"] = bool(lag["p99"] > max_dispatch_lag_p99_ms)
    return row


def _first_error(requests: pd.DataFrame) -> str:
    errors = requests.loc[~requests["success"].astype(bool), "error"].dropna()
    return str(errors.iloc[0]) if len(errors) else "(none recorded)"
