"""Forward-occupancy scrape: a long request in the background, ``/metrics`` scraped meanwhile.

The load is one request of ``occupancy.max_new_tokens``; when it finished before
``occupancy.min_samples`` scrapes read a value (a fast CPU decodes 128 tokens in under two
seconds, and the gauge reads NaN until its first window of decode steps completes), the same
request is sent again, up to ``occupancy.max_requests`` in all. A token budget sized on one
machine thus still yields its samples on a faster one, and ``n_requests`` says how many it took.

``sglang:fwd_occupancy`` is the percent of wall time the scheduler spent in forward passes
over a window; it reads NaN at each window's start, so NaN samples are dropped. With
several ranks (one label set per ``tp_rank``/``dp_rank``) the scrape keeps the MIN
occupancy — one degraded rank stalls the whole batch and must show — and the MAX of token
usage and running/queued requests. The summary is the median over scrapes.

Speculative accept length: SGLang (and the embedded worker) export a gauge,
``sglang:spec_accept_length``, per decode-log window; vLLM exports counters instead
(``vllm:spec_decode_num_accepted_tokens`` / ``_num_drafts``), so for an engine that declares
``spec_decode_counters`` each scrape interval's accept length is ``1 + d(accepted) / d(drafts)``
summed over engines (NaN when no draft was verified in the interval).

The page is parsed with ``prometheus_client``'s text parser. Scrapes are paced with
``threading.Event.wait`` on the request's completion event, so the loop ends the moment the
request finishes instead of sleeping through a last interval.

Every request is bounded from send to last byte, not per read: the long request by
``occupancy.request_timeout_s``, each scrape by a fixed ``SCRAPE_DEADLINE_S``. The long
request is built by the engine's ``WireProtocol``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pandas as pd
import requests
from prometheus_client.parser import text_string_to_metric_families

from servegate.bench.protocol import protocol_for
from servegate.config import OccupancyConfig
from servegate.engines.base import Engine
from servegate.errors import (
    InfraError,
    InsufficientDataError,
    MetricsError,
    ServerUnreachableError,
    StageError,
)
from servegate.http import make_session, request_within
from servegate.tables import SAMPLE_COLUMNS

_SAMPLES_TABLE: Final = "occupancy_samples"

__all__ = [
    "SCRAPE_DEADLINE_S",
    "OccupancyResult",
    "parse_metrics_page",
    "aggregate_scrape",
    "counter_totals",
    "accept_length_between",
    "scrape_metrics",
    "run_occupancy",
]

SCRAPE_DEADLINE_S: Final = 10.0
"""A ``/metrics`` page answers in milliseconds; one that takes this long is a stalled server."""

# How label sets (ranks) combine into one value per scrape.
_AGGREGATE: Final[dict[str, Callable[[list[float]], float]]] = {
    "fwd_occupancy": min,        # a single degraded rank must show
    "spec_accept_length": min,   # likewise: the worst rank's drafts bound the batch
    "token_usage": max,
    "num_running_reqs": max,
    "num_queue_reqs": max,
    "kv_cache_usage": max,
}


@dataclass
class OccupancyResult:
    samples: pd.DataFrame
    """``occupancy_samples``: one row per scrape, NaN where a gauge was absent or NaN."""
    summary: pd.DataFrame
    """``occupancy_summary``: one row."""


def parse_metrics_page(text: str, url: str) -> dict[str, list[float]]:
    """Sample name -> values over all label sets (NaN kept), from a Prometheus text page."""
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values.setdefault(sample.name, []).append(float(sample.value))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError(f"{url} is not a valid Prometheus text page ({exc}); check that the URL is "
                           f"the server's /metrics endpoint") from exc
    return values


def aggregate_scrape(values: dict[str, list[float]], metric_names: dict[str, str]) -> dict[str, float]:
    """One scrape -> one value per logical metric (NaN when absent or NaN on every rank)."""
    out: dict[str, float] = {}
    for logical, combine in _AGGREGATE.items():
        name = metric_names.get(logical)
        finite = [v for v in values.get(name, []) if not math.isnan(v)] if name else []
        out[logical] = float(combine(finite)) if finite else math.nan
    return out


def counter_totals(values: dict[str, list[float]], counters: dict[str, str]) -> dict[str, float]:
    """Each counter's value summed over its label sets (engines, ranks); NaN when absent."""
    out: dict[str, float] = {}
    for logical, name in counters.items():
        finite = [v for v in values.get(name, []) if not math.isnan(v)]
        out[logical] = float(sum(finite)) if finite else math.nan
    return out


