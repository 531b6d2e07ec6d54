"""The gate's stages, declared once, and what a stage hands on: a :class:`StageResult`.

Every list of stages or tables elsewhere is derived from :data:`STAGES` (rerunnable stages,
measurement stages, what each stage needs of its engine, which tables it produces — the last
from ``servegate.tables``). A stage's *run function* is a plain function
``(run, result) -> None`` that measures and puts its tables into ``result.tables`` as it goes, so
that whatever it measured before a failure is still there for the run folder; the Prefect task
in ``tasks/`` is a thin wrapper (``servegate.tasks._stage.perform``), and the flow passes the
results on to compare, validate, verdict and record.

Pipeline::

    launch -> warmup -> (flush -> measure) for one_batch, serving, occupancy, quality, capacity
           -> paired (its own baseline and candidate workers, when a baseline is configured)
           -> compare -> validate -> verdict -> record
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import pandas as pd

from servegate.tables import TABLE_STAGE

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from servegate.config import GateConfig
    from servegate.engines.base import Engine
    from servegate.launch import WorkerHandle
    from servegate.results import RunFolder, StageRecord

__all__ = ["StageSpec", "StageResult", "STAGES", "MEASUREMENT_STAGES", "RERUNNABLE", "Status", "spec", "tables_of",
           "check_config", "refresh_worker_table"]

Status = Literal["ok", "failed", "skipped", "not_applicable"]


@dataclass
class StageResult:
    """What one stage did: its status, its tables (as measured, partial ones on failure), notes."""

    stage: str
    status: Status = "ok"
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    """Tables the stage produced, by name; on failure, what it measured before (kept as ``.partial``)."""
    error: str | None = None
    """Why it failed, was skipped or is not applicable."""
    duration_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    """What a later step needs besides tables (e.g. compare's calibration summary, launch's URL)."""
    remarks: list[str] = field(default_factory=list)
    """What a reader of the run should know about how it was measured (e.g. a discarded attempt)."""
    complete: bool = False
    """The measurement ran to its end (its tables are whole), even if the stage then failed."""
    started: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def record(self) -> "StageRecord":
        """The run folder's record of this stage (``stages.json``, the manifest)."""
        from servegate.results import StageRecord

        tables = sorted(self.tables) if self.ok or self.complete else []
        return StageRecord(stage=self.stage, status=self.status, error=self.error,
                           duration_s=round(self.duration_s, 3), tables=tables, remarks=list(self.remarks))

    @classmethod
    def from_record(cls, record: "StageRecord", tables: dict[str, pd.DataFrame]) -> "StageResult":
        """A stage an earlier attempt measured, taken as it was (``servegate rerun``)."""
        return cls(stage=record.stage, status=record.status, tables=dict(tables), error=record.error,
                   duration_s=float(record.duration_s or 0.0), remarks=list(record.remarks), complete=True)


def tables_of(results: "list[StageResult]") -> dict[str, pd.DataFrame]:
    """Every table the results hold (a stage that failed mid-measurement holds none)."""
    return {name: df for r in results for name, df in r.tables.items()}


class RunContext(Protocol):
    """What a run function uses of its gate run (``servegate.runstate.GateRun`` is one): declared
    here so that the registry does not depend on the run state, which depends on it."""

    config: "GateConfig"
    folder: "RunFolder"
    engine: "Engine"
    worker: "WorkerHandle | None"

    @property
    def path(self) -> "Path": ...

    @property
    def base_url(self) -> str: ...

    @property
    def api_key(self) -> str | None: ...

    def adopt_worker(self, handle: "WorkerHandle") -> None: ...


RunFunction = Callable[[RunContext, StageResult], None]


