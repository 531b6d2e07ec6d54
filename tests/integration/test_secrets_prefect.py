"""The whole GateConfig is a Prefect flow parameter (issue 11, finding 13): Prefect's database must
hold it redacted, while the flow, called in-process as `servegate run` calls it, still gets a key it
can send. Against a real (ephemeral) Prefect server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prefect import flow

from servegate.config import REDACTED, GateConfig

pytestmark = pytest.mark.timeout(180)

KEY = "sk-live-0123456789"


def _config() -> GateConfig:
    return GateConfig.model_validate({
        "worker": {"api_key": KEY, "env": {"HF_TOKEN": "hf_secret"}},
        "store": {"url": "postgresql://gate:hunter2@db.example/history"},
    })


@flow(name="secrets-probe", validate_parameters=True)
def _probe(config: GateConfig | None = None, profile: str | None = None,
           overrides: list[str] | None = None) -> dict[str, Any]:
    """The gate flow's parameter signature; returns what the flow body received."""
    from prefect.runtime import flow_run

    assert config is not None
    return {"key": config.worker.api_key_value(), "hf": config.worker.env["HF_TOKEN"], "store": config.store.url,
            "flow_run_id": str(flow_run.get_id())}


async def _stored_parameters(flow_run_id: str) -> dict[str, Any]:
    from prefect import get_client

    async with get_client() as client:
        return (await client.read_flow_run(flow_run_id)).parameters


def test_flow_parameter_is_stored_redacted_and_received_intact(prefect_server) -> None:
    got = _probe(config=_config())
    # In-process, Prefect validates the parameter but passes the model on: the secrets are usable.
    assert (got["key"], got["hf"], got["store"]) == (KEY, "hf_secret", "postgresql://gate:hunter2@db.example/history")
    stored = asyncio.run(_stored_parameters(got["flow_run_id"]))
    text = json.dumps(stored)
    assert KEY not in text and "hf_secret" not in text and "hunter2" not in text
    worker = stored["config"]["worker"]
    assert worker["api_key"] == REDACTED and worker["env"]["HF_TOKEN"] == REDACTED
    assert stored["config"]["store"]["url"] == "postgresql://gate:***@db.example/history"


def test_the_gate_flow_serializes_its_config_redacted() -> None:
    """What the real gate flow hands Prefect for its flow-run record (Flow.serialize_parameters)."""
    from servegate.flows.gate import regression_gate

    text = json.dumps(regression_gate.serialize_parameters({"config": _config()}))
    assert KEY not in text and "hf_secret" not in text and "hunter2" not in text and REDACTED in text
