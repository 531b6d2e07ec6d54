"""The quality stage: both measurements against a flushed, idle worker, over its wire protocol.

Requests are built and their answers parsed by the engine's ``WireProtocol``
(``scoring_body``/``ending_logprobs``, ``greedy_body``/``greedy_outputs``): SGLang-native
``/generate`` with ``return_logprob``/``logprob_start_len``, or OpenAI ``/v1/completions``
with ``echo`` + ``logprobs``. Prompts are sent as token ids so that the endings' token
boundaries are known exactly. Every request goes through ``servegate.http`` (one session per
thread, ``ThreadSessions``), bounded from send to last byte by ``quality.request_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from servegate.bench.protocol import WireProtocol, protocol_for
from servegate.bench.quality.data import (
    EncodedItem,
    encode_item,
    file_sha256,
    load_mc_items,
    load_reference_prompts,
    load_tokenizer,
    sample_items,
)
from servegate.bench.quality.reference import (
    ReferenceOutput,
    load_reference,
    reference_outputs,
    reference_threads,
    teacher_forced_reference,
)
from servegate.bench.quality.scoring import compare_outputs, score_items, summarise_accuracy, summarise_agreement
from servegate.config import QualityConfig
from servegate.engines.base import Engine
from servegate.errors import ConfigError, StageError
from servegate.http import ThreadSessions, body_excerpt, json_body, make_session, request_within, served_model_name
from servegate.tables import AGREEMENT_ROW_COLUMNS

__all__ = ["QualityResult", "server_ending_logprobs", "server_greedy_outputs", "run_quality"]

_T = TypeVar("_T")


@dataclass
class QualityResult:
    """What the quality stage produced: four tables (units and meaning in the column names)."""

    accuracy: pd.DataFrame
    """One row: ``ACCURACY_COLUMNS``."""
    items: pd.DataFrame
    """One row per scored item: ``ITEM_COLUMNS``."""
    agreement: pd.DataFrame
    """One row: ``AGREEMENT_COLUMNS``."""
    agreement_rows: pd.DataFrame
    """One row per reference prompt: ``AGREEMENT_ROW_COLUMNS``."""


def _post(sessions: ThreadSessions, url: str, body: dict[str, Any], what: str, timeout_s: float) -> Any:
    """POST ``body`` on this thread's session; the JSON answer, ``StageError`` on anything but 200."""
    response = request_within(sessions.get(), "POST", url, limit_s=timeout_s, what=f"{what} (POST {url})",
                              setting="quality.request_timeout_s", json=body, hint="check that the worker is alive")
    if response.status_code != 200:
        raise StageError(f"{what}: POST {url} -> {response.status_code}: {body_excerpt(response)!r}; "
                         f"read the worker log")
    return json_body(response, what)


def _parallel(fn: Callable[[Any], Any], work: Sequence[Any], concurrency: int) -> list[Any]:
    """``[fn(w) for w in work]`` on ``concurrency`` threads; the first error cancels the rest and is raised."""
    if concurrency <= 1 or len(work) <= 1:
        return [fn(w) for w in work]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="servegate-quality") as pool:
        futures = [pool.submit(fn, w) for w in work]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


def server_ending_logprobs(base_url: str, wire: WireProtocol, encoded: Sequence[EncodedItem], *,
                           api_key: str | None = None, model: str | None = None, timeout_s: float = 300.0,
                           concurrency: int = 4) -> list[list[list[float]]]:
    """Each ending's token log-probabilities as the server computes them: one request per item
    scoring all its endings (``wire.scoring_body``), ``concurrency`` at a time. ``model``: the
    served model's name, which the OpenAI protocol requires (``ConfigError`` before any request)."""
    url = wire.url(base_url)

    def score(enc: EncodedItem) -> list[list[float]]:
        what = f"scoring item {enc.item.index}"
        doc = _post(sessions, url, wire.scoring_body(enc.ctx_ids, enc.ending_ids, model), what, timeout_s)
        return wire.ending_logprobs(doc, enc.ctx_ids, enc.ending_ids, what)

    with ThreadSessions(api_key) as sessions:
        return _parallel(score, encoded, concurrency)


def server_greedy_outputs(base_url: str, wire: WireProtocol, prompts: Sequence[Sequence[int]],
                          max_new_tokens: int, *, api_key: str | None = None, model: str | None = None,
                          timeout_s: float = 300.0) -> list[tuple[list[int], list[float | None]]]:
    """The server's greedy output ids and per-token log-probabilities for each prompt (one batched request).

    EOS is ignored so that every output has ``max_new_tokens`` tokens, as the reference does.
    """
    what = "reference agreement"
    with ThreadSessions(api_key) as sessions:
        doc = _post(sessions, wire.url(base_url), wire.greedy_body(prompts, max_new_tokens, model), what, timeout_s)
    return wire.greedy_outputs(doc, len(prompts), what)