def accept_length_between(before: dict[str, float], after: dict[str, float]) -> float:
    """Mean speculative accept length between two scrapes of vLLM's counters: ``1 + d(accepted) /
    d(drafts)`` (vLLM's own definition, bonus token included: vllm/v1/spec_decode/metrics.py).

    NaN when no draft was verified in between (idle, or speculation off), when a counter is absent,
    or when a counter went back (the server restarted): no drafts is no measurement, never 1.
    """
    accepted = after.get("accepted", math.nan) - before.get("accepted", math.nan)
    drafts = after.get("drafts", math.nan) - before.get("drafts", math.nan)
    if math.isnan(accepted) or math.isnan(drafts) or drafts <= 0 or accepted < 0:
        return math.nan
    return 1.0 + accepted / drafts


def scrape_metrics(session: requests.Session, base_url: str, engine: Engine,
                   timeout_s: float = SCRAPE_DEADLINE_S) -> dict[str, list[float]]:
    """GET ``/metrics`` once, within ``timeout_s`` from send to last byte (one retry on a
    connection error: scrapes may retry, measurements not; a stalled page is not retried).
    The session (``make_session``) carries the API key where the server wants one."""
    url = base_url.rstrip("/") + "/metrics"
    for attempt in (1, 2):
        try:
            resp = request_within(session, "GET", url, limit_s=timeout_s, what=f"metrics scrape GET {url}",
                                  setting=None, hint="the server is gone — check the worker's log")
            break
        except ServerUnreachableError as exc:
            if attempt == 2:
                raise ServerUnreachableError(f"GET {url} failed twice: {exc}") from exc
    if resp.status_code == 404:
        raise MetricsError(f"GET {url} answered 404: metrics are not enabled. {engine.metrics_hint}")
    if resp.status_code != 200:
        raise MetricsError(f"GET {url} answered HTTP {resp.status_code}: {resp.text[:300]}. "
                           f"{engine.metrics_hint}")
    return parse_metrics_page(resp.text, url)


class _LongRequest(threading.Thread):
    """One background request: a non-streamed generation of ``max_new_tokens`` with ignore_eos."""

    def __init__(self, url: str, body: dict[str, Any], api_key: str | None, timeout_s: float) -> None:
        super().__init__(name="occupancy-load", daemon=True)
        self.url, self.body, self.api_key, self.timeout_s = url, body, api_key, timeout_s
        self.done = threading.Event()
        self.error: InfraError | None = None

    def run(self) -> None:
        try:
            with make_session(self.api_key) as http:
                resp = request_within(http, "POST", self.url, limit_s=self.timeout_s,
                                      what=f"the occupancy load request (POST {self.url})",
                                      setting="occupancy.request_timeout_s", json=self.body,
                                      hint="the worker is gone — check its log")
            if resp.status_code != 200:
                self.error = StageError(f"the occupancy load request POST {self.url} answered HTTP "
                                        f"{resp.status_code}: {resp.text[:300]}; check the worker's log")
        except InfraError as exc:
            self.error = exc
        finally:
            self.done.set()


def _summary(samples: pd.DataFrame, applicable: bool, n_scrapes: int, n_requests: int) -> dict[str, Any]:
    def stat(col: str, fn: Callable[[np.ndarray], float]) -> float:
        v = samples[col].dropna().to_numpy(dtype=float)
        return float(fn(v)) if v.size else math.nan

    occ = samples["fwd_occupancy"].dropna()
    return {
        "n_samples": int(occ.size) if applicable else int(n_scrapes),
        "n_scrapes": int(n_scrapes),
        "n_requests": int(n_requests),
        "fwd_occupancy_applicable": applicable,
        "fwd_occupancy_median": stat("fwd_occupancy", np.median),
        "fwd_occupancy_min": stat("fwd_occupancy", np.min),
        "spec_accept_length_median": stat("spec_accept_length", np.median),
        "token_usage_max": stat("token_usage", np.max),
        "num_running_reqs_max": stat("num_running_reqs", np.max),
        "num_queue_reqs_max": stat("num_queue_reqs", np.max),
        "kv_cache_usage_max": stat("kv_cache_usage", np.max),
    }


