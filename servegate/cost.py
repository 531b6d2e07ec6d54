"""What serving a million output tokens costs, from the machine's price per hour (``[cost]``).

``cost_per_mtok(price_per_hour, output_tok_per_s)`` is the price of the hours the serving load's
output-token throughput needs for 10**6 tokens: ``price_per_hour / (throughput * 3600) * 1e6``. It is
the throughput at the gate's own load (``serving.request_rate``), not at the worker's capacity: a
figure to trend and compare between runs of one gate key, not a quote.

No throughput (no request completed, or none with an output token) is an error, never a cost of 0
or infinity: the ``cost`` table is only written when the serving stage measured a throughput.
"""

from __future__ import annotations

import math

import pandas as pd

from servegate.config import CostConfig
from servegate.errors import InsufficientDataError
from servegate.tables import COST_COLUMNS

__all__ = ["cost_per_mtok", "cost_table"]

TOKENS_PER_UNIT = 1_000_000
SECONDS_PER_HOUR = 3600.0


def cost_per_mtok(price_per_hour: float, output_tok_per_s: float) -> float:
    """Cost of 10**6 output tokens at ``output_tok_per_s`` on a machine costing ``price_per_hour``.

    Raises InsufficientDataError when the throughput is not a finite number > 0."""
    if not (isinstance(output_tok_per_s, (int, float)) and math.isfinite(output_tok_per_s) and output_tok_per_s > 0):
        raise InsufficientDataError(f"no output-token throughput to cost (got {output_tok_per_s!r} tok/s): the "
                                    f"serving load completed no request with output tokens; see serving_summary")
    return price_per_hour / (output_tok_per_s * SECONDS_PER_HOUR) * TOKENS_PER_UNIT


def cost_table(serving_summary: pd.DataFrame, cfg: CostConfig) -> pd.DataFrame | None:
    """The one-row ``cost`` table of a serving load (None when no price is configured)."""
    if cfg.price_per_hour is None:
        return None
    throughput = float(serving_summary["output_throughput"].iloc[0])
    row = {"price_per_hour": cfg.price_per_hour, "currency": cfg.currency, "output_throughput": throughput,
           "cost_per_mtok_output": cost_per_mtok(cfg.price_per_hour, throughput)}
    return pd.DataFrame([row], columns=COST_COLUMNS)
