"""The embedded worker's scheduler: admission, continuous batching and the step loop, in one thread.

Owns who runs when, and the bookkeeping around it; the forward passes live in
:mod:`servegate.worker.batch`, the token picker in :mod:`servegate.worker.sampling`, the KV
budget and the prefix cache in :mod:`servegate.worker.kv_budget`.

* Admission is FIFO and reserves ``prompt_len + max_new_tokens`` tokens of the KV budget
  (``max_total_tokens``) per request; the prefix cache lives in the same budget and is evicted
  (least recently used first) to make room. A request that can never fit is rejected at
  submission with ``ConfigError`` (the server answers 400), never inside the scheduler thread.
* Requests join and leave the running batch at token granularity: each loop turn prefills the
  newly admitted requests and merges them into the batch, then runs one decode step; finished
  rows leave the batch right after the step that finished them.
* Prefill, as SGLang's: the admitted requests are prefilled in groups, in FIFO order
  (:meth:`Scheduler._next_prefill_group`). A request that reuses the prefix cache, or whose prompt
  is longer than ``chunked_prefill_size``, goes alone (chunked); otherwise the requests behind it
  join it in one forward pass while the padded batch fits ``chunked_prefill_size``.
* Each token is checked against the request's stop conditions here, and the request metrics
  (TTFT, ITL, E2E, token counters), the decode-window gauges (forward occupancy, generation
  throughput) and the fault switches that act on timing are applied here.
* In speculative mode (NGRAM) requests are served one at a time by
  :func:`servegate.worker.spec.speculative_generate`, through :meth:`Scheduler._run_speculative`.
* The operator profiler (``--profiler-dir``, :mod:`servegate.worker.profiler`) is started and
  stopped here, between two loop turns, on a command the HTTP thread queues (:meth:`Scheduler.profile`).

Why one module over 400 lines: one lock (``_cv``) guards the queue, the budget, the batch's rows
and every request's finish, and the HTTP threads take it too. Everything that takes it lives in
this one class (but for ``Batch.merge``, which publishes its new rows under it), so that the
locking can be checked in one place; the work done without it (forward passes, sampling, the
prefix cache behind its own lock) already lives in the modules above.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from servegate.errors import ConfigError
from servegate.worker.batch import Batch, _wants_input_logprobs, record_input_logprobs, start_input_logprobs
from servegate.worker.faults import FaultConfig, burn_cpu_for
from servegate.worker.kv_budget import PrefixCache, TokenBudget
from servegate.worker.metrics import OccupancyWindow, ThroughputWindow, WorkerMetrics, now
from servegate.worker.profiler import ProfileCommand, StepProfiler
from servegate.worker.request import KV, Request
from servegate.worker.sampling import Sampler, SamplingParams

__all__ = ["SchedulerConfig", "Scheduler", "STEP_ERROR_PREFIX"]

log = logging.getLogger(__name__)

STEP_ERROR_PREFIX = "engine error"
"""Start of the abort message of requests failed by a broken step; the server answers them with 500.
The wording is part of the HTTP surface (clients read it in ``finish_reason.message``), so it
keeps the name it had before the scheduler was renamed."""

_SHARED_PREFIX_MIN = 32
"""Shared prompt prefix (tokens) from which a request is worth a prefix-cache hit rather than a batched prefill.

As SGLang's in-batch prefix check: a request sharing this much with one already in the prefill
group waits for the next group and reuses that one's cached KV; a cached prefix shorter than this
(a BOS or a chat header) does not keep a request out of a batch."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and switches of one scheduler."""

    max_total_tokens: int
    """KV token capacity: running reservations plus the prefix cache never exceed it."""
    max_running_requests: int
    context_length: int
    decode_log_interval: int = 40
    """Decode steps per metrics window (SGLang's ``--decode-log-interval``)."""
    speculative_num_draft_tokens: int | None = None
    """NGRAM speculative decoding when set (requests then run one at a time)."""
    enable_prefix_cache: bool = True
    seed: int = 0
    chunked_prefill_size: int = 2048
    """Most prompt tokens per prefill forward pass, padding included (SGLang's ``--chunked-prefill-size``):
    a longer prompt is prefilled in chunks of this size, and requests admitted together are
    prefilled in one pass while their padded batch fits it."""


