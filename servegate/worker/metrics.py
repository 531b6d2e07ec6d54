"""Prometheus metrics of the embedded worker, named and labelled as SGLang exports them.

Scheduler-side gauges carry SGLang's scheduler labels (``model_name``, ``engine_type``,
``tp_rank``, ``pp_rank``); request counters and latency histograms carry the tokenizer
manager's ``model_name``, with SGLang's default histogram buckets. Everything lives in one
private ``CollectorRegistry`` so that two workers in one process never collide.
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["WorkerMetrics", "OccupancyWindow", "ThroughputWindow", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# SGLang's TokenizerMetricsCollector defaults.
TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
               0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]


class OccupancyWindow:
    """Share of wall time spent inside forward passes over a window of decode steps.

    Like SGLang's device timer: the value is published when ``window_steps`` decode steps
    have completed and covers exactly that window; a window restarted by a prefill or by
    the scheduler going idle starts over and the gauge reads NaN until it completes.
    """

    def __init__(self, window_steps: int) -> None:
        self.window_steps = window_steps
        self._start: float | None = None
        self._busy = 0.0
        self._steps = 0
        self.value = math.nan

    def restart(self) -> None:
        """Begin a fresh window (after a prefill or idle): the gauge reads NaN until it completes."""
        self._start = None
        self._busy = 0.0
        self._steps = 0
        self.value = math.nan

    def record_decode(self, step_start: float, forward_s: float, step_end: float) -> bool:
        """Count one decode step; True when a window completed and ``value`` was updated."""
        if self._start is None:
            self._start = step_start
        self._busy += forward_s
        self._steps += 1
        if self._steps < self.window_steps:
            return False
        wall = step_end - self._start
        self.value = 100.0 * self._busy / wall if wall > 0 else math.nan
        self._start = step_end
        self._busy = 0.0
        self._steps = 0
        return True


class ThroughputWindow:
    """Generated tokens per second over a window of decode steps (SGLang's ``gen_throughput``).

    ``value`` keeps the last completed window's rate (0.0 before the first one); server info
    reports it as ``last_gen_throughput``. A restart (prefill, idle) only begins a new window:
    unlike occupancy, the last rate stays published.
    """

    def __init__(self, window_steps: int) -> None:
        self.window_steps = window_steps
        self._start: float | None = None
        self._tokens = 0
        self._steps = 0
        self.value = 0.0

    def restart(self) -> None:
        """Begin a fresh window at the next decode step."""
        self._start = None

    def record_decode(self, step_start: float, tokens: int, step_end: float) -> bool:
        """Count one decode step that produced ``tokens``; True when a window completed and ``value`` was updated."""
        if self._start is None:
            self._start = step_start
            self._tokens = 0
            self._steps = 0
        self._tokens += tokens
        self._steps += 1
        if self._steps < self.window_steps:
            return False
        elapsed = step_end - self._start
        updated = elapsed > 0
        if updated:
            self.value = self._tokens / elapsed
        self._start = step_end
        self._tokens = 0
        self._steps = 0
        return updated

class WorkerMetrics:
    """The worker's metrics; when disabled every method is a cheap no-op."""

    def __init__(self, model_name: str, *, enabled: bool, occupancy_fault: str | None = None,
                 speculative: bool = False) -> None:
        self.enabled = enabled
        self.registry = CollectorRegistry(auto_describe=True)
        self._occupancy_fault = occupancy_fault
        if not enabled:
            return
        sched = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        tok = {"model_name": model_name}
        names = list(sched)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=names, registry=reg).labels(**sched)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens",
                                          "Maximum total number of tokens in the KV cache pool.")
        self.spec_accept_length = gauge("sglang:spec_accept_length",
                                        "The average acceptance length of speculative decoding.")
        self.fwd_occupancy = None
        if occupancy_fault != "absent":
            self.fwd_occupancy = gauge("sglang:fwd_occupancy", "Forward-pass occupancy percentage.")
            self.fwd_occupancy.set(math.nan)
        # 0 with speculation off, as SGLang; with it, NaN until the first window closes (no passes yet is
        # no measurement, and the occupancy scrape drops NaN).
        self.spec_accept_length.set(math.nan if speculative else 0.0)

        tok_names = list(tok)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames=tok_names, registry=reg).labels(**tok)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labelnames=tok_names, buckets=buckets, registry=reg).labels(**tok)

        # prometheus_client appends the "_total" suffix to counters itself.
        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests", "Number of requests processed.")
        self.ttft = histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", E2E_BUCKETS)

    def set_scheduler_state(self, *, running: int, queued: int, used_tokens: int, capacity: int) -> None:
        if not self.enabled:
            return
        self.num_running_reqs.set(running)
        self.num_queue_reqs.set(queued)
        self.num_used_tokens.set(used_tokens)
        self.token_usage.set(used_tokens / capacity if capacity else 0.0)
        self.max_total_num_tokens.set(capacity)

    def set_gen_throughput(self, tok_per_s: float) -> None:
        if self.enabled:
            self.gen_throughput.set(tok_per_s)

    def set_cache_hit_rate(self, rate: float) -> None:
        if self.enabled:
            self.cache_hit_rate.set(rate)

    def set_spec_accept_length(self, value: float) -> None:
        if self.enabled:
            self.spec_accept_length.set(value)

    def set_occupancy(self, value: float) -> None:
        if self.enabled and self.fwd_occupancy is not None:
            self.fwd_occupancy.set(math.nan if self._occupancy_fault == "nan" else value)

    def observe_first_token(self, ttft_s: float) -> None:
        if self.enabled:
            self.ttft.observe(ttft_s)

    def observe_inter_token(self, itl_s: float) -> None:
        if self.enabled:
            self.itl.observe(itl_s)

    def observe_finished(self, *, prompt_tokens: int, generation_tokens: int, cached_tokens: int,
                         e2e_s: float) -> None:
        if not self.enabled:
            return
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        if cached_tokens > 0:
            self.cached_tokens.inc(cached_tokens)
        self.num_requests.inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def now() -> float:
    """Monotonic seconds (one clock for every latency the worker measures)."""
    return time.perf_counter()
