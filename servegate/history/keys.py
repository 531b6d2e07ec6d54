"""Who a gate run is: its gate key (what a baseline is per) and its recorded attempt."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from servegate.errors import ConfigError

__all__ = ["GateKey", "RunRecord"]


@dataclass(frozen=True, order=True)
class GateKey:
    """What a baseline is per: (workload = gate name, engine, hardware profile, model).

    Written ``workload/engine/hardware/model``; the model comes last because model names
    often contain ``/`` (``meta-llama/Llama-3.1-8B-Instruct``).
    """

    workload: str
    engine: str
    hardware: str
    model: str

    def __str__(self) -> str:
        return f"{self.workload}/{self.engine}/{self.hardware}/{self.model}"

    @classmethod
    def parse(cls, text: str) -> "GateKey":
        parts = text.split("/", 3)
        if len(parts) != 4 or not all(parts):
            raise ConfigError(f"gate key {text!r} must look like workload/engine/hardware/model, "
                              f"e.g. smoke/embedded/cpu/smollm2-135m (see `servegate status`)")
        return cls(*parts)

    @classmethod
    def from_run(cls, manifest: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> "GateKey":
        """The key of a run from its manifest (``gate, engine, hardware, model``), falling back to
        the config snapshot (``name, worker.engine, hardware, worker.model``)."""
        config = config or manifest.get("config") or {}
        worker = config.get("worker") or {}
        values = {
            "workload": manifest.get("gate") or config.get("name"),
            "engine": manifest.get("engine") or worker.get("engine"),
            "hardware": manifest.get("hardware") or config.get("hardware"),
            "model": manifest.get("model") or worker.get("model"),
        }
        missing = [k for k, v in values.items() if not v]
        if missing:
            raise ConfigError(f"cannot tell the gate key of run {manifest.get('run_id')!r}: {missing} missing from "
                              f"its manifest and config; write the config snapshot (RunFolder.write_config) first")
        return cls(**{k: str(v) for k, v in values.items()})

    def matches(self, pattern: str) -> bool:
        """True when ``pattern`` is this key, a leading part of it (``smoke``, ``smoke/embedded``),
        or a shell-style wildcard over the whole key (``*/sglang/*``)."""
        text = str(self)
        if any(c in pattern for c in "*?["):
            return fnmatch.fnmatchcase(text, pattern)
        return text == pattern or text.startswith(pattern.rstrip("/") + "/")


@dataclass(frozen=True)
class RunRecord:
    """One recorded attempt of a gate run."""

    run_id: str
    key: GateKey
    attempt: int
    attempt_of: str | None  # the root run when this is a re-run, else None
    status: str  # the verdict: pass | fail | inconclusive
    started_at: datetime
    recorded_at: datetime
    branch: str | None
    git_revision: str | None
    run_dir: str | None
    verdict: dict[str, Any] = field(repr=False)
    manifest: dict[str, Any] = field(repr=False)
    config: dict[str, Any] = field(repr=False)

    @property
    def root_id(self) -> str:
        return self.attempt_of or self.run_id
