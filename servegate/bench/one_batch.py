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

The server's counts are checked first (the rules are in ``protocol``'s docstring): a prompt
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

from servegate.bench import protocol as proto
from servegate.bench.datasets import random_token_ids
from servegate.config import OneBatchConfig
from servegate.engines.base import Engine, ServerCapacity
from servegate.errors import InfraError, StageError
from servegate.http import make_session, stream_within
from servegate.tables import ONE_BATCH_COLUMNS

__all__ = ["run_one_batch", "capacity_skip_reason"]

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
                  session: requests.Session | None = None, run_name: str = "default") -> pd.DataFrame:
    """Run the grid and return the ``one_batch`` table (one row per case and repeat; a skipped
    case has one row).

    A case the server rejects (HTTP error, error chunk, incomplete stream, deadline passed, token
    counts that disagree with the stream) is a ``failed`` row with the error. When the server
    stops answering (connection refused or dropped) ``ServerUnreachableError`` is raised with
    the rows measured so far attached as ``exc.partial`` (a DataFrame), so nothing measured is
    lost.
    """
    base_url = base_url.rstrip("/")
    own_session = session is None
    http = session or make_session(api_key)
    rows: list[dict[str, Any]] = []
    model: str | None = None
    try:
        for bs, il, ol in itertools.product(cfg.batch_sizes, cfg.input_lens, cfg.output_lens):
            try:
                cap = engine.server_capacity(http, base_url)
                reason = capacity_skip_reason(bs, il, ol, cap, cfg.skip_token_capacity_check)
                if reason is not None:
                    rows.append(_row(run_name, engine.protocol, bs, il, ol, cap, status="skipped",
                                     skip_reason=reason))
                    continue
                if engine.protocol == "openai" and model is None:
                    model = proto.fetch_model_name(http, base_url, api_key,
                                                   timeout_s=min(cfg.request_timeout_s, 30.0),
                                                   setting="one_batch.request_timeout_s")
                for repeat in range(cfg.repeats):
                    # A per-case (and per-repeat) seed: re-running one case alone sends the same prompts,
                    # and a repeat never finds its prompts in the prefix cache.
                    seed = [cfg.seed, bs, il, ol] + ([repeat] if repeat else [])
                    prompts = random_token_ids(np.random.default_rng(seed), bs, il)
                    row = _measure(http, base_url, engine.protocol, model, prompts, bs, il, ol, cap, cfg,
                                   api_key, run_name)
                    rows.append(row | {"repeat": repeat})
            except InfraError as exc:
                exc.partial = _frame(rows)  # type: ignore[attr-defined]
                raise
    finally:
        if own_session:
            http.close()
    return _frame(rows)


def _measure(http: requests.Session, base_url: str, protocol: str, model: str | None,
             prompts: list[list[int]], bs: int, il: int, ol: int, cap: ServerCapacity,
             cfg: OneBatchConfig, api_key: str | None, run_name: str) -> dict[str, Any]:
    url = proto.generate_url(base_url, protocol)  # type: ignore[arg-type]
    if protocol == "native":
        body = proto.native_generate_body(prompts, ol, stream=True)
    else:
        body = proto.openai_completions_body(model or "", prompts, ol, stream=True)

    def failed(error: str) -> dict[str, Any]:
        return _row(run_name, protocol, bs, il, ol, cap, status="failed", error=error)

    first_token_at: dict[int, float] = {}
    tokens: dict[int, int] = {}
    checks: dict[int, proto.NativeCountCheck] = {}
    last_ids: dict[int, int | None] = {}
    usage_completion: int | None = None
    saw_done = False
    case = f"batch_size={bs} input_len={il} output_len={ol}"
    tic = time.perf_counter()
    try:
        with stream_within(http, "POST", url, limit_s=cfg.request_timeout_s, what=f"one_batch case {case} (POST {url})",
                           setting="one_batch.request_timeout_s", json=body, headers=proto.auth_headers(api_key),
                           hint=f"the server went away during {case}: the worker is gone — check its log") as resp:
            if resp.status_code != 200:
                return failed(f"POST {url} answered HTTP {resp.status_code}: {resp.text[:500]}")
            # chunk_size=None: hand each HTTP chunk over as it arrives, so TTFT is not delayed
            # by a client-side read buffer.
            for line in resp.iter_lines(chunk_size=None):
                data = proto.parse_sse_line(line)
                if data is None:
                    continue
                if data is proto.SSE_DONE:
                    saw_done = True
                    break
                now = time.perf_counter()
                if protocol == "native":
                    events = [proto.native_event(data)]
                else:
                    events = proto.openai_events(data)
                    if not events:
                        usage_completion = proto.openai_usage(data)[1]
                for ev in events:
                    first_token_at.setdefault(ev.index, now)
                    if ev.completion_tokens is not None:
                        tokens[ev.index] = ev.completion_tokens
                        if protocol == "native":
                            checks.setdefault(ev.index, proto.NativeCountCheck()).chunk(
                                ev.completion_tokens, ev.output_ids)
                            last_ids[ev.index] = ev.output_ids
        latency = time.perf_counter() - tic
        if saw_done:
            for index, count in tokens.items():
                if index in checks:
                    checks[index].finish(count, last_ids[index])
                proto.check_count_within(count, ol, f"prompt {index} of {case}")
            if usage_completion is not None:
                proto.check_count_within(int(usage_completion), bs * ol, f"the batch {case}")
    except StageError as exc:
        return failed(str(exc))
    if not saw_done:
        return failed(f"stream ended before [DONE] ({len(first_token_at)}/{bs} prompts started)")
    missing = sorted(set(range(bs)) - set(first_token_at))
    if missing:
        return failed(f"no stream chunk for prompt indices {missing[:20]} of {bs}")

    if protocol == "native" and len(tokens) == bs:
        total_out = sum(tokens.values())
    elif usage_completion is not None:
        total_out = int(usage_completion)
    else:
        total_out = bs * ol
    last_ttft = max(first_token_at.values()) - tic
    first_ttft = min(first_token_at.values()) - tic
    decode_window = latency - last_ttft
    output_throughput = total_out / decode_window if ol > 1 and decode_window > 0 else math.nan
    return _row(
        run_name, protocol, bs, il, ol, cap, status="measured",
        latency=latency, last_ttft=last_ttft, ttft_ms=last_ttft * 1000.0, first_ttft_ms=first_ttft * 1000.0,
        input_throughput=bs * il / last_ttft, output_throughput=output_throughput,
        overall_throughput=(bs * il + total_out) / latency, total_output_tokens=total_out,
    )
