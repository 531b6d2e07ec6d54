"""Server-mode one-batch benchmark (SGLang's ``bench_one_batch_server``), for every engine.

For each case of the grid ``batch_size x input_len x output_len``: read the server's
capacity, skip the case (a row with its reason, never a gap) when it cannot fit, else send
ONE batched, streamed request of ``batch_size`` prompts of exactly ``input_len`` random
token ids with ``max_new_tokens=output_len``, ``ignore_eos`` and temperature 0, and time it.

Protocols (one HTTP request per case in both, like SGLang's script):

- native: ``POST /generate`` with ``input_ids`` as a list of lists; SGLang streams one chunk
  per prompt ``index`` with a cumulative ``completion_tokens``.
- openai: ``POST /v1/completions`` with ``prompt`` as a list of token-id lists (one choice per
  prompt, ``choices[*].index``), as SGLang's script does for vLLM. A single batched request,
  not ``batch_size`` concurrent streams, so that both protocols hand the scheduler the whole
  batch at once and the numbers stay comparable.

Formulas (SGLang's): ``last_ttft`` = time until every prompt has its first token;
``input_throughput = bs*input_len/last_ttft``; ``output_throughput = output_tokens /
(latency - last_ttft)`` (NaN when there is no decode window, i.e. ``output_len == 1``);
``overall_throughput = (bs*input_len + output_tokens)/latency``. ``output_tokens`` is the
server's own count (``completion_tokens``/``usage``), ``bs*output_len`` when it gives none.

The server's counts are checked first (``WireProtocol.batch_tally``; the rules are in
``protocol``'s modules): a prompt
reported with more than ``output_len`` tokens, a batch with more than ``bs*output_len``, or a
native count that disagrees with the ``output_ids`` streamed makes the case a ``failed`` row
naming the disagreement, never a measured one. Every request (server info aside, which the
engine reads) is bounded from send to last byte by ``one_batch.request_timeout_s``; a case
that passes it is a ``failed`` row saying so.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any, Final

import numpy as np
import pandas as pd
import requests

from servegate.bench.datasets import random_token_ids
from servegate.bench.protocol import SSE_DONE, WireProtocol, parse_sse_line, protocol_for
from servegate.config import OneBatchConfig
from servegate.engines.base import Engine, ServerCapacity
from servegate.errors import StageError
from servegate.http import make_session, stream_within
from servegate.tables import ONE_BATCH_COLUMNS

__all__ = ["run_one_batch", "capacity_skip_reason"]

_TABLE: Final = "one_batch"

def capacity_skip_reason(batch_size: int, input_len: int, output_len: int, cap: ServerCapacity,
                         skip_token_capacity_check: bool) -> str | None:
    """Why a case cannot run on this server, or None when it fits.

    The running-requests limit applies even with ``skip_token_capacity_check``: a batch
    larger than it is split by the scheduler, so it would not be one batch at all.
    """
    if batch_size > cap.max_running_requests:
        return (f"batch_size {batch_size} > max running requests {_fmt(cap.max_running_requests)} "
                f"(effective_max_running_requests_per_dp * dp_size)")
    needed = batch_size * (input_len + output_len)
    if not skip_token_capacity_check and needed > cap.token_capacity:
        return (f"batch_size*(input_len+output_len) = {needed} > token capacity "
                f"{_fmt(cap.token_capacity)}; set one_batch.skip_token_capacity_check to run it anyway")
    return None


def _fmt(x: float) -> str:
    return str(int(x)) if math.isfinite(x) else "inf"


def _row(run_name: str, protocol: str, bs: int, il: int, ol: int, cap: ServerCapacity | None,
         **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {c: math.nan for c in ONE_BATCH_COLUMNS}
    row.update(run_name=run_name, mode="server", protocol=protocol, batch_size=bs, input_len=il,
               output_len=ol, repeat=0, skip_reason=None, error=None, total_output_tokens=math.nan,
               token_capacity=cap.token_capacity if cap else math.nan,
               max_running_requests=cap.max_running_requests if cap else math.nan)
    row.update(values)
    return row


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=ONE_BATCH_COLUMNS)


def run_one_batch(base_url: str, engine: Engine, cfg: OneBatchConfig, api_key: str | None = None, *,
                  session: requests.Session | None = None, run_name: str = "default",
                  partial: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Run the grid and return the ``one_batch`` table (one row per case and repeat; a skipped
    case has one row).

    A case the server rejects (HTTP error, error chunk, incomplete stream, deadline passed, token
    counts that disagree with the stream) is a ``failed`` row with the error. When the server
    stops answering (connection refused or dropped) ``ServerUnreachableError`` is raised.
    ``partial`` (when given) holds ``{"one_batch": rows so far}`` however the run ends, so that
    nothing measured is lost. A ``session`` given by the caller must carry the API key
    (``make_session``).
    """
    base_url = base_url.rstrip("/")
    wire = protocol_for(engine)
    own_session = session is None
    http = session or make_session(api_key)
    rows: list[dict[str, Any]] = []
    model: str | None = None
    try:
        for bs, il, ol in itertools.product(cfg.batch_sizes, cfg.input_lens, cfg.output_lens):
            cap = engine.server_capacity(http, base_url)
            reason = capacity_skip_reason(bs, il, ol, cap, cfg.skip_token_capacity_check)
            if reason is not None:
                rows.append(_row(run_name, wire.name, bs, il, ol, cap, status="skipped", skip_reason=reason))
                continue
            if model is None:
                model = wire.served_model(http, base_url, limit_s=min(cfg.request_timeout_s, 30.0),
                                          setting="one_batch.request_timeout_s")
            for repeat in range(cfg.repeats):
                # A per-case (and per-repeat) seed: re-running one case alone sends the same prompts,
                # and a repeat never finds its prompts in the prefix cache.
                seed = [cfg.seed, bs, il, ol] + ([repeat] if repeat else [])
                prompts = random_token_ids(np.random.default_rng(seed), bs, il)
                row = _measure(http, base_url, wire, model, prompts, bs, il, ol, cap, cfg, run_name)
                rows.append(row | {"repeat": repeat})
    finally:
        if partial is not None:
            partial[_TABLE] = _frame(rows)
        if own_session:
            http.close()
    return _frame(rows)


