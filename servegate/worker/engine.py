"""The embedded worker's continuous-batching engine: one thread, one left-padded batch.

Requests join and leave the running batch at token granularity:

* a new request is prefilled alone (reusing the longest cached prompt prefix), its first
  token sampled, and its KV merged into the batch by left-padding whichever side is
  shorter; the padded columns are masked out by a per-row attention mask, and every row
  carries its own ``position_ids`` so that padding never shifts RoPE positions;
* every step feeds each row's last token through the model once (a batched decode on a
  ``DynamicCache``);
* finished rows are dropped with a batch selection, and leading columns that are padding
  in every remaining row are trimmed away.

Admission is FIFO and reserves ``prompt_len + max_new_tokens`` tokens of the KV budget
(``max_total_tokens``) per request; the prefix cache lives in the same budget and is
evicted (least recently used first) to make room. A request that can never fit is
rejected at submission with ``ConfigError`` (the server answers 400), never inside the
engine thread. Padding is not counted against the budget: the padded batch can hold up
to ``batch * longest_row`` tokens of KV.

In speculative mode (NGRAM) requests are served one at a time by
:func:`servegate.worker.spec.speculative_generate`, as the issue asks.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from servegate.errors import ConfigError
from servegate.worker.faults import FaultConfig
from servegate.worker.metrics import OccupancyWindow, WorkerMetrics, now

__all__ = [
    "SamplingParams",
    "EngineConfig",
    "Request",
    "Engine",
    "PrefixCache",
    "kv_bytes_per_token",
    "plan_token_capacity",
    "DEFAULT_MAX_NEW_TOKENS",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# Rough cap on the number of stored prompts: a lookup scans them all.
MAX_PREFIX_ENTRIES = 256


@dataclass(frozen=True)
class SamplingParams:
    """SGLang ``sampling_params`` (the subset the worker honours)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "SamplingParams":
        """Validate a JSON ``sampling_params`` object; unknown keys are ignored like SGLang does."""
        raw = dict(raw or {})
        try:
            max_new = raw.get("max_new_tokens")
            stop = raw.get("stop") or ()
            if isinstance(stop, str):
                stop = (stop,)
            params = cls(
                max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else int(max_new),
                temperature=float(raw.get("temperature", 1.0) if raw.get("temperature") is not None else 1.0),
                top_p=float(raw.get("top_p", 1.0) if raw.get("top_p") is not None else 1.0),
                top_k=int(raw.get("top_k", -1) if raw.get("top_k") is not None else -1),
                ignore_eos=bool(raw.get("ignore_eos", False)),
                stop=tuple(str(s) for s in stop if s),
                stop_token_ids=tuple(int(t) for t in (raw.get("stop_token_ids") or ())),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid sampling_params {raw!r}: {exc}; max_new_tokens/top_k must be integers, "
                              f"temperature/top_p numbers, stop a string or list of strings") from exc
        if params.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {params.max_new_tokens}")
        if params.temperature < 0 or math.isnan(params.temperature):
            raise ConfigError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ConfigError(f"top_p must be within (0, 1], got {params.top_p}")
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class EngineConfig:
    """Limits and switches of one engine."""

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


@dataclass(eq=False)
class Request:
    """One generation request and its live state.

    The engine thread writes the state fields and then calls ``notify`` (from the engine
    thread); readers take a consistent snapshot with :meth:`Engine.snapshot`.
    """

    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    user_request: bool = True
    """Counts towards the crash-after-N fault (``/health_generate`` does not)."""
    notify: Callable[[], None] | None = None
    # --- state, written by the engine thread ---
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    finished: bool = False
    aborted: bool = False
    created: float = field(default_factory=now)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    spec_verify_ct: int | None = None
    reserved_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    def e2e_latency(self) -> float:
        end = self.finish_time if self.finish_time is not None else now()
        return end - self.created


def kv_bytes_per_token(model_config: Any, dtype_bytes: int) -> int:
    """KV bytes one token occupies: 2 (K and V) * layers * kv_heads * head_dim * dtype bytes."""
    layers = model_config.num_hidden_layers
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return 2 * layers * heads * head_dim * dtype_bytes


