"""How many gate runs ``servegate calibrate`` makes and which figures it derives: the plan.

Two modes: ``history`` (gate runs compared with earlier A runs, as a nightly is compared with its
history) and ``paired`` (each run is one paired decision of the config's ``paired`` stage: the
baseline worker against the candidate in rounds, until decided). In paired mode ``aa_runs`` and
``runs_per_slowdown`` count decisions, and the bound is the config's ``paired.bound`` (the one the
stopping rule used; ``bounds``, ``baseline_n`` and ``n_boot`` do not apply).

Apart from :mod:`servegate.calibrate` (numpy, pandas, scipy, the history database) so that the
command line can show the plan's defaults in its help without importing the analysis.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from servegate.errors import ConfigError

__all__ = ["CalibrationPlan", "CalibrationMode", "PAIRED_DEFAULTS"]

CalibrationMode = Literal["history", "paired"]

PAIRED_DEFAULTS: dict[str, Any] = {"aa_runs": 20, "slowdowns_pct": (3.0,), "runs_per_slowdown": 20}
"""Paired mode's plan when the command line names none: 20 A/A decisions bound the false-alarm rate
at 14 % (exact one-sided 95 % with 0 of 20); a 3 % forward-pass slowdown (computed) moves smoke-ab's
ITL by about 3 % (×1.025-1.041 with the faster side of the duet kept busy to the end of the slower
one's block; 4 % moved it ×1.038-1.053), twice its 1.5 % bound: the size of regression the paired
gate is meant to catch."""


@dataclass(frozen=True)
class CalibrationPlan:
    """How many gate runs calibration makes, and which figures it derives."""

    aa_runs: int = 6
    slowdowns_pct: tuple[float, ...] = (5.0, 10.0, 30.0)
    runs_per_slowdown: int = 2
    bounds: tuple[float, ...] = (0.02, 0.05)
    baseline_n: int = 5
    confidence: float = 0.95
    n_boot: int = 2000
    mode: CalibrationMode = "history"
    regressions: tuple[str, ...] = ()
    """Zoo members (:mod:`servegate.paired.zoo`: real code changes of the embedded worker) decided like
    slowdowns, ``runs_per_slowdown`` decisions each; paired mode only."""

    def __post_init__(self) -> None:
        if self.mode not in ("history", "paired"):
            raise ConfigError(f"calibration mode is 'history' or 'paired', got {self.mode!r}")
        # history: each comparison needs an earlier A run; paired: every decision stands alone.
        least = 2 if self.mode == "history" else 1
        if self.aa_runs < least:
            raise ConfigError(f"{self.mode} calibration needs at least {least} A/A run{'s' if least > 1 else ''} "
                              f"(--aa-runs), got {self.aa_runs}")
        if any(not (math.isfinite(p) and p > 0) for p in self.slowdowns_pct):
            raise ConfigError(f"slowdowns are percentages > 0 (e.g. --slowdowns 5,10,30), got {self.slowdowns_pct}")
        if (self.slowdowns_pct or self.regressions) and self.runs_per_slowdown < 1:
            raise ConfigError("--runs-per-slowdown must be >= 1 when slowdowns or regressions are given")
        if self.regressions and self.mode != "paired":
            raise ConfigError("--regressions (real code regressions of the zoo) calibrate paired decisions: add "
                              "--paired")
        if len(set(self.regressions)) != len(self.regressions):
            raise ConfigError(f"--regressions names a member twice: {list(self.regressions)}")
        if not self.bounds or any(not 0 < b < 1 for b in self.bounds):
            raise ConfigError(f"bounds are fractions in (0, 1) (e.g. --bounds 0.02,0.05), got {self.bounds}")
        if self.baseline_n < 1:
            raise ConfigError(f"--baseline-n must be >= 1, got {self.baseline_n}")

    def as_dict(self) -> dict[str, Any]:
        """The plan's fields; in paired mode without those that do not apply to it."""
        fields = asdict(self)
        if self.mode == "paired":
            for name in ("bounds", "baseline_n", "confidence", "n_boot"):
                del fields[name]
        return fields