def run_occupancy(base_url: str, engine: Engine, cfg: OccupancyConfig, api_key: str | None = None, *,
                  session: requests.Session | None = None,
                  partial: dict[str, pd.DataFrame] | None = None) -> OccupancyResult:
    """Scrape ``/metrics`` every ``cfg.scrape_interval_s`` while a long request runs, sending it again
    (up to ``cfg.max_requests`` in all) while fewer than ``cfg.min_samples`` scrapes read a value.

    Raises ``MetricsError`` (with ``engine.metrics_hint``) when ``/metrics`` is missing or
    malformed or the occupancy gauge never appears; ``InsufficientDataError`` when fewer than
    ``cfg.min_samples`` scrapes had a non-NaN occupancy. An engine without an occupancy gauge
    (no ``fwd_occupancy`` in ``engine.metric_names``, e.g. vLLM) gets the other gauges and
    ``fwd_occupancy_applicable=False`` instead of an error. ``partial`` (when given) holds
    ``{"occupancy_samples": the samples so far}`` however the run ends. A ``session`` given by
    the caller must carry the API key (``make_session``).
    """
    base_url = base_url.rstrip("/")
    wire = protocol_for(engine)
    own_session = session is None
    http = session or make_session(api_key)
    applicable = "fwd_occupancy" in engine.metric_names
    rows: list[dict[str, float]] = []
    seen: set[str] = set()  # logical metrics whose sample name appeared on some page
    n_scrapes = 0
    try:
        # Fail before loading the server when metrics are not served at all.
        first = scrape_metrics(http, base_url, engine)
        seen.update(k for k, name in engine.metric_names.items() if name in first)
        # An engine without an accept-length gauge (vLLM) has spec-decode counters: the accept length
        # of each scrape interval is derived from their increments (a windowed value, like SGLang's gauge).
        counters = engine.spec_decode_counters
        last_counts = counter_totals(first, counters)
        model = wire.served_model(http, base_url, limit_s=min(cfg.request_timeout_s, 30.0),
                                  setting="occupancy.request_timeout_s")
        body = wire.body(cfg.prompt, cfg.max_new_tokens, model=model, stream=False)
        t0 = time.perf_counter()
        n_requests = 0
        while True:
            load = _LongRequest(wire.url(base_url), body, api_key, cfg.request_timeout_s)
            load.start()
            n_requests += 1
            while not load.done.wait(cfg.scrape_interval_s):
                values = scrape_metrics(http, base_url, engine)
                n_scrapes += 1
                seen.update(k for k, name in engine.metric_names.items() if name in values)
                row = {"t_s": time.perf_counter() - t0, **aggregate_scrape(values, engine.metric_names)}
                if counters:
                    counts = counter_totals(values, counters)
                    row["spec_accept_length"] = accept_length_between(last_counts, counts)
                    last_counts = counts
                rows.append(row)
            load.join()
            if load.error is not None:
                raise load.error
            n_valued = sum(not math.isnan(r["fwd_occupancy"]) for r in rows) if applicable else n_scrapes
            if n_valued >= cfg.min_samples or n_requests >= cfg.max_requests:
                break
        samples = pd.DataFrame(rows, columns=SAMPLE_COLUMNS)
        if applicable and "fwd_occupancy" not in seen:
            raise MetricsError(f"{base_url}/metrics has no {engine.metric_names['fwd_occupancy']} gauge "
                               f"in {n_scrapes + 1} scrapes. {engine.metrics_hint}")
        summary = _summary(samples, applicable, n_scrapes, n_requests)
        if summary["n_samples"] < cfg.min_samples:
            what = "non-NaN fwd_occupancy samples" if applicable else "scrapes"
            raise InsufficientDataError(
                f"{summary['n_samples']} {what} from {base_url}/metrics (need occupancy.min_samples="
                f"{cfg.min_samples}) over {n_scrapes} scrapes of {n_requests} request(s) of "
                f"{cfg.max_new_tokens} tokens; raise occupancy.max_new_tokens or occupancy.max_requests, "
                f"or lower occupancy.scrape_interval_s, so the load outlasts more scrapes")
        return OccupancyResult(samples=samples, summary=pd.DataFrame([summary]))
    finally:
        if partial is not None:
            partial[_SAMPLES_TABLE] = pd.DataFrame(rows, columns=SAMPLE_COLUMNS)
        if own_session:
            http.close()
