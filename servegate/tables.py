"""The tables a gate run produces: their names, the stage that produces each, and their columns.

This is the contract of ``docs/contracts.md`` ("Tables") as data, written once: the stages build
their frames with these column lists, the expectation suites are checked against them before a
gate launches anything (a suite naming a column no stage writes fails at once, not after an hour
of measurement), and the verdict knows which stage each table comes from.

Tables whose columns are built from data (none today) would list ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["TableSpec", "TABLES", "KNOWN_TABLES", "TABLE_STAGE", "columns", "ONE_BATCH_COLUMNS",
           "OFFLINE_ONE_BATCH_COLUMNS", "REQUEST_COLUMNS", "SERVING_SUMMARY_COLUMNS", "SAMPLE_COLUMNS",
           "OCCUPANCY_SUMMARY_COLUMNS", "COMPARISON_COLUMNS", "ACCURACY_COLUMNS", "ITEM_COLUMNS",
           "AGREEMENT_COLUMNS", "AGREEMENT_ROW_COLUMNS", "PAIRED_COLUMNS", "PAIRED_ROUND_COLUMNS",
           "PAIRED_WORKER_COLUMNS", "PAIRED_PROFILE_COLUMNS", "PROFILE_OPS_COLUMNS", "CAPACITY_STEP_COLUMNS",
           "CAPACITY_COLUMNS", "WORKER_COLUMNS", "COST_COLUMNS"]

WORKER_COLUMNS: Final = ["engine", "startup_s", "ready_rss_mib", "peak_rss_mib", "rss_samples",
                          "rss_sample_interval_s", "peak_through"]
"""``worker``: the gate's worker, one row. ``startup_s`` from the launch (just before the process starts)
to the first ready probe; ``ready_rss_mib`` the resident memory of the worker's whole process tree when it
was ready, ``peak_rss_mib`` its high-water mark from the launch through the end of the stage ``peak_through``
(sampled every ``rss_sample_interval_s`` with psutil, ``rss_samples`` samples; refreshed after each stage on
the worker). NaN for an attached ``external`` server (no process of the gate's)."""
COST_COLUMNS: Final = ["price_per_hour", "currency", "output_throughput", "cost_per_mtok_output"]
"""``cost`` (only with ``[cost] price_per_hour``): ``cost_per_mtok_output`` = what 10**6 output tokens cost at
the serving load's ``output_throughput`` (tok/s) on a machine costing ``price_per_hour`` (``currency``)."""

ONE_BATCH_COLUMNS: Final = [
    "run_name", "mode", "protocol", "batch_size", "input_len", "output_len", "repeat", "status", "skip_reason",
    "latency", "last_ttft", "ttft_ms", "first_ttft_ms", "input_throughput", "output_throughput",
    "overall_throughput", "total_output_tokens", "prefill_latency", "median_decode_latency",
    "token_capacity", "max_running_requests", "error",
]
OFFLINE_ONE_BATCH_COLUMNS: Final = [
    "run_name", "mode", "batch_size", "input_len", "output_len", "repeat", "status", "skip_reason", "error",
    "prefill_latency", "prefill_throughput", "median_decode_latency", "median_decode_throughput",
    "latency", "last_ttft", "ttft_ms", "input_throughput", "output_throughput", "overall_throughput",
]
"""``one_batch`` in offline mode (the table of docs/contracts.md plus SGLang's bench_one_batch extras)."""

REQUEST_COLUMNS: Final = [
    "request_id", "input_tokens", "planned_input_tokens", "output_tokens", "planned_output_tokens",
    "scheduled_send_s", "dispatched_s", "actual_send_s", "dispatch_lag_ms", "queue_wait_ms",
    "ttft_ms", "e2e_latency_ms", "tpot_ms", "itls_ms", "finished_s", "success", "error", "error_kind",
]

_LATENCY_STATS = ("mean", "median", "std", "p90", "p95", "p99", "max", "es_p90", "es_p95", "es_p99")
"""``es_pNN``: the early-stopping estimate of that percentile next to the empirical ``pNN``
(:mod:`servegate.early_stopping`, MLPerf LoadGen's rule: the order statistic the sample count supports at
99 % confidence); NaN below its floor (64 samples for p90, 130 for p95, 662 for p99)."""


def _latency(name: str) -> list[str]:
    return [f"{stat}_{name}_ms" for stat in _LATENCY_STATS]


SERVING_SUMMARY_COLUMNS: Final = [
    "completed", "failed", "duration_s", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "total_input_tokens", "total_output_tokens", "concurrency",
    *_latency("ttft"), *_latency("e2e_latency"), "tpot_itl_applicable", *_latency("tpot"), *_latency("itl"),
    "goodput", "good_completed", "dispatch_lag_p50_ms", "dispatch_lag_p99_ms", "dispatch_lag_max_ms",
    "client_fell_behind", "connection_errors", "arrival_ks_pvalue", "scheduled_arrival_ks_pvalue",
    "arrival_fit_rejected", "client_valid", "arrival", "request_rate", "max_concurrency", "protocol", "num_prompts",
    "dataset", "burstiness", "prompt_tokens_scraped", "cached_tokens", "prefix_cache_hit_rate",
]
"""``prompt_tokens_scraped`` / ``cached_tokens``: the worker's own prompt-token and cached-token counters
over the load (scraped before and after; NaN where the engine exposes none), ``prefix_cache_hit_rate``
their ratio."""

SAMPLE_COLUMNS: Final = ["t_s", "fwd_occupancy", "spec_accept_length", "token_usage", "num_running_reqs",
                         "num_queue_reqs", "kv_cache_usage"]
OCCUPANCY_SUMMARY_COLUMNS: Final = [
    "n_samples", "n_scrapes", "n_requests", "fwd_occupancy_applicable", "fwd_occupancy_median", "fwd_occupancy_min",
    "spec_accept_length_median", "token_usage_max", "num_running_reqs_max", "num_queue_reqs_max",
    "kv_cache_usage_max", "speculative_decoding",
]

COMPARISON_COLUMNS: Final = [
    "metric", "table", "case", "statistic", "unit", "direction",
    "baseline_median", "current_median", "baseline_value", "current_value",
    "ratio", "ci_low", "ci_high", "confidence", "n_baseline", "n_current", "n_baseline_runs",
    "bound", "gated", "decision", "reason", "baseline_policy", "baseline_runs", "run_sd",
    "false_alarm_upper95", "min_detectable",
]
"""``run_sd``: the between-run noise term used; ``false_alarm_upper95`` and ``min_detectable``:
the key's latest ``servegate calibrate`` figures for the row (NaN when uncalibrated)."""

ACCURACY_COLUMNS: Final = ["n_items", "n_correct", "accuracy", "accuracy_stderr", "accuracy_unnormalised",
                           "normalisation", "dataset", "dataset_sha256", "protocol", "duration_s"]
ITEM_COLUMNS: Final = ["item_index", "label", "predicted", "correct", "scores", "sum_logprobs",
                       "n_ending_tokens", "n_ending_bytes"]
AGREEMENT_COLUMNS: Final = ["n_prompts", "exact_match_tokens", "exact_match_rate", "n_tokens_compared",
                            "mean_abs_logprob_diff", "max_abs_logprob_diff", "logprob_tolerance",
                            "within_tolerance_rate", "reference_source", "reference_model", "duration_s"]
AGREEMENT_ROW_COLUMNS: Final = ["prompt_id", "n_compared", "first_mismatch_index", "exact_match",
                                "logprob_comparison", "n_logprobs_compared", "mean_abs_logprob_diff",
                                "max_abs_logprob_diff", "max_greedy_gap", "within_tolerance", "worker_output_ids",
                                "reference_output_ids"]

CAPACITY_STEP_COLUMNS: Final = [
    "step", "phase", "request_rate", "num_prompts", "completed", "failed", "good_completed", "goodput_fraction",
    "meets_target", "p90_ttft_ms", "p90_tpot_ms", "p90_e2e_latency_ms", "output_throughput", "client_valid",
    "duration_s",
]
"""``capacity_steps``: one row per load of the sweep (phase ``grow`` or ``refine``)."""
CAPACITY_COLUMNS: Final = [
    "capacity_rps", "capacity_bound", "goodput_target", "last_good_rate", "first_bad_rate", "steps",
    "slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms", "duration_s",
]
"""``capacity``: the highest request rate whose goodput met the target (``capacity_bound``: ``found``,
``at_least_max`` when max_rate still met it, ``below_start`` when the first rate failed: capacity 0)."""

PAIRED_COLUMNS: Final = [
    "metric", "column", "unit", "direction", "gated", "rounds", "baseline_median", "candidate_median", "ratio",
    "ci_low", "ci_high", "confidence", "bound", "sd_log", "decision", "paired_decision", "reason",
    "stopped_because", "measure_s", "instances", "mode", "order", "rounds_per_worker", "method",
]
"""``paired``: one row per metric, ratio = candidate / baseline over rounds (geometric mean), its
repeated confidence interval (valid at every look), and ``decision`` (``report_only`` for metrics that are not gated;
``paired_decision`` holds what the interval says for every metric)."""
PAIRED_ROUND_COLUMNS: Final = [
    "round", "instance", "order", "metric", "a_value", "b_value", "log_ratio", "ratio", "ci_low", "ci_high",
    "decision", "block_s", "kept_busy_s",
]
"""``paired_rounds``: per round and metric, A's (baseline) and B's (candidate) block values and the
interval as it stood after that round; ``block_s`` the round's wall time, ``kept_busy_s`` (duet) how long
the side whose block ended first was kept busy until the other's ended (0 in ``interleaved``)."""
PAIRED_WORKER_COLUMNS: Final = ["side", "instance", "engine", "model", "python", "extra_args", "cpus", "pid",
                                "build", "launch_s", "warmup_s", "pair_s"]
"""``paired_workers``: every worker instance the paired stage launched (provenance and cost): ``build`` the
build its server reports (``Engine.build_identity``: the embedded worker's source digest, SGLang's or vLLM's
version; empty when the engine does not say), ``launch_s`` from its process's start to ready, ``warmup_s`` its warm-up; ``pair_s`` the wall time its instance pair
took, from stopping the previous pair to both ready and warm (the two start up side by side): what a
restart costs the measurement, the same on both rows of a pair."""
PAIRED_PROFILE_COLUMNS: Final = ["side", "engine", "status", "traces", "trace_bytes", "requests", "profile_s",
                                 "itl_median_ms", "reason"]
"""``paired_profiles`` (``paired.profile``, after a confirmed regression): one row per side, ``status``
``recorded`` (``traces``: a JSON list of the trace files, relative to the run folder), ``not_applicable``
(the engine has no profiler endpoints) or ``failed``; ``reason`` says why. ``requests``: the block of
requests sent while profiling; ``profile_s`` from start to the trace on disk; ``itl_median_ms`` that
block's median inter-token latency (against the ``paired`` medians: what profiling cost)."""
PROFILE_OPS_COLUMNS: Final = ["op", "calls_a", "calls_b", "self_ms_a", "self_ms_b", "delta_ms", "ratio"]
"""``profile_ops``: per operator of either trace, its calls and self time (less nested operators) in the
baseline's (a) and the candidate's (b) profile of the same requests, ``delta_ms`` = b - a and ``ratio`` =
b / a (inf: only b ran it), largest slow-down first (:mod:`servegate.profiling`)."""


@dataclass(frozen=True)
class TableSpec:
    """One table: its name, the stage (as in stages.json) that produces it, its columns."""

    name: str
    stage: str
    columns: tuple[str, ...]
    """Every column the stage may write; the offline one_batch table adds its own (see ``columns``)."""


TABLES: Final[dict[str, TableSpec]] = {t.name: t for t in (
    TableSpec("worker", "launch", tuple(WORKER_COLUMNS)),
    TableSpec("one_batch", "one_batch", tuple(dict.fromkeys([*ONE_BATCH_COLUMNS, *OFFLINE_ONE_BATCH_COLUMNS]))),
    TableSpec("serving_requests", "serving", tuple(REQUEST_COLUMNS)),
    TableSpec("serving_summary", "serving", tuple(SERVING_SUMMARY_COLUMNS)),
    TableSpec("cost", "serving", tuple(COST_COLUMNS)),
    TableSpec("occupancy_samples", "occupancy", tuple(SAMPLE_COLUMNS)),
    TableSpec("occupancy_summary", "occupancy", tuple(OCCUPANCY_SUMMARY_COLUMNS)),
    TableSpec("comparison", "compare", tuple(COMPARISON_COLUMNS)),
    TableSpec("quality_accuracy", "quality", tuple(ACCURACY_COLUMNS)),
    TableSpec("quality_items", "quality", tuple(ITEM_COLUMNS)),
    TableSpec("quality_agreement", "quality", tuple(AGREEMENT_COLUMNS)),
    TableSpec("quality_agreement_rows", "quality", tuple(AGREEMENT_ROW_COLUMNS)),
    TableSpec("capacity_steps", "capacity", tuple(CAPACITY_STEP_COLUMNS)),
    TableSpec("capacity", "capacity", tuple(CAPACITY_COLUMNS)),
    TableSpec("paired", "paired", tuple(PAIRED_COLUMNS)),
    TableSpec("paired_rounds", "paired", tuple(PAIRED_ROUND_COLUMNS)),
    TableSpec("paired_workers", "paired", tuple(PAIRED_WORKER_COLUMNS)),
    TableSpec("paired_profiles", "paired", tuple(PAIRED_PROFILE_COLUMNS)),
    TableSpec("profile_ops", "paired", tuple(PROFILE_OPS_COLUMNS)),
)}

KNOWN_TABLES: Final = tuple(TABLES)
"""Tables a suite may name."""
TABLE_STAGE: Final = {name: spec.stage for name, spec in TABLES.items()}
"""The stage that produces each table (stage names as in stages.json)."""


def columns(table: str) -> tuple[str, ...]:
    """The columns ``table`` may have (KeyError for an unknown table)."""
    return TABLES[table].columns
