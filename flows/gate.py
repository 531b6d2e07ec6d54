"""The regression gate: launch -> warmup -> (flush -> measure)* -> validate -> verdict.

Deployment entrypoint: ``flows/gate.py:regression_gate``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from servegate.config import GateConfig
from servegate.gate import GateRun, resolve_config
from servegate.tasks.compare import compare
from servegate.tasks.flush import flush
from servegate.tasks.launch import launch
from servegate.tasks.occupancy import occupancy
from servegate.tasks.one_batch import one_batch
from servegate.tasks.quality import quality
from servegate.tasks.record import record
from servegate.tasks.serving import serving
from servegate.tasks.validate import validate
from servegate.tasks.verdict import verdict
from servegate.tasks.warmup import warmup


@flow(name="regression-gate", log_prints=False, validate_parameters=True)
def regression_gate(config: GateConfig | None = None, profile: str | None = None,
                    overrides: list[str] | None = None) -> dict[str, Any]:
    """Run one gate; returns the verdict (as JSON) and the run folder.

    Give a full ``config``, or a shipped ``profile`` name plus ``section.field=value``
    ``overrides`` (what deployments use: ``profile: smoke``).

    Stage tasks record their own failures in the GateRun (and in the run folder) before
    failing, so the flow goes on to tear the worker down, validate what was measured and
    decide: an infra failure makes the verdict inconclusive, never a pass.
    """
    run = GateRun.open(resolve_config(config, profile, overrides))
    try:
        launch(run, return_state=True)
        warmup(run, return_state=True)
        for measure in (one_batch, serving, occupancy, quality):
            flush(run, measure.name, return_state=True)
            measure(run, return_state=True)
    finally:
        run.close()
    compare(run, return_state=True)
    validate(run, return_state=True)
    recorded = record(run, verdict(run))
    return {"verdict": recorded.verdict.model_dump(mode="json"), "run_dir": str(run.path)}