def _shared_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _TimedModel:
    """Forwards everything to the model and adds the time spent in ``__call__`` to ``busy_s``.

    ``speculative_generate`` calls the model itself; wrapping the model is how the scheduler
    still measures forward occupancy (and applies the decode-slowdown fault) in that mode.
    """

    def __init__(self, model: Any, slowdown_pct: float) -> None:
        self._model = model
        self._slowdown = slowdown_pct / 100.0
        self.busy_s = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = now()
        out = self._model(*args, **kwargs)
        elapsed = now() - start
        if self._slowdown:
            time.sleep(elapsed * self._slowdown)
            elapsed = now() - start
        self.busy_s += elapsed
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def find_eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends generation: the generation config's, the model config's and the tokenizer's."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class Scheduler:
    """Runs generation requests on one model in a dedicated thread (see the module docstring).

    One condition variable, ``_cv``, guards the queue, the budget, the batch's rows and every
    request's finish; the HTTP threads take it to submit, abort, flush and read the load.
    """

    def __init__(self, model: Any, tokenizer: Any, config: SchedulerConfig, *, metrics: WorkerMetrics,
                 faults: FaultConfig | None = None, profiler: StepProfiler | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.faults = faults or FaultConfig()
        self.eos_token_ids = find_eos_token_ids(model, tokenizer)
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._num_active = 0  # submitted and not finished (waiting, prefilling or running)
        self.decode_steps = 0  # decode steps run since start: where in the step sequence a prefill fell
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.prefix_cache = PrefixCache()
        self.budget = TokenBudget(config.max_total_tokens, self.prefix_cache)
        self.batch = Batch(model, Sampler(config.seed, corrupt_logits=self.faults.corrupt_logits), self._cv)
        self._occupancy = OccupancyWindow(config.decode_log_interval)
        self._throughput = ThroughputWindow(config.decode_log_interval)
        self.completed_user_requests = 0
        self._spec_tokens = 0
        self._spec_verify = 0
        # The gauge's window, as SGLang's sglang:spec_accept_length: tokens emitted by verification
        # passes / passes, over decode_log_interval passes (or to the end of a request).
        self._spec_window_tokens = 0
        self._spec_window_passes = 0
        self._draft_rng = random.Random(self.faults.seed)
        self.on_user_request_done: Callable[[int], None] | None = None
        """Called from the scheduler thread with the number of user requests completed so far."""
        self.profiler = profiler

    # ------------------------------------------------------------------ public API
    @property
    def speculative(self) -> bool:
        return self.config.speculative_num_draft_tokens is not None

    @property
    def last_gen_throughput(self) -> float:
        """Tokens per second over the last completed decode window (0.0 before the first)."""
        return self._throughput.value

    @property
    def avg_spec_accept_length(self) -> float:
        return self._spec_tokens / self._spec_verify if self._spec_verify else math.nan

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="servegate-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def check_admissible(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ConfigError`` (HTTP 400) for a request that could never run."""
        if not input_ids:
            raise ConfigError("the prompt is empty: give a non-empty text or input_ids")
        vocab = self.model.config.vocab_size
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"input_ids hold token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        need = len(input_ids) + params.max_new_tokens
        if need > self.config.context_length:
            raise ConfigError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {need} exceeds the "
                f"context length {self.config.context_length}; shorten the prompt or lower max_new_tokens")
        if need > self.config.max_total_tokens:
            raise ConfigError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {need} exceeds the "
                f"KV cache capacity of {self.config.max_total_tokens} tokens, so it could never be scheduled; "
                f"lower max_new_tokens or start the worker with a larger --max-total-tokens")

    def submit(self, req: Request) -> Request:
        """Queue a request (FIFO); ``ConfigError`` when it can never fit."""
        self.submit_batch([req])
        return req

    def submit_batch(self, reqs: list[Request]) -> None:
        """Queue requests that arrived together (one HTTP batch) in one go, so that one admission takes them
        all and they are prefilled together; ``ConfigError`` (nothing queued) when one can never fit."""
        for req in reqs:
            self.check_admissible(req.input_ids, req.params)
        with self._cv:
            if self._stopping:
                raise ConfigError("the worker is shutting down; send the request to another worker")
            self._waiting.extend(reqs)
            self._num_active += len(reqs)
            self._cv.notify_all()

    def abort(self, req: Request) -> None:
        """Ask the scheduler to stop a request (client went away); it finishes with type 'abort'."""
        req.aborted = True
        with self._cv:
            self._cv.notify_all()

    def profile(self, command: ProfileCommand) -> concurrent.futures.Future:
        """Ask the scheduler thread to start or stop the profiler between two steps; the future
        resolves once it has (``stop``: to the trace's path). ``ConfigError`` without a profiler."""
        if self.profiler is None:
            raise ConfigError("the worker has no profiler; start it with --profiler-dir DIR")
        with self._cv:
            if self._stopping:
                raise ConfigError("the worker is shutting down")
            future = self.profiler.submit(command)
            self._cv.notify_all()
        return future

    def is_busy(self) -> bool:
        with self._cv:
            return self._num_active > 0

    def flush_cache(self) -> bool:
        """Drop the prefix cache when idle (SGLang refuses while requests run); True when flushed."""
        with self._cv:
            if self._num_active > 0:
                return False
            dropped = self.prefix_cache.clear()
            # The scheduler thread republishes when it next goes idle; do it now so a scrape right
            # after a successful flush never shows the last request still running.
            self._publish_state_locked()
        log.info("prefix cache flushed (%d tokens dropped)", dropped)
        return True

    def load(self) -> dict[str, int]:
        with self._cv:
            return {
                "num_running_reqs": len(self.batch.rows),
                "num_queue_reqs": len(self._waiting),
                "num_used_tokens": self.batch.used_tokens(),
                "reserved_tokens": self.budget.reserved,
                "prefix_cache_tokens": self.prefix_cache.tokens,
            }

    # ------------------------------------------------------------------ the step loop
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stopping and not self._waiting and not self.batch.rows \
                            and not (self.profiler is not None and self.profiler.has_pending()):
                        self._occupancy.restart()
                        self.metrics.set_occupancy(self._occupancy.value)
                        self._throughput.restart()
                        self._publish_state_locked()
                        self._cv.wait()
                    if self._stopping:
                        self._fail_all_locked("the worker is shutting down")
                        if self.profiler is not None:
                            self.profiler.abandon("the worker is shutting down")
                        return
                    profile_commands = self.profiler.take() if self.profiler is not None else []
                    admitted = self._admit_locked()
                    if admitted and log.isEnabledFor(logging.DEBUG):
                        # SGLang's line, at debug here: which requests join the batch at which step is the
                        # batch shape a measurement of this worker has to reproduce (servegate.paired.solo).
                        log.debug("Prefill batch. #new-seq: %d, #new-token: %d, #running-req: %d, #queue-req: %d, "
                                  "#decode-steps: %d", len(admitted), sum(len(r.input_ids) for r in admitted),
                                  len(self.batch.rows), len(self._waiting), self.decode_steps)
                    self._publish_state_locked()
                if profile_commands:
                    # Between two steps, in this thread: the one that runs the model's operators.
                    self.profiler.apply(profile_commands)  # type: ignore[union-attr]
                try:
                    if self.speculative:
                        for req in admitted:
                            self._run_speculative(req)
                    else:
                        if admitted:
                            self._prefill(admitted)
                        if self.batch.rows:
                            self._decode_step()
                except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                    # A broken batch must not take the worker down: fail the requests in it
                    # (they answer 500 with the reason) and keep serving new ones.
                    log.exception("scheduler step failed; aborting %d running request(s)", len(self.batch.rows))
                    message = f"{STEP_ERROR_PREFIX}: {exc}"
                    with self._cv:
                        for req in admitted:
                            if not req.finished and req not in self.batch.rows:
                                self._finish_locked(req, {"type": "abort", "message": message})
                        self._fail_rows_locked(message)

    def _publish_state_locked(self) -> None:
        self.metrics.set_scheduler_state(running=len(self.batch.rows), queued=len(self._waiting),
                                         used_tokens=self.batch.used_tokens(), capacity=self.config.max_total_tokens)

    def _admit_locked(self) -> list[Request]:
        admitted: list[Request] = []
        limit = 1 if self.speculative else self.config.max_running_requests
        while self._waiting:
            req = self._waiting[0]
            if req.aborted:
                self._waiting.popleft()
                self._finish_locked(req, {"type": "abort", "message": "client disconnected while queued"})
                continue
            if len(self.batch.rows) + len(admitted) >= limit:
                break
            need = len(req.input_ids) + req.params.max_new_tokens
            if not self.budget.make_room(need):
                break  # FIFO: the head waits for capacity; nothing overtakes it
            self._waiting.popleft()
            req.reserved_tokens = need
            self.budget.reserve(need)
            admitted.append(req)
        return admitted

    def _finish_locked(self, req: Request, reason: dict[str, Any]) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        req.finish_time = now()
        req.finished = True
        self.budget.release(req.reserved_tokens)
        req.reserved_tokens = 0
        self._num_active -= 1
        if reason.get("type") != "abort":
            self.metrics.observe_finished(prompt_tokens=req.prompt_tokens, generation_tokens=len(req.output_ids),
                                          cached_tokens=req.cached_tokens, e2e_s=req.e2e_latency())
        if req.notify is not None:
            req.notify()
        if req.user_request and reason.get("type") != "abort":
            self.completed_user_requests += 1
            if self.on_user_request_done is not None:
                self.on_user_request_done(self.completed_user_requests)

    def _fail_rows_locked(self, message: str) -> None:
        for req in self.batch.rows:
            self._finish_locked(req, {"type": "abort", "message": message})
        self.batch.clear_locked()

    def _fail_all_locked(self, message: str) -> None:
        while self._waiting:
            self._finish_locked(self._waiting.popleft(), {"type": "abort", "message": message})
        self._fail_rows_locked(message)

    def _accept_token(self, req: Request, token: int, t: float) -> dict[str, Any] | None:
        """Append one sampled token; returns the finish reason when the request is done."""
        if req.first_token_time is None:
            req.first_token_time = t
            self.metrics.observe_first_token(t - req.created)
        else:
            self.metrics.observe_inter_token(t - (req.last_token_time or t))
        req.last_token_time = t
        req.output_ids.append(token)
        p = req.params
        if req.aborted:
            return {"type": "abort", "message": "client disconnected"}
        if not p.ignore_eos and token in self.eos_token_ids:
            return {"type": "stop", "matched": token}
        if token in p.stop_token_ids:
            return {"type": "stop", "matched": token}
        if p.stop:
            tail = self.tokenizer.decode(req.output_ids[-64:], skip_special_tokens=True)
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(req.input_ids) + len(req.output_ids) >= self.config.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    # ------------------------------------------------------------------ prefill and decode
    def _prefill(self, admitted: list[Request]) -> None:
        # A prefill breaks the run of decode steps an occupancy window covers (see OccupancyWindow).
        self._occupancy.restart()
        self.metrics.set_occupancy(self._occupancy.value)
        self._throughput.restart()
        joined: list[tuple[Request, KV, int]] = []
        prompt_total = cached_total = 0
        prefix_cache = self.prefix_cache if self.config.enable_prefix_cache else None
        pending = deque(admitted)
        while pending:
            group = self._next_prefill_group(pending)
            results = self.batch.prefill(group, prefix_cache, self.config.chunked_prefill_size)
            for req, (kv, first) in zip(group, results):
                if prefix_cache is not None:
                    with self._cv:
                        # Store only what the budget can hold next to the running reservations.
                        if self.budget.make_room(req.prompt_tokens):
                            prefix_cache.insert(req.input_ids, kv)
                prompt_total += req.prompt_tokens
                cached_total += req.cached_tokens
                with self._cv:
                    if req.params.max_new_tokens == 0:
                        self._finish_locked(req, {"type": "length", "length": 0})
                        continue
                    reason = self._accept_token(req, first, now())
                    if reason is not None:
                        self._finish_locked(req, reason)
                    else:
                        joined.append((req, kv, first))
                    if req.notify is not None and not req.finished:
                        req.notify()
        if prompt_total:
            self.metrics.set_cache_hit_rate(cached_total / prompt_total)
        if joined:
            self.batch.merge(joined)

    def _next_prefill_group(self, pending: deque[Request]) -> list[Request]:
        """Take the next requests to prefill together from the front of ``pending`` (FIFO: none is skipped).

        The head goes alone when its prompt needs chunks or it reuses the prefix cache; the
        requests behind it join while the padded batch (longest prompt x requests) fits
        ``chunked_prefill_size``, until one reuses the cache or shares a long prefix with a request
        already in the group (it then heads a later group and reuses that request's cached KV).
        """
        head = pending.popleft()
        group = [head]
        chunk = self.config.chunked_prefill_size
        if len(head.input_ids) > chunk or self._reuses_prefix_cache(head):
            return group
        width = len(head.input_ids)
        while pending:
            req = pending[0]
            if max(width, len(req.input_ids)) * (len(group) + 1) > chunk or self._reuses_prefix_cache(req):
                break
            if self._can_reuse_prefix_cache(req) and any(
                    _shared_prefix_len(req.input_ids, other.input_ids) >= _SHARED_PREFIX_MIN for other in group):
                break
            group.append(pending.popleft())
            width = max(width, len(req.input_ids))
        return group

    def _can_reuse_prefix_cache(self, req: Request) -> bool:
        # Prompt log-probs need logits for every scored token, so such a request never reuses the cache.
        return self.config.enable_prefix_cache and not _wants_input_logprobs(req)

    def _reuses_prefix_cache(self, req: Request) -> bool:
        return self._can_reuse_prefix_cache(req) and self.prefix_cache.lookup(req.input_ids)[0] >= _SHARED_PREFIX_MIN

    def _decode_step(self) -> None:
        self.decode_steps += 1
        step_start = now()
        rows = self.batch.rows
        fwd_cpu_start = time.thread_time()
        tokens, fwd_s = self.batch.decode()
        fwd_cpu_s = time.thread_time() - fwd_cpu_start
        if self.faults.decode_slowdown_pct:
            # Counted as forward time: the fault imitates a slower kernel, which occupancy must show.
            sleep_start = now()
            time.sleep(fwd_s * self.faults.decode_slowdown_pct / 100.0)
            fwd_s += now() - sleep_start
        if self.faults.decode_compute_pct:
            # The same on the CPU: the extra time is computed, as a slower kernel's would be, and measured on
            # this thread's CPU clock. The forward's wall time also holds the turns of whatever shares the core
            # (the other side of a duet on one CPU): P % of it computed made a 3 % fault move ITL by 4 %.
            burn_start = now()
            burn_cpu_for(fwd_cpu_s * self.faults.decode_compute_pct / 100.0)
            fwd_s += now() - burn_start
        t = now()
        keep: list[int] = []
        with self._cv:
            for i, (req, tok) in enumerate(zip(rows, tokens)):
                reason = self._accept_token(req, tok, t)
                if reason is not None:
                    self._finish_locked(req, reason)
                else:
                    keep.append(i)
                    if req.notify is not None:
                        req.notify()
            if len(keep) < len(rows):
                self.batch.select_locked(keep)
        if self.faults.decode_delay_ms:
            time.sleep(self.faults.decode_delay_ms / 1000.0)
        self._end_decode_window(step_start, fwd_s, len(rows))

    def _end_decode_window(self, step_start: float, fwd_s: float, batch: int) -> None:
        step_end = now()
        if self._occupancy.record_decode(step_start, fwd_s, step_end):
            self.metrics.set_occupancy(self._occupancy.value)
        if self._throughput.record_decode(step_start, batch, step_end):
            self.metrics.set_gen_throughput(self._throughput.value)
        with self._cv:
            self._publish_state_locked()

    # ------------------------------------------------------------------ speculation hook
    def _spec_logprobs(self, req: Request) -> None:
        """Prompt and output log-probs of a speculative request, from one scoring pass over prompt + output.

        Verification passes see drafts that were rejected, so their logits are not the ones to
        report; one forward over what was emitted gives exactly SGLang's shapes (as ``Batch``).
        """
        ids = [*req.input_ids, *req.output_ids]
        n = len(req.input_ids)
        logits = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.model.device),
                            use_cache=False).logits[0]
        lp = torch.log_softmax(self.batch.sampler.process(logits.cpu()), dim=-1)
        if _wants_input_logprobs(req):
            start_input_logprobs(req)
            record_input_logprobs(req, lp, 0)
        for i, token in enumerate(req.output_ids):
            req.record_output_logprobs(lp[n - 1 + i], token)

    def _publish_spec_window(self) -> None:
        """Set ``sglang:spec_accept_length`` to the window's accept length and start a new window.

        SGLang's gauge is per decode-log interval (accepted tokens / verification passes since the
        last log line), not cumulative: a drafter that breaks mid-run shows in the next window.
        """
        if self._spec_window_passes:
            self.metrics.set_spec_accept_length(self._spec_window_tokens / self._spec_window_passes)
        self._spec_window_tokens = 0
        self._spec_window_passes = 0

    def _run_speculative(self, req: Request) -> None:
        from servegate.worker.spec import speculative_generate  # optional module, loaded on first use

        self._occupancy.restart()
        self.metrics.set_occupancy(self._occupancy.value)
        timed = _TimedModel(self.model, self.faults.decode_slowdown_pct)
        state: dict[str, Any] = {"reason": None, "step_start": now(), "busy": 0.0}
        with self._cv:
            # The request holds no batch KV (speculation keeps its own cache), but as the batch's
            # one row it counts in load(), the gauges and the step loop's idle check.
            self.batch.rows = [req]
            self._publish_state_locked()

        def on_token(token: int) -> None:
            t = now()
            with self._cv:
                if state["reason"] is None:
                    state["reason"] = self._accept_token(req, int(token), t)
                    if req.notify is not None:
                        req.notify()
            # Each accepted token closes one "step" of the occupancy window.
            busy = timed.busy_s - state["busy"]
            state["busy"] = timed.busy_s
            if self.faults.decode_delay_ms:
                time.sleep(self.faults.decode_delay_ms / 1000.0)
            self._end_decode_window(state["step_start"], busy, 1)
            state["step_start"] = now()

        def on_verify(num_emitted: int) -> None:
            self._spec_window_tokens += num_emitted
            self._spec_window_passes += 1
            if self._spec_window_passes >= self.config.decode_log_interval:
                self._publish_spec_window()

        replace_drafts = None
        if self.faults.random_drafts:
            vocab = int(getattr(self.model.config, "vocab_size", 0) or len(self.tokenizer))

            def replace_drafts(drafts: list[int]) -> list[int]:
                return [self._draft_rng.randrange(vocab) for _ in drafts]

        processor = None
        if self.faults.corrupt_logits:
            def processor(_ids: Any, scores: torch.Tensor) -> torch.Tensor:
                return torch.roll(scores, shifts=1, dims=-1)

        result = speculative_generate(
            timed, list(req.input_ids), max_new_tokens=req.params.max_new_tokens,
            num_draft_tokens=int(self.config.speculative_num_draft_tokens or 1),
            eos_token_ids=set(self.eos_token_ids), ignore_eos=req.params.ignore_eos, on_token=on_token,
            should_stop=lambda: state["reason"] is not None or req.aborted or self._stopping,
            logits_processor=processor, replace_drafts=replace_drafts, on_verify=on_verify)
        self._publish_spec_window()  # a request's last partial window shows too
        if req.return_logprob:
            self._spec_logprobs(req)
        with self._cv:
            req.spec_verify_ct = result.verify_ct
            self._spec_tokens += len(req.output_ids)
            self._spec_verify += result.verify_ct
            reason = state["reason"]
            if reason is None:
                if req.aborted or self._stopping:
                    reason = {"type": "abort", "message": "client disconnected"}
                elif result.finish_reason == "stop" and req.output_ids:
                    reason = {"type": "stop", "matched": req.output_ids[-1]}
                else:
                    reason = {"type": "length", "length": len(req.output_ids)}
            self.batch.rows = []
            self._finish_locked(req, reason)
            self._publish_state_locked()