@dataclass(frozen=True)
class StageSpec:
    """One stage of the gate."""

    name: str
    section: str | None
    """Config section whose ``enabled`` turns the stage off (None: always on)."""
    flushed: bool
    """A measurement: starts from a flushed, idle worker (a flush stage ``flush:<name>`` runs first)."""
    run: RunFunction
    needs: str | None = None
    """Engine capability (``servegate.engines.base.Engine`` flag) without which the stage is not applicable."""
    needs_why: str = ""
    """What the missing capability means, for the reason shown (``engine external <needs_why>``)."""
    own_workers: bool = False
    """A measurement that launches, warms up, flushes and stops its own workers (the paired stage):
    it does not use the gate's worker, which is stopped before it runs."""
    reads: tuple[str, ...] = ()
    """Config sections besides its own that shape what it measures (capacity loads with serving's
    dataset and SLOs): a re-run that carries the stage must not change them."""
    check: "Callable[[GateConfig], None] | None" = None
    """Raises ConfigError when the enabled stage could not measure with this config; run before any
    worker starts (:func:`check_config`)."""

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables this stage produces (``servegate.tables``)."""
        return tuple(t for t, stage in TABLE_STAGE.items() if stage == self.name)

    @property
    def measures(self) -> bool:
        """A measurement stage (re-runnable by ``servegate rerun``)."""
        return self.flushed or self.own_workers

    @property
    def rerunnable(self) -> bool:
        return self.measures


# ---- the run functions ------------------------------------------------------------------------
# Each imports its measurement lazily: building the registry (every CLI start, every task module)
# must not import torch, scipy or GX.

def _launch(run: RunContext, result: StageResult) -> None:
    from servegate.launch import launch_worker
    from servegate.tables import WORKER_COLUMNS

    run.worker = launch_worker(run.config.worker, run.path / "worker.log")
    result.notes["base_url"] = run.worker.base_url
    handle = run.worker
    if handle.launch_note:
        result.remarks.append(handle.launch_note)
    table = pd.DataFrame([{
        "engine": handle.engine.name,
        "startup_s": math.nan if handle.startup_s is None else handle.startup_s,
        "ready_rss_mib": handle.ready_rss_mib,
        "rss_sample_interval_s": math.nan if handle.memory is None else handle.memory.interval_s,
    }], columns=WORKER_COLUMNS)
    handle.table = result.tables["worker"] = table
    _refresh(handle, "launch")


def _refresh(handle: "WorkerHandle", through: str) -> bool:
    table = handle.table
    if not isinstance(table, pd.DataFrame) or handle.memory is None:
        return False
    if handle.is_alive():
        handle.memory.sample()  # the last moment of the stage, not the last half-second tick
    table["peak_rss_mib"] = handle.memory.peak_mib
    table["rss_samples"] = handle.memory.samples
    table["peak_through"] = through
    return True


def refresh_worker_table(run: RunContext, through: str) -> None:
    """After a stage on the gate's worker: its ``worker`` table (the launch stage's, the same frame the
    launch result holds) takes the memory high-water mark through the end of ``through``, in memory and
    in the run folder. The peak is known only once the worker has done its heaviest work, and the
    launch stage's table is what compare, validate and the history read."""
    handle = run.worker
    if handle is not None and _refresh(handle, through):
        run.folder.write_table("worker", handle.table)


def _warmup(run: RunContext, result: StageResult) -> None:
    from servegate.bench.warmup import run_warmup

    result.notes["requests"] = run_warmup(run.base_url, run.engine, run.config.warmup, api_key=run.api_key)


def _one_batch(run: RunContext, result: StageResult) -> None:
    cfg = run.config.one_batch
    if cfg.mode == "offline":
        from servegate.bench.offline import run_offline_one_batch

        table = run_offline_one_batch(run.config.worker.model, cfg, partial=result.tables,
                                      max_total_tokens=run.config.worker.budget().token_capacity)
    else:
        from servegate.bench.one_batch import run_one_batch

        table = run_one_batch(run.base_url, run.engine, cfg, api_key=run.api_key, partial=result.tables)
    result.tables["one_batch"] = table
    run.folder.write_jsonl("one_batch", table.to_dict(orient="records"))


def _prompt_tokenizer(run: RunContext) -> Any:
    """The tokenizer the serving load needs (serving and capacity), loaded once per stage, or None."""
    from servegate.bench.datasets import dataset_needs_tokenizer, load_prompt_tokenizer
    from servegate.bench.protocol import protocol_for

    # A text-only protocol gets its prompts decoded by the model's tokenizer; the text datasets
    # (sharegpt, jsonl) use it to send token ids with exact planned lengths.
    wire = protocol_for(run.engine, run.config.serving.protocol)
    needed = dataset_needs_tokenizer(run.config.serving.dataset, wire.needs_text_prompts)
    return load_prompt_tokenizer(run.config.worker.model) if needed else None


def _serving(run: RunContext, result: StageResult) -> None:
    from servegate.bench.flush import flush_until_idle
    from servegate.bench.serving import run_serving
    from servegate.cost import cost_table

    tokenizer = _prompt_tokenizer(run)
    cfg = run.config.serving
    discarded: list[str] = []
    for attempt in range(1, cfg.invalid_client_retries + 2):
        out = run_serving(run.base_url, run.engine, cfg, api_key=run.api_key, tokenizer=tokenizer,
                          partial=result.tables)
        if bool(out.summary.loc[0, "client_valid"]) or attempt > cfg.invalid_client_retries:
            break
        # The load generator, not the engine, missed its schedule (a host stall of the client:
        # one request dispatched 60-70 ms late among 16 was seen on 2 busy cores). The attempt
        # is kept on disk and the load runs again from a flushed, idle worker: the prompts are
        # seeded, so without a flush the retry would hit the prefix cache the first one filled.
        why = "; ".join(n for n in out.meta["notes"] if n.startswith("client not valid"))
        run.folder.write_table(f"serving_requests_discarded_{attempt}", out.requests)
        discarded.append(f"attempt {attempt} discarded: {why}")
        flush_until_idle(run.base_url, run.engine, run.config.flush, api_key=run.api_key)
    # How the kept load was measured (prefix-cache counters not read, an arrival test not run, ...).
    result.remarks.extend([*discarded, *out.meta.get("notes", [])])
    result.tables.update(serving_requests=out.requests, serving_summary=out.summary)
    run.folder.write_jsonl("serving", out.summary.to_dict(orient="records"))
    cost = cost_table(out.summary, run.config.cost)  # None without [cost] price_per_hour: not shown, not 0
    if cost is not None:
        result.tables["cost"] = cost


