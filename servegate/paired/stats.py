"""Paired statistics over rounds: the log ratio B/A per round, and an interval that stays valid
however often it is looked at (the paired stage stops as soon as every gated metric is decided).

The interval is the *asymptotic confidence sequence* of Waudby-Smith, Arnold, Wu, Howard and
Ramdas ("Time-uniform central limit theory and asymptotic confidence sequences", Annals of
Statistics, 2024; eq. 2.4): with the running mean ``m_t`` and sd ``s_t`` of ``t`` per-round log
ratios, ::

    m_t ± s_t · sqrt( 2 (t ρ² + 1) / (t² ρ²) · log( sqrt(t ρ² + 1) / α ) )

covers the true mean at every ``t`` at once with probability about ``1 − α``, so stopping at the
first round where it is decided keeps the false-alarm rate at α. ``ρ`` makes the sequence
tightest at ``design_rounds`` (their eq. 2.5). Why this one: it needs no known variance and no
bound on the data (a group-sequential design fixes the looks in advance; a betting confidence
sequence needs bounded data; the normal-mixture boundary needs a known sd), it is one closed
form, and the ``confseq`` package that implements it does not build here (it needs Boost). It is
asymptotic: in the first rounds the sample sd is unreliable, so the gate starts looking at
``min_rounds`` and floors the sd at ``sd_floor``. ``benchmarks/paired_sequential.py`` simulates
its false-alarm rate under optional stopping with the noise measured on this machine.

Decisions per metric are those of the history comparison (``servegate.compare.decide_change``:
regression / improvement only when the whole interval is beyond the bound, no_change only when
a regression of the bound is excluded, else inconclusive).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "asymptotic_cs_halfwidth", "ratio_interval"]


def _rho2(alpha: float, design_rounds: int) -> float:
    return (-2.0 * math.log(alpha) + math.log(-2.0 * math.log(alpha) + 1.0)) / design_rounds


def asymptotic_cs_halfwidth(t: int, sd: float, alpha: float, design_rounds: int) -> float:
    """Half-width of the two-sided asymptotic confidence sequence for a mean after ``t`` samples."""
    if t < 2:
        return math.inf
    rho2 = _rho2(alpha, design_rounds)
    return sd * math.sqrt(2.0 * (t * rho2 + 1.0) / (t * t * rho2) * math.log(math.sqrt(t * rho2 + 1.0) / alpha))


@dataclass(frozen=True)
class Interval:
    """The paired estimate of one metric after some rounds, on the ratio scale (B/A)."""

    rounds: int
    ratio: float
    """exp(mean of the per-round log ratios): the geometric mean ratio."""
    ci_low: float
    ci_high: float
    sd_log: float
    """sample sd of the per-round log ratios (before the floor)."""


def ratio_interval(log_ratios: Sequence[float], *, confidence: float = 0.95, design_rounds: int = 30,
                   sd_floor: float = 0.0) -> Interval:
    """The anytime-valid interval of the ratio B/A from per-round log ratios (module docstring)."""
    x = np.asarray([v for v in log_ratios if math.isfinite(v)], dtype=float)
    t = int(x.size)
    if t == 0:
        return Interval(0, math.nan, math.nan, math.nan, math.nan)
    mean = float(x.mean())
    sd = float(x.std(ddof=1)) if t > 1 else math.nan
    half = asymptotic_cs_halfwidth(t, max(sd, sd_floor) if t > 1 else math.inf, 1.0 - confidence, design_rounds)
    return Interval(t, math.exp(mean), math.exp(mean - half), math.exp(mean + half), sd)