def _measure(http: requests.Session, base_url: str, wire: WireProtocol, model: str | None,
             prompts: list[list[int]], bs: int, il: int, ol: int, cap: ServerCapacity,
             cfg: OneBatchConfig, run_name: str) -> dict[str, Any]:
    url = wire.url(base_url)
    body = wire.body(prompts, ol, model=model, stream=True)

    def failed(error: str) -> dict[str, Any]:
        return _row(run_name, wire.name, bs, il, ol, cap, status="failed", error=error)

    tally = wire.batch_tally(bs, ol)
    saw_done = False
    case = f"batch_size={bs} input_len={il} output_len={ol}"
    tic = time.perf_counter()
    try:
        with stream_within(http, "POST", url, limit_s=cfg.request_timeout_s, what=f"one_batch case {case} (POST {url})",
                           setting="one_batch.request_timeout_s", json=body,
                           hint=f"the server went away during {case}: the worker is gone — check its log") as resp:
            if resp.status_code != 200:
                return failed(f"POST {url} answered HTTP {resp.status_code}: {resp.text[:500]}")
            # chunk_size=None: hand each HTTP chunk over as it arrives, so TTFT is not delayed
            # by a client-side read buffer.
            for line in resp.iter_lines(chunk_size=None):
                data = parse_sse_line(line)
                if data is None:
                    continue
                if data is SSE_DONE:
                    saw_done = True
                    break
                tally.take(data, time.perf_counter())  # type: ignore[arg-type]
        latency = time.perf_counter() - tic
        if saw_done:
            tally.check(case)
    except StageError as exc:
        return failed(str(exc))
    first_token_at = tally.first_token_at
    if not saw_done:
        return failed(f"stream ended before [DONE] ({len(first_token_at)}/{bs} prompts started)")
    missing = sorted(set(range(bs)) - set(first_token_at))
    if missing:
        return failed(f"no stream chunk for prompt indices {missing[:20]} of {bs}")

    total_out = tally.output_tokens()
    last_ttft = max(first_token_at.values()) - tic
    first_ttft = min(first_token_at.values()) - tic
    decode_window = latency - last_ttft
    output_throughput = total_out / decode_window if ol > 1 and decode_window > 0 else math.nan
    return _row(
        run_name, wire.name, bs, il, ol, cap, status="measured",
        latency=latency, last_ttft=last_ttft, ttft_ms=last_ttft * 1000.0, first_ttft_ms=first_ttft * 1000.0,
        input_throughput=bs * il / last_ttft, output_throughput=output_throughput,
        overall_throughput=(bs * il + total_out) / latency, total_output_tokens=total_out,
    )