def _occupancy(run: RunContext, result: StageResult) -> None:
    from servegate.bench.occupancy import run_occupancy

    out = run_occupancy(run.base_url, run.engine, run.config.occupancy, api_key=run.api_key, partial=result.tables)
    # The accept-length floor applies only to gates that turn speculative decoding on.
    out.summary["speculative_decoding"] = run.config.worker.speculative_num_draft_tokens is not None
    result.tables.update(occupancy_samples=out.samples, occupancy_summary=out.summary)


def _quality(run: RunContext, result: StageResult) -> None:
    from servegate.bench.quality import run_quality

    out = run_quality(run.base_url, run.engine, run.config.quality, api_key=run.api_key,
                      model_for_reference=run.config.worker.model, partial=result.tables)
    result.tables.update(quality_accuracy=out.accuracy, quality_items=out.items,
                         quality_agreement=out.agreement, quality_agreement_rows=out.agreement_rows)


def _capacity(run: RunContext, result: StageResult) -> None:
    from servegate.bench.capacity import run_capacity

    out = run_capacity(run.base_url, run.engine, run.config, api_key=run.api_key, tokenizer=_prompt_tokenizer(run),
                       partial=result.tables)
    result.tables.update(capacity_steps=out.steps, capacity=out.capacity)
    result.remarks.extend(out.remarks)
    invalid = out.steps[~out.steps["client_valid"].astype(bool)]
    result.remarks.extend(f"capacity step {int(r.step)} at {r.request_rate:.4g} req/s discarded: client not valid, "
                          f"load run again" for r in invalid.itertuples())


def _check_capacity(config: "GateConfig") -> None:
    from servegate.bench.capacity import check_capacity_config

    check_capacity_config(config)


def _paired(run: RunContext, result: StageResult) -> None:
    from servegate.paired.rounds import run_paired

    measured = run_paired(run.config, run.path, result.tables, register=run.adopt_worker)
    result.notes["stopped_because"] = measured.stopped_because
    result.remarks.extend(measured.remarks)  # e.g. a profile that could not be recorded, and why


def _flush(run: RunContext, result: StageResult) -> None:
    from servegate.bench.flush import flush_until_idle

    result.notes["waited_s"] = flush_until_idle(run.base_url, run.engine, run.config.flush, api_key=run.api_key)


STAGES: dict[str, StageSpec] = {s.name: s for s in (
    StageSpec("launch", None, flushed=False, run=_launch),
    StageSpec("warmup", "warmup", flushed=False, run=_warmup),
    StageSpec("one_batch", "one_batch", flushed=True, run=_one_batch, needs="takes_prompt_batches",
              needs_why="takes no list of prompts in one request, which one-batch sends as its batch"),
    # Its cost table is priced with [cost]: a re-run that carries serving must not re-price it.
    StageSpec("serving", "serving", flushed=True, run=_serving, reads=("cost",)),
    StageSpec("occupancy", "occupancy", flushed=True, run=_occupancy, needs="has_metrics",
              needs_why="exposes no Prometheus metrics the gate can rely on"),
    StageSpec("quality", "quality", flushed=True, run=_quality, needs="has_logprobs",
              needs_why="does not promise the prompt log-probabilities the quality stage scores"),
    # Last on the gate's worker: the sweep is the longest, most loading measurement (it drives the
    # worker past its capacity), so the stages before it are measured as they would be without it
    # and a worker it overloads or kills costs none of them.
    StageSpec("capacity", "capacity", flushed=True, run=_capacity, reads=("serving",), check=_check_capacity),
    StageSpec("paired", "paired", flushed=False, run=_paired, own_workers=True),
)}
"""The worker's stages in gate order. compare, validate, verdict and record work on their results."""

FLUSH = StageSpec("flush", "flush", flushed=False, run=_flush)
"""The flush before each measurement (recorded as ``flush:<stage>``)."""

MEASUREMENT_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES.values() if s.measures)
"""Measurement stages in gate order: each of the gate's worker starts from a flushed, idle worker;
the paired stage (last) runs its own workers."""
RERUNNABLE: tuple[str, ...] = tuple(s.name for s in STAGES.values() if s.rerunnable)
"""What ``servegate rerun --task`` accepts."""


def check_config(config: "GateConfig", stages: "tuple[str, ...] | list[str] | None" = None) -> None:
    """Run the config checks of the enabled ``stages`` (default: all): ConfigError before any worker starts."""
    for name in stages if stages is not None else STAGES:
        declared = STAGES[name]
        section = getattr(config, declared.section, None) if declared.section else None
        if declared.check is not None and getattr(section, "enabled", True):
            declared.check(config)


def spec(name: str) -> StageSpec:
    """The stage called ``name`` (``flush:<stage>`` is the flush before it)."""
    return FLUSH if name.startswith("flush:") else STAGES[name]
