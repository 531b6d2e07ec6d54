"""Versioned result records and the run folder that holds one gate run's outputs.

A gate run writes everything it measures into its own folder as soon as it has it, so
that a later stage failing (or the process being killed) loses nothing already measured::

    <output_dir>/<YYYYmmdd-HHMMSS>-<gate>-<short uuid>/
        manifest.json          RunManifest: identity, config, seeds, git, host, environment, stage records
        host.json              the environment record and host checks (servegate.hostcheck)
        config.json            the GateConfig snapshot (aliases, JSON mode)
        <table>.parquet        one per stage table (lossless: list columns such as itls_ms)
        <table>.csv            the same table for humans and spreadsheets (lists JSON-encoded)
        <name>.jsonl           SGLang-style JSONL (one_batch.jsonl with SGLang field names)
        <name>.json            any other document (verdict.json, server_info.json, ...)

Every file is written atomically (a temporary file in the same folder, then ``os.replace``),
so a reader never sees half a table and an interrupted write leaves the old file in place.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import servegate
from servegate import jsonio
from servegate.config import REDACTED, GateConfig, is_secret_env_name, redact_url
from servegate.errors import ConfigError, StageError
from servegate.hostcheck import HostRecord
from servegate.provenance import HostInfo, collect_host_info, git_branch, git_revision

__all__ = [
    "SCHEMA_VERSION",
    "StageStatus",
    "StageRecord",
    "RunManifest",
    "RunFolder",
]

SCHEMA_VERSION = "1"
"""Version of the records in this module (with ``servegate.provenance.HostInfo``, which the
manifest embeds) and of the run-folder layout; bump on any incompatible change so that readers
of old run folders can tell."""

StageStatus = Literal["ok", "failed", "skipped", "not_applicable"]

MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class StageRecord(_Record):
    """What happened to one stage of a gate run."""

    stage: str = Field(description="stage name: launch, warmup, flush, one_batch, serving, occupancy, quality, validate")
    status: StageStatus = Field(description="ok | failed | skipped (disabled by config) | not_applicable (engine/profile)")
    error: str | None = Field(None, description="the error message when status is failed")
    duration_s: float | None = Field(None, ge=0, description="wall time of the stage in seconds")
    tables: list[str] = Field(default_factory=list, description="files this stage wrote, relative to the run folder")
    started_at: datetime | None = Field(None, description="UTC start time")
    remarks: list[str] = Field(default_factory=list,
                               description="how the stage measured, when a reader should know (a discarded attempt)")


class RunManifest(_Record):
    """Identity and provenance of one gate run (``manifest.json``)."""

    schema_version: str = Field(SCHEMA_VERSION, description="version of this record layout")
    run_id: str = Field(description="the run folder's name: <YYYYmmdd-HHMMSS>-<gate>-<short uuid>")
    gate: str = Field(description="gate name (part of the gate key)")
    hardware: str | None = Field(None, description="hardware profile name (part of the gate key)")
    engine: str | None = Field(None, description="engine name: embedded, sglang, vllm, external")
    model: str | None = Field(None, description="model name or path given to the engine")
    config: dict[str, Any] = Field(default_factory=dict, description="the GateConfig snapshot (JSON mode, aliases)")
    seeds: dict[str, int] = Field(default_factory=dict, description="seed per stage, e.g. {'serving': 1}")
    servegate_version: str = Field(servegate.__version__, description="servegate package version")
    git_revision: str | None = Field(None, description="git HEAD of the working directory, None outside a repository")
    git_dirty: bool | None = Field(None, description="True when the working tree has uncommitted changes")
    git_branch: str | None = Field(None, description="checked-out branch, None when detached or outside a repository")
    host: HostInfo = Field(description="the machine the gate ran on")
    environment: HostRecord | None = Field(None, description=(
        "the environment record taken before the first measurement (host.json: load, governors, thread "
        "settings, GPU driver and clocks, the host checks' findings); None before it is taken"))
    started_at: datetime = Field(default_factory=_utcnow, description="UTC time the run folder was created")
    finished_at: datetime | None = Field(None, description="UTC time the run was finished (None while running)")
    stages: list[StageRecord] = Field(default_factory=list, description="one record per stage, in execution order")


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise ConfigError(f"invalid result name {name!r}: use letters, digits, '_', '-', '.' only "
                          f"(no path separators), e.g. 'serving_summary'")
    return name


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")
    return slug or "gate"


@contextmanager
def _atomic_open(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Write to a temporary file next to ``path`` and move it into place only on success."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _is_container(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict)) or (hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0)


def _csv_frame(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``df`` whose list/dict cells are JSON strings (CSV has no list type)."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object and out[col].map(_is_container).any():
            out[col] = out[col].map(
                lambda v: jsonio.dumps(v) if _is_container(v) else v)
    return out


def _redact(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Secrets out of a config snapshot that did not come from ``GateConfig.model_dump(mode="json")``
    (which already redacts them): the API key, secret-named env values, URL passwords."""
    worker = snapshot.get("worker")
    if isinstance(worker, dict):
        if worker.get("api_key"):
            worker["api_key"] = REDACTED
        env = worker.get("env")
        if isinstance(env, dict):
            worker["env"] = {k: (REDACTED if is_secret_env_name(k) else v) for k, v in env.items()}
        if isinstance(worker.get("url"), str):
            worker["url"] = redact_url(worker["url"])
    store = snapshot.get("store")
    if isinstance(store, dict) and isinstance(store.get("url"), str):
        store["url"] = redact_url(store["url"])
    return snapshot