def plan_token_capacity(*, bytes_per_token: int, weight_bytes: int, available_bytes: int,
                        max_total_tokens: int | None, mem_fraction_static: float | None,
                        context_length: int) -> int:
    """The KV token capacity for this budget; ``ConfigError`` when one full-length request cannot fit.

    ``max_total_tokens`` wins when given (capped by ``mem_fraction_static`` when that is
    given too, as SGLang does); otherwise ``mem_fraction_static`` of the available memory,
    minus the weights, divided by ``bytes_per_token``.
    """
    from_memory = None
    if mem_fraction_static is not None:
        budget = mem_fraction_static * available_bytes - weight_bytes
        from_memory = max(0, int(budget // bytes_per_token))
    if max_total_tokens is not None:
        capacity = max_total_tokens if from_memory is None else min(max_total_tokens, from_memory)
    elif from_memory is not None:
        capacity = from_memory
    else:
        raise ConfigError("no KV budget: pass --max-total-tokens N or --mem-fraction-static F")
    if capacity < context_length:
        how = (f"--max-total-tokens {max_total_tokens}" if max_total_tokens is not None and capacity == max_total_tokens
               else f"--mem-fraction-static {mem_fraction_static} of {available_bytes / 2**30:.2f} GiB available "
                    f"minus {weight_bytes / 2**30:.2f} GiB of weights")
        raise ConfigError(
            f"the KV cache budget holds {capacity} tokens ({how}, {bytes_per_token} bytes per token), "
            f"less than one request of the context length {context_length}; raise --max-total-tokens or "
            f"--mem-fraction-static, or lower --context-length")
    return capacity


class PrefixCache:
    """KV of recent prompts keyed by their token ids; LRU; counts the tokens it holds.

    A lookup returns the longest common prefix over the stored prompts. Stored tensors are
    never modified in place (the batch is always rebuilt with ``torch.cat``), so they are
    kept by reference, without copies.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = \
            OrderedDict()
        self.tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(matched length, per-layer (K, V)) of the longest stored prefix of ``ids``."""
        if not ids:
            return 0, None
        query = torch.tensor(ids, dtype=torch.long)
        best_len, best_key = 0, None
        with self._lock:
            for key, (stored, _) in self._entries.items():
                m = min(len(stored), len(query))
                if m <= best_len or int(stored[0]) != ids[0]:
                    continue
                diff = (stored[:m] != query[:m]).nonzero()
                common = m if diff.numel() == 0 else int(diff[0, 0])
                if common > best_len:
                    best_len, best_key = common, key
            if best_key is None:
                return 0, None
            self._entries.move_to_end(best_key)
            return best_len, self._entries[best_key][1]

    def insert(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        key = tuple(ids)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            # A stored prompt that this one extends is redundant: the longer one serves both.
            for other in [k for k in self._entries if len(k) < len(key) and key[:len(k)] == k]:
                self._drop(other)
            self._entries[key] = (torch.tensor(ids, dtype=torch.long), kv)
            self.tokens += len(key)
            while len(self._entries) > MAX_PREFIX_ENTRIES:
                self._drop(next(iter(self._entries)))

    def evict(self, tokens_needed: int) -> int:
        """Drop least recently used prompts until ``tokens_needed`` are freed; returns tokens freed."""
        freed = 0
        with self._lock:
            while freed < tokens_needed and self._entries:
                freed += self._drop(next(iter(self._entries)))
        return freed

    def clear(self) -> int:
        with self._lock:
            dropped = self.tokens
            self._entries.clear()
            self.tokens = 0
            return dropped

    def _drop(self, key: tuple[int, ...]) -> int:
        del self._entries[key]
        self.tokens -= len(key)
        return len(key)


class _TimedModel:
    """Forwards everything to the model and adds the time spent in ``__call__`` to ``busy_s``.

    Lets the engine measure forward occupancy inside ``speculative_generate``.
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


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class Engine:
    """Runs generation requests on one model in a dedicated thread (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, *, metrics: WorkerMetrics,
                 faults: FaultConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.faults = faults or FaultConfig()
        self.eos_token_ids = self._eos_ids(model, tokenizer)
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._rows: list[Request] = []
        self._num_active = 0  # submitted and not finished (waiting, prefilling or running)
        self._reserved = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.prefix_cache = PrefixCache()
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._pos = torch.zeros(0, dtype=torch.long)
        self._last = torch.zeros(0, dtype=torch.long)
        self._generator = torch.Generator().manual_seed(config.seed)
        self._occupancy = OccupancyWindow(config.decode_log_interval)
        self._window_tokens = 0
        self._window_start: float | None = None
        self._window_steps = 0
        self.last_gen_throughput = 0.0
        self.completed_user_requests = 0
        self._spec_tokens = 0
        self._spec_verify = 0
        self.on_user_request_done: Callable[[int], None] | None = None
        """Called from the engine thread with the number of user requests completed so far."""

    # ------------------------------------------------------------------ public API
    @property
    def speculative(self) -> bool:
        return self.config.speculative_num_draft_tokens is not None

    @property
    def avg_spec_accept_length(self) -> float:
        return self._spec_tokens / self._spec_verify if self._spec_verify else math.nan

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="servegate-engine", daemon=True)
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
        self.check_admissible(req.input_ids, req.params)
        with self._cv:
            if self._stopping:
                raise ConfigError("the worker is shutting down; send the request to another worker")
            self._waiting.append(req)
            self._num_active += 1
            self._cv.notify_all()
        return req

    def abort(self, req: Request) -> None:
        """Ask the engine to stop a request (client went away); it finishes with type 'abort'."""
        req.aborted = True
        with self._cv:
            self._cv.notify_all()

    def is_busy(self) -> bool:
        with self._cv:
            return self._num_active > 0

    def flush_cache(self) -> bool:
        """Drop the prefix cache when idle (SGLang refuses while requests run); True when flushed."""
        with self._cv:
            if self._num_active > 0:
                return False
            dropped = self.prefix_cache.clear()
            # The engine thread republishes when it next goes idle; do it now so a scrape right
            # after a successful flush never shows the last request still running.
            self._publish_state_locked()
        log.info("prefix cache flushed (%d tokens dropped)", dropped)
        return True

    def load(self) -> dict[str, int]:
        with self._cv:
            return {
                "num_running_reqs": len(self._rows),
                "num_queue_reqs": len(self._waiting),
                "num_used_tokens": self._used_tokens(),
                "reserved_tokens": self._reserved,
                "prefix_cache_tokens": self.prefix_cache.tokens,
            }

    # ------------------------------------------------------------------ engine thread
    @staticmethod
    def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def _used_tokens(self) -> int:
        return sum(len(r.input_ids) + len(r.output_ids) for r in self._rows)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stopping and not self._waiting and not self._rows:
                        self._occupancy.restart()
                        self.metrics.set_occupancy(self._occupancy.value)
                        self._window_start = None
                        self._publish_state_locked()
                        self._cv.wait()
                    if self._stopping:
                        self._fail_all_locked("the worker is shutting down")
                        return
                    admitted = self._admit_locked()
                    self._publish_state_locked()
                try:
                    if self.speculative:
                        for req in admitted:
                            self._run_speculative(req)
                    else:
                        if admitted:
                            self._prefill(admitted)
                        if self._rows:
                            self._decode_step()
                except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                    # A broken batch must not take the engine down: fail the requests in it
                    # (they answer 500 with the reason) and keep serving new ones.
                    log.exception("engine step failed; aborting %d running request(s)", len(self._rows))
                    with self._cv:
                        for req in admitted:
                            if not req.finished and req not in self._rows:
                                self._finish_locked(req, {"type": "abort", "message": f"engine error: {exc}"})
                        self._fail_rows_locked(f"engine error: {exc}")

    def _publish_state_locked(self) -> None:
        self.metrics.set_scheduler_state(running=len(self._rows), queued=len(self._waiting),
                                         used_tokens=self._used_tokens(), capacity=self.config.max_total_tokens)

    def _admit_locked(self) -> list[Request]:
        admitted: list[Request] = []
        limit = 1 if self.speculative else self.config.max_running_requests
        while self._waiting:
            req = self._waiting[0]
            if req.aborted:
                self._waiting.popleft()
                self._finish_locked(req, {"type": "abort", "message": "client disconnected while queued"})
                continue
            if len(self._rows) + len(admitted) >= limit:
                break
            need = len(req.input_ids) + req.params.max_new_tokens
            free = self.config.max_total_tokens - self._reserved - self.prefix_cache.tokens
            if need > free:
                self.prefix_cache.evict(need - free)
                free = self.config.max_total_tokens - self._reserved - self.prefix_cache.tokens
            if need > free:
                break  # FIFO: the head waits for capacity; nothing overtakes it
            self._waiting.popleft()
            req.reserved_tokens = need
            self._reserved += need
            admitted.append(req)
        return admitted

    def _finish_locked(self, req: Request, reason: dict[str, Any]) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        req.finish_time = now()
        req.finished = True
        self._reserved -= req.reserved_tokens
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
        for req in self._rows:
            self._finish_locked(req, {"type": "abort", "message": message})
        self._rows = []
        self._cache = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._pos = torch.zeros(0, dtype=torch.long)
        self._last = torch.zeros(0, dtype=torch.long)

    def _fail_all_locked(self, message: str) -> None:
        while self._waiting:
            self._finish_locked(self._waiting.popleft(), {"type": "abort", "message": message})
        self._fail_rows_locked(message)

    # ------------------------------------------------------------------ logits and tokens
    def _process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.faults.corrupt_logits:
            logits = torch.roll(logits, shifts=1, dims=-1)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> torch.Tensor:
        """One token per row of ``logits`` ([B, V], already processed)."""
        greedy = logits.argmax(dim=-1)
        if all(r.params.greedy for r in rows):
            return greedy
        temps = torch.tensor([r.params.temperature or 1.0 for r in rows], dtype=logits.dtype)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        top_ks = [r.params.top_k for r in rows]
        if any(k > 0 for k in top_ks):
            kmax = max(k for k in top_ks if k > 0)
            vals, _ = probs.topk(min(kmax, probs.shape[-1]), dim=-1)
            ks = torch.tensor([min(k, vals.shape[-1]) if k > 0 else vals.shape[-1] for k in top_ks])
            thresh = vals.gather(1, (ks - 1)[:, None])
            probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
        top_ps = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype)
        if bool((top_ps < 1.0).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(-1)
            drop = (cum - sorted_p) > top_ps[:, None] * cum[:, -1:]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
        sampled = torch.multinomial(probs, 1, generator=self._generator).squeeze(1)
        is_greedy = torch.tensor([r.params.greedy for r in rows])
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def _top(lp_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
        vals, idx = lp_row.topk(k)
        return list(zip(vals.tolist(), idx.tolist()))

    def _record_output_logprobs(self, req: Request, lp_row: torch.Tensor, token: int) -> None:
        req.output_token_logprobs.append((float(lp_row[token]), token))
        if req.top_logprobs_num > 0:
            req.output_top_logprobs.append(self._top(lp_row, req.top_logprobs_num))

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

    # ------------------------------------------------------------------ prefill and merge
    def _prefill(self, admitted: list[Request]) -> None:
        self._occupancy.restart()
        self.metrics.set_occupancy(self._occupancy.value)
        self._window_start = None
        joined: list[tuple[Request, list[tuple[torch.Tensor, torch.Tensor]], int]] = []
        prompt_total = cached_total = 0
        for req in admitted:
            kv, first = self._prefill_one(req)
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
            self._merge(joined)

    def _prefill_one(self, req: Request) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        ids = req.input_ids
        n = len(ids)
        want_input_lp = req.return_logprob and 0 <= req.logprob_start_len < n
        reuse, stored = 0, None
        if self.config.enable_prefix_cache and not want_input_lp:
            reuse, stored = self.prefix_cache.lookup(ids)
            reuse = min(reuse, n - 1)  # at least one token must run to produce logits
        cache = DynamicCache(config=self.model.config)
        if reuse > 0 and stored is not None:
            for layer, (k, v) in zip(cache.layers, stored):
                layer.update(k[:, :, :reuse], v[:, :, :reuse])
        req.cached_tokens = reuse
        rest = torch.tensor([ids[reuse:]], dtype=torch.long)
        positions = torch.arange(reuse, n, dtype=torch.long)[None, :]
        out = self.model(input_ids=rest, position_ids=positions, past_key_values=cache, use_cache=True,
                         logits_to_keep=0 if want_input_lp else 1)
        logits = self._process_logits(out.logits[0])
        if want_input_lp:
            lp = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(ids[1:], dtype=torch.long)
            token_lp = lp[:-1].gather(1, targets[:, None]).squeeze(1).tolist() if n > 1 else []
            # SGLang's shape: entry 0 is None whatever logprob_start_len is; entry i is
            # log P(ids[start + i] | ids[:start + i]).
            start = req.logprob_start_len
            full: list[tuple[float | None, int]] = [(None, ids[0])] + list(zip(token_lp, ids[1:]))
            req.input_token_logprobs = [(None, ids[start])] + full[start + 1:]
            if req.top_logprobs_num > 0:
                req.input_top_logprobs = [None] + [self._top(lp[i - 1], req.top_logprobs_num)
                                                   for i in range(start + 1, n)]
        last = logits[-1:]
        first = int(self._sample(last, [req])[0]) if req.params.max_new_tokens > 0 else -1
        if req.return_logprob and first >= 0:
            self._record_output_logprobs(req, torch.log_softmax(last[0], dim=-1), first)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        if self.config.enable_prefix_cache:
            with self._cv:
                # Store only what the budget can hold next to the running reservations.
                room = self.config.max_total_tokens - self._reserved - self.prefix_cache.tokens
                if n > room:
                    self.prefix_cache.evict(n - room)
                    room = self.config.max_total_tokens - self._reserved - self.prefix_cache.tokens
                if n <= room:
                    self.prefix_cache.insert(ids, kv)
        return kv, first

    def _merge(self, joined: list[tuple[Request, list[tuple[torch.Tensor, torch.Tensor]], int]]) -> None:
        """Left-pad the batch and the new rows to one length and concatenate them."""
        old_len = self._mask.shape[1] if self._rows else 0
        new_len = max([old_len] + [len(r.input_ids) for r, _, _ in joined])
        n_layers = len(joined[0][1])
        keys: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        values: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        masks: list[torch.Tensor] = []
        if self._rows and self._cache is not None:
            for i, layer in enumerate(self._cache.layers):
                keys[i].append(_pad_left(layer.keys, new_len - old_len, 2))
                values[i].append(_pad_left(layer.values, new_len - old_len, 2))
            masks.append(_pad_left(self._mask, new_len - old_len, 1))
        for req, kv, _ in joined:
            p = len(req.input_ids)
            for i, (k, v) in enumerate(kv):
                keys[i].append(_pad_left(k, new_len - p, 2))
                values[i].append(_pad_left(v, new_len - p, 2))
            masks.append(_pad_left(torch.ones(1, p, dtype=torch.long), new_len - p, 1))
        cache = self._cache if (self._rows and self._cache is not None) else DynamicCache(config=self.model.config)
        for i, layer in enumerate(cache.layers):
            k = torch.cat(keys[i], dim=0) if len(keys[i]) > 1 else keys[i][0]
            v = torch.cat(values[i], dim=0) if len(values[i]) > 1 else values[i][0]
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        with self._cv:
            self._cache = cache
            self._mask = torch.cat(masks, dim=0) if len(masks) > 1 else masks[0]
            self._pos = torch.cat([self._pos, torch.tensor([len(r.input_ids) for r, _, _ in joined])])
            self._last = torch.cat([self._last, torch.tensor([tok for _, _, tok in joined])])
            self._rows = self._rows + [r for r, _, _ in joined]

    # ------------------------------------------------------------------ decode
    def _decode_step(self) -> None:
        step_start = now()
        rows = self._rows
        batch = len(rows)
        self._mask = torch.cat([self._mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
        fwd_start = now()
        out = self.model(input_ids=self._last[:, None], attention_mask=self._mask, position_ids=self._pos[:, None],
                         past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        logits = self._process_logits(out.logits[:, -1, :])
        tokens = self._sample(logits, rows)
        if any(r.return_logprob for r in rows):
            lp = torch.log_softmax(logits, dim=-1)
            toks = tokens.tolist()
            for i, r in enumerate(rows):
                if r.return_logprob:
                    self._record_output_logprobs(r, lp[i], toks[i])
        fwd_s = now() - fwd_start
        if self.faults.decode_slowdown_pct:
            time.sleep(fwd_s * self.faults.decode_slowdown_pct / 100.0)
            fwd_s = now() - fwd_start
        self._pos = self._pos + 1
        self._last = tokens
        token_list = tokens.tolist()
        t = now()
        keep: list[int] = []
        with self._cv:
            for i, (req, tok) in enumerate(zip(rows, token_list)):
                reason = self._accept_token(req, tok, t)
                if reason is not None:
                    self._finish_locked(req, reason)
                else:
                    keep.append(i)
                    if req.notify is not None:
                        req.notify()
            if len(keep) < batch:
                self._select_rows_locked(keep)
        if self.faults.decode_delay_ms:
            time.sleep(self.faults.decode_delay_ms / 1000.0)
        self._end_decode_window(step_start, fwd_s, batch)

    def _select_rows_locked(self, keep: list[int]) -> None:
        if not keep:
            self._rows = []
            self._cache = None
            self._mask = torch.zeros(0, 0, dtype=torch.long)
            self._pos = torch.zeros(0, dtype=torch.long)
            self._last = torch.zeros(0, dtype=torch.long)
            return
        index = torch.tensor(keep, dtype=torch.long)
        self._rows = [self._rows[i] for i in keep]
        self._mask = self._mask[index]
        self._pos = self._pos[index]
        self._last = self._last[index]
        # Columns that are padding in every remaining row carry no information: trim them.
        first_real = int(self._mask.any(dim=0).to(torch.int8).argmax())
        assert self._cache is not None
        for layer in self._cache.layers:
            k = layer.keys[index]
            v = layer.values[index]
            if first_real:
                k, v = k[:, :, first_real:], v[:, :, first_real:]
            layer.keys, layer.values = k, v
        if first_real:
            self._mask = self._mask[:, first_real:]

    def _end_decode_window(self, step_start: float, fwd_s: float, batch: int) -> None:
        step_end = now()
        if self._occupancy.record_decode(step_start, fwd_s, step_end):
            self.metrics.set_occupancy(self._occupancy.value)
        if self._window_start is None:
            self._window_start = step_start
            self._window_tokens = 0
            self._window_steps = 0
        self._window_tokens += batch
        self._window_steps += 1
        if self._window_steps >= self.config.decode_log_interval:
            elapsed = step_end - self._window_start
            if elapsed > 0:
                self.last_gen_throughput = self._window_tokens / elapsed
                self.metrics.set_gen_throughput(self.last_gen_throughput)
            self._window_start = step_end
            self._window_tokens = 0
            self._window_steps = 0
        with self._cv:
            self._publish_state_locked()

    # ------------------------------------------------------------------ speculative
    def _run_speculative(self, req: Request) -> None:
        from servegate.worker.spec import speculative_generate  # optional module, loaded on first use

        self._occupancy.restart()
        self.metrics.set_occupancy(self._occupancy.value)
        timed = _TimedModel(self.model, self.faults.decode_slowdown_pct)
        state: dict[str, Any] = {"reason": None, "step_start": now(), "busy": 0.0}
        with self._cv:
            self._rows = [req]
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

        processor = None
        if self.faults.corrupt_logits:
            def processor(_ids: Any, scores: torch.Tensor) -> torch.Tensor:
                return torch.roll(scores, shifts=1, dims=-1)

        result = speculative_generate(
            timed, list(req.input_ids), max_new_tokens=req.params.max_new_tokens,
            num_draft_tokens=int(self.config.speculative_num_draft_tokens or 1),
            eos_token_ids=set(self.eos_token_ids), ignore_eos=req.params.ignore_eos, on_token=on_token,
            should_stop=lambda: state["reason"] is not None or req.aborted or self._stopping,
            logits_processor=processor)
        with self._cv:
            req.spec_verify_ct = result.verify_ct
            self._spec_tokens += len(req.output_ids)
            self._spec_verify += result.verify_ct
            if not math.isnan(self.avg_spec_accept_length):
                self.metrics.set_spec_accept_length(self.avg_spec_accept_length)
            reason = state["reason"]
            if reason is None:
                if req.aborted or self._stopping:
                    reason = {"type": "abort", "message": "client disconnected"}
                elif result.finish_reason == "stop" and req.output_ids:
                    reason = {"type": "stop", "matched": req.output_ids[-1]}
                else:
                    reason = {"type": "length", "length": len(req.output_ids)}
            self._rows = []
            self._finish_locked(req, reason)
            self._publish_state_locked()


def default_thread_count() -> int:
    """Intra-op threads for torch: every CPU this process may run on but one.

    The spare core serves the HTTP loop, and on a gate machine the load generator that
    measures us: measured on 2 cores with one other busy process, 2 torch threads decoded at
    0.9 tok/s (OpenMP threads stall each other when one is preempted) against 11.2 tok/s with 1.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus - 1)
