"""Publish markdown artifacts when running inside a Prefect run (no-op under ``.fn()``)."""

from __future__ import annotations

import re

import pandas as pd
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext, TaskRunContext


def _key(*parts: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def publish(gate: str, stage: str, markdown: str, description: str | None = None) -> None:
    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    create_markdown_artifact(markdown=markdown, key=_key("servegate", gate, stage), description=description)


def table_markdown(df: pd.DataFrame, max_rows: int = 50) -> str:
    shown = df.head(max_rows).drop(columns=[c for c in df.columns if df[c].dtype == object
                                            and df[c].map(lambda v: isinstance(v, (list, dict))).any()])
    return shown.to_markdown(index=False, floatfmt=".4g")