class RunFolder:
    """One gate run's folder: manifest, config snapshot, stage tables and documents."""

    def __init__(self, path: Path, manifest: RunManifest) -> None:
        self._path = Path(path)
        self._manifest = manifest

    # ---- creation -------------------------------------------------------------------
    @classmethod
    def create(cls, output_dir: str | Path, gate_name: str) -> "RunFolder":
        """Make ``<output_dir>/<YYYYmmdd-HHMMSS>-<gate>-<short uuid>/`` and write its manifest."""
        started = _utcnow()
        run_id = f"{started:%Y%m%d-%H%M%S}-{_slug(gate_name)}-{uuid.uuid4().hex[:8]}"
        path = Path(output_dir) / run_id
        try:
            path.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            raise ConfigError(f"cannot create run folder {path}: {exc}; set output_dir to a writable folder") from exc
        rev, dirty = git_revision()
        manifest = RunManifest(run_id=run_id, gate=gate_name, host=collect_host_info(), started_at=started,
                               git_revision=rev, git_dirty=dirty, git_branch=git_branch() if rev else None)
        folder = cls(path, manifest)
        try:
            folder.write_manifest()
        except BaseException:
            folder.discard()
            raise
        return folder

    def discard(self) -> None:
        """Remove the folder of a run that never began (its manifest or config could not be written,
        e.g. a full disk): a half-made run folder would look like a run that measured nothing."""
        shutil.rmtree(self._path, ignore_errors=True)

    @classmethod
    def open(cls, path: str | Path) -> "RunFolder":
        """Re-open an existing run folder (e.g. to re-run one stage) from its manifest."""
        path = Path(path)
        manifest_path = path / MANIFEST_FILE
        try:
            manifest = RunManifest.model_validate_json(manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"{path} is not a run folder (no {MANIFEST_FILE}); pass a folder made by a gate run") \
                from exc
        except ValidationError as exc:
            raise ConfigError(f"{manifest_path} does not match schema version {SCHEMA_VERSION}: {exc}") from exc
        return cls(path, manifest)

    # ---- properties -----------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._path

    @property
    def manifest(self) -> RunManifest:
        return self._manifest

    def __repr__(self) -> str:
        return f"RunFolder({str(self._path)!r})"

    # ---- writers --------------------------------------------------------------------
    def write_manifest(self) -> Path:
        """(Re)write ``manifest.json`` from the in-memory manifest."""
        return self._write_text(MANIFEST_FILE, self._manifest.model_dump_json(indent=2))

    def write_config(self, cfg: GateConfig) -> Path:
        """Snapshot the gate config to ``config.json`` and record identity and seeds in the manifest.

        Infinite values (``serving.request_rate = inf``) are written as the string ``"inf"``,
        which ``GateConfig.model_validate`` reads back, so the snapshot reloads as the same config.
        Secrets are replaced by ``"<redacted>"``: ``worker.api_key`` and ``worker.env`` entries whose
        name contains TOKEN, KEY, SECRET, PASSWORD or CREDENTIAL; passwords in ``store.url`` and
        ``worker.url`` become ``***`` (run folders get shared and archived).
        """
        snapshot = _redact(jsonio.non_finite_as_strings(cfg.model_dump(mode="json", by_alias=True)))
        m = self._manifest
        m.config = snapshot
        m.hardware = cfg.hardware
        m.engine = cfg.worker.engine
        m.model = cfg.worker.model
        m.seeds = {"one_batch": cfg.one_batch.seed, "serving": cfg.serving.seed}
        path = self._write_text(CONFIG_FILE, jsonio.dumps(snapshot, indent=True))
        self.write_manifest()
        return path

    def write_table(self, name: str, df: pd.DataFrame) -> list[Path]:
        """Write ``<name>.parquet`` (lossless) and ``<name>.csv`` (lists as JSON); returns both paths."""
        _check_name(name)
        parquet = self._path / f"{name}.parquet"
        csv = self._path / f"{name}.csv"
        try:
            with _atomic_open(parquet, "wb") as fh:
                df.to_parquet(fh, index=False, engine="pyarrow")
        except (ValueError, TypeError, NotImplementedError) as exc:  # pyarrow ArrowInvalid/ArrowTypeError/ArrowNotImplementedError
            raise StageError(f"table {name!r} could not be written as parquet: {exc}; "
                             f"give each column one type (lists of numbers for list columns)") from exc
        with _atomic_open(csv, "w") as fh:
            _csv_frame(df).to_csv(fh, index=False)
        return [parquet, csv]

    def write_jsonl(self, name: str, records: Iterable[dict[str, Any]]) -> Path:
        """Write ``<name>.jsonl``: one JSON object per line (SGLang's result-file format).

        Field names are kept as given, e.g. SGLang's one-batch fields ``batch_size, input_len,
        output_len, latency, input_throughput, output_throughput, overall_throughput, last_ttft``.
        NaN/inf become null (JSON has no NaN).
        """
        _check_name(name)
        path = self._path / f"{name}.jsonl"
        with _atomic_open(path, "w") as fh:
            for rec in records:
                fh.write(jsonio.dumps(rec) + "\n")
        return path

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``<name>.json`` by :mod:`servegate.jsonio` (pydantic models in JSON mode, NaN as null)."""
        _check_name(name)
        return self._write_text(f"{name}.json", jsonio.dumps(obj, indent=True))

    def record_stage(self, record: StageRecord) -> None:
        """Append (or replace, on a re-run) a stage record and rewrite the manifest at once."""
        stages = [s for s in self._manifest.stages if s.stage != record.stage]
        stages.append(record)
        self._manifest.stages = stages
        self.write_manifest()

    def finish(self) -> None:
        """Stamp ``finished_at`` and rewrite the manifest."""
        self._manifest.finished_at = _utcnow()
        self.write_manifest()

    # ---- readers --------------------------------------------------------------------
    def has_table(self, name: str) -> bool:
        return (self._path / f"{_check_name(name)}.parquet").is_file()

    def read_table(self, name: str) -> pd.DataFrame:
        """Read a table back from its parquet file (list columns come back as lists)."""
        path = self._path / f"{_check_name(name)}.parquet"
        if not path.is_file():
            raise StageError(f"table {name!r} was not produced in {self._path}; re-run the stage that writes it")
        df = pd.read_parquet(path, engine="pyarrow")
        for col in df.columns:
            # pyarrow returns list cells as numpy arrays; give callers plain lists as written.
            if df[col].dtype == object and df[col].map(lambda v: hasattr(v, "tolist") and getattr(v, "ndim", 0) > 0).any():
                df[col] = df[col].map(lambda v: v.tolist() if hasattr(v, "tolist") else v)
        return df

    def read_jsonl(self, name: str) -> list[dict[str, Any]]:
        path = self._path / f"{_check_name(name)}.jsonl"
        with open(path, encoding="utf-8") as fh:
            return [jsonio.loads(line) for line in fh if line.strip()]

    def read_json(self, name: str) -> Any:
        return jsonio.loads((self._path / f"{_check_name(name)}.json").read_text(encoding="utf-8"))

    # ---- internals ------------------------------------------------------------------
    def _write_text(self, filename: str, text: str) -> Path:
        path = self._path / filename
        with _atomic_open(path, "w") as fh:
            fh.write(text)
        return path
