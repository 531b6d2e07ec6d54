"""How many gate runs ``servegate calibrate`` makes and which figures it derives: the plan.

Apart from :mod:`servegate.calibrate` (numpy, pandas, scipy, the history database) so that the
command line can show the plan's defaults in its help without importing the analysis.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from servegate.errors import ConfigError

__all__ = ["CalibrationPlan"]


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

    def __post_init__(self) -> None:
        if self.aa_runs < 2:
            raise ConfigError(f"calibration needs at least 2 A/A runs (--aa-runs), got {self.aa_runs}")
        if any(not (math.isfinite(p) and p > 0) for p in self.slowdowns_pct):
            raise ConfigError(f"slowdowns are percentages > 0 (e.g. --slowdowns 5,10,30), got {self.slowdowns_pct}")
        if self.slowdowns_pct and self.runs_per_slowdown < 1:
            raise ConfigError("--runs-per-slowdown must be >= 1 when slowdowns are given")
        if not self.bounds or any(not 0 < b < 1 for b in self.bounds):
            raise ConfigError(f"bounds are fractions in (0, 1) (e.g. --bounds 0.02,0.05), got {self.bounds}")
        if self.baseline_n < 1:
            raise ConfigError(f"--baseline-n must be >= 1, got {self.baseline_n}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