def _run_accuracy(base_url: str, wire: WireProtocol, cfg: QualityConfig, tokenizer: Any,
                  api_key: str | None, served_model: str | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    dataset = Path(cfg.dataset_path).expanduser()
    items = sample_items(load_mc_items(dataset), cfg.max_items, cfg.seed)
    encoded = [encode_item(tokenizer, it) for it in items]
    started = time.perf_counter()
    logprobs = server_ending_logprobs(base_url, wire, encoded, api_key=api_key, model=served_model,
                                      timeout_s=cfg.request_timeout_s, concurrency=cfg.concurrency)
    duration = time.perf_counter() - started
    table = score_items(encoded, logprobs)
    return summarise_accuracy(table, dataset=dataset.name, dataset_sha256=file_sha256(dataset), protocol=wire.name,
                              duration_s=duration), table


@dataclass
class _Reference:
    """What the worker's greedy outputs are held to, ready before the worker is asked for them."""

    outputs: list[ReferenceOutput]
    identity: dict[str, Any]
    model: Any | None
    """The loaded in-process reference model (teacher-forced comparison); None for a stored reference."""
    source: str
    n_generate: int
    duration_s: float


def _prepare_reference(cfg: QualityConfig, model_name: str) -> _Reference:
    """The in-process reference run (model load, batched greedy decoding) or the stored reference, checked."""
    started = time.perf_counter()
    prompts = load_reference_prompts(cfg.reference_prompts_path)
    model = None
    if cfg.reference == "in-process":
        reference, identity, model = reference_outputs(model_name, prompts, cfg.reference_max_new_tokens)
        source, n_generate = "in-process", cfg.reference_max_new_tokens
    else:
        reference, identity, stored_tokens = load_reference(cfg.reference)
        source = str(Path(cfg.reference).expanduser())
        if stored_tokens < cfg.exact_match_tokens:
            raise ConfigError(f"stored reference {source} holds {stored_tokens} tokens per prompt but "
                              f"exact_match_tokens is {cfg.exact_match_tokens}; record it with more tokens")
        wanted = dict(prompts)
        stored = {r.prompt_id: r.prompt for r in reference}
        if stored != wanted:
            raise ConfigError(f"stored reference {source} was recorded for other prompts than "
                              f"{cfg.reference_prompts_path}; record it again from these prompts")
        n_generate = min(cfg.reference_max_new_tokens, stored_tokens)
    return _Reference(outputs=reference, identity=identity, model=model, source=source, n_generate=n_generate,
                      duration_s=time.perf_counter() - started)


def _in_background(fn: Callable[..., _T], *args: Any) -> Future[_T]:
    """``fn(*args)`` on a daemon thread; its result (or exception) in the returned future. A daemon,
    so that a stage failing before it asks for the result is not held up by it at exit."""
    future: Future[_T] = Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever asks for the result, raised there
            future.set_exception(exc)

    threading.Thread(target=target, name="servegate-quality-reference", daemon=True).start()
    return future


def _run_agreement(base_url: str, wire: WireProtocol, cfg: QualityConfig, ref: _Reference, model_name: str,
                   api_key: str | None, served_model: str | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    started = time.perf_counter()
    outputs = server_greedy_outputs(base_url, wire, [r.input_ids for r in ref.outputs], ref.n_generate,
                                    api_key=api_key, model=served_model, timeout_s=cfg.request_timeout_s)
    forced: list[list[tuple[float, float]]] | list[None] = [None] * len(ref.outputs)
    if ref.model is not None:
        with reference_threads():
            forced = teacher_forced_reference(ref.model, [r.input_ids for r in ref.outputs],
                                              [ids for ids, _ in outputs], cfg.exact_match_tokens)
    rows = [compare_outputs(ids, lps, r.output_ids, r.output_logprobs, cfg.exact_match_tokens, cfg.logprob_tolerance,
                            prompt_id=r.prompt_id, teacher_forced=tf)
            for r, (ids, lps), tf in zip(ref.outputs, outputs, forced)]
    table = pd.DataFrame(rows, columns=AGREEMENT_ROW_COLUMNS)
    model_label = str(ref.identity.get("name") or ref.identity.get("model") or model_name)
    summary = summarise_agreement(table, n_tokens=cfg.exact_match_tokens, tolerance=cfg.logprob_tolerance,
                                  reference_source=ref.source, reference_model=model_label,
                                  duration_s=ref.duration_s + time.perf_counter() - started)
    return summary, table


def run_quality(base_url: str, engine: Engine, cfg: QualityConfig, api_key: str | None = None, *,
                model_for_reference: str | None = None, tokenizer: Any | None = None,
                partial: dict[str, pd.DataFrame] | None = None) -> QualityResult:
    """Run both quality measurements against a flushed, idle worker.

    ``model_for_reference``: the model (servegate alias, local directory, or cached Hugging Face
    id) whose tokenizer splits contexts from endings and which the in-process reference runs;
    default: the first id the server lists under ``/v1/models``. ``tokenizer`` overrides the
    tokenizer only. ``partial`` (when given) receives each table as soon as it is measured
    (``quality_accuracy`` and ``quality_items``, then ``quality_agreement`` and
    ``quality_agreement_rows``), so that the accuracy survives a failed agreement. Raises
    ``StageError`` when the server answers without log-probabilities, ``ConfigError`` for an
    unusable dataset, prompts file or stored reference.
    """
    wire = protocol_for(engine)
    tables = partial if partial is not None else {}
    served_model: str | None = None
    if wire.needs_model or model_for_reference is None:
        with make_session(api_key) as session:
            served_model = served_model_name(session, base_url, timeout_s=min(cfg.request_timeout_s, 30.0),
                                             setting="quality.request_timeout_s")
    model_name = model_for_reference or served_model or ""
    if tokenizer is None:
        tokenizer = load_tokenizer(model_name)
    # The reference (an in-process run: imports, model load, greedy decoding) is prepared while the
    # worker scores the items; nothing here is timed against the worker, so the overlap costs no accuracy.
    reference = _in_background(_prepare_reference, cfg, model_name)
    accuracy, items = _run_accuracy(base_url, wire, cfg, tokenizer, api_key, served_model)
    tables.update(quality_accuracy=accuracy, quality_items=items)
    agreement, agreement_rows = _run_agreement(base_url, wire, cfg, reference.result(), model_name, api_key,
                                               served_model)
    tables.update(quality_agreement=agreement, quality_agreement_rows=agreement_rows)
    return QualityResult(accuracy=accuracy, items=items, agreement=agreement, agreement_rows=agreement_rows)
