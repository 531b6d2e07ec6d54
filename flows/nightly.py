"""The nightly matrix: one gate run per gate key, fanned out over Prefect work pools, one verdict.

Deployment entrypoint: ``flows/nightly.py:nightly_matrix`` (scheduled in
``deployments/prefect.yaml``). Each gate is a deployment of ``flows/gate.py:regression_gate``
(one per gate key: profile and overrides are its parameters); this flow starts them all at once
with :func:`prefect.deployments.run_deployment` (each becomes a subflow run of the task that
started it, on whichever Prefect worker of the deployment's pool picks it up), waits for every
one, and aggregates: fail if any gate failed, inconclusive if any could not decide and none
failed, pass only when every gate passed.

A gate's verdict is its flow run's persisted result (the gate deployments set
``PREFECT_RESULTS_PERSIST_BY_DEFAULT=true``; on many machines the result storage must be
shared, e.g. ``PREFECT_DEFAULT_RESULT_STORAGE_BLOCK``). A gate run that crashed, was
cancelled, did not finish in time or left no readable result counts as inconclusive.

A failed or inconclusive matrix sends one message (:mod:`servegate.alerts`: verdict, top regressed
metrics per gate, baseline and build range, links) through each Prefect notification block named in
``alert_blocks`` (docs/alerts.md); a pass sends nothing unless ``alert_on_pass``. A message that could
not be sent is logged as an error and listed under ``alerts`` in the result; the verdict stays.
"""

from __future__ import annotations

import os
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import MissingResult
from pydantic import BaseModel, ConfigDict, Field

from servegate.alerts import Alert, AlertLinks, compose_alert, send_alert, should_alert
from servegate.history import Store
from servegate.tasks._artifacts import publish
from servegate.verdict import ExitCode



class GateJob(BaseModel):
    """One entry of the matrix: a gate deployment, optionally with parameters laid over its own."""

    model_config = ConfigDict(extra="forbid")

    deployment: str = Field(description="'<flow name>/<deployment name>', e.g. 'regression-gate/smoke-cpu'")
    parameters: dict[str, Any] = Field(default_factory=dict,
                                       description="flow parameters replacing the deployment's (e.g. overrides)")


def gate_outcome(deployment: str, flow_run: FlowRun) -> dict[str, Any]:
    """What one gate run decided, from its flow run (inconclusive unless it completed with a verdict)."""
    state = flow_run.state
    row: dict[str, Any] = {"deployment": deployment, "flow_run_id": str(flow_run.id),
                           "flow_run_name": flow_run.name, "state": state.type.value if state else None,
                           "status": "inconclusive", "reason": None, "run_dir": None}
    if state is None or not state.is_final():
        row["reason"] = (f"gate run {flow_run.name} did not finish within the matrix timeout "
                         f"(state {state.name if state else 'unknown'}); raise timeout_s or look at its worker")
        return row
    if not state.is_completed():
        row["reason"] = f"gate run {flow_run.name} ended {state.name}: {state.message or 'no message'}"
        return row
    try:
        result = state.result(raise_on_failure=False)
    except MissingResult as exc:
        row["reason"] = (f"gate run {flow_run.name} completed but its result was not persisted ({exc}); set "
                         f"PREFECT_RESULTS_PERSIST_BY_DEFAULT=true in the gate deployment's job variables, "
                         f"with shared result storage when workers run on several machines")
        return row
    verdict = result.get("verdict") if isinstance(result, dict) else None
    if not isinstance(verdict, dict) or verdict.get("status") not in ("pass", "fail", "inconclusive"):
        row["reason"] = f"gate run {flow_run.name} returned no verdict ({type(result).__name__})"
        return row
    row.update(status=verdict["status"], reason=verdict.get("reason"), run_dir=result.get("run_dir"))
    return row


def aggregate(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """Fail if any gate failed; inconclusive if any could not decide and none failed; else pass."""
    statuses = [o["status"] for o in outcomes]
    if not statuses:
        status, reason = "inconclusive", "the matrix has no gates"
    elif "fail" in statuses:
        status, reason = "fail", f"{statuses.count('fail')} of {len(statuses)} gate(s) found a regression"
    elif "inconclusive" in statuses:
        status, reason = "inconclusive", f"{statuses.count('inconclusive')} of {len(statuses)} gate(s) could not decide"
    else:
        status, reason = "pass", f"all {len(statuses)} gate(s) passed"
    return {"status": status, "exit_code": int(ExitCode.of(status)), "reason": reason, "gates": outcomes}


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# nightly matrix: {result['status'].upper()}", "", result["reason"], "",
             "| gate deployment | status | flow run | reason |", "|---|---|---|---|"]
    for g in result["gates"]:
        reason = str(g["reason"] or "").splitlines()[0] if g["reason"] else ""
        lines.append(f"| {g['deployment']} | {g['status']} | {g['flow_run_name']} | {reason} |")
    return "\n".join(lines)


@task(name="gate", cache_policy=NO_CACHE, task_run_name="gate-{job.deployment}")
def run_gate(job: GateJob, timeout_s: float) -> dict[str, Any]:
    """Start one gate deployment and wait for it; its flow run is this task's subflow."""
    from prefect.runtime import flow_run as current

    # Retrying the matrix must not start a second gate run of the same key for the same night.
    key = f"{current.id}:{job.deployment}" if current.id else None
    flow_run = run_deployment(job.deployment, parameters=job.parameters or None, timeout=timeout_s,
                              idempotency_key=key, poll_interval=2)
    return gate_outcome(job.deployment, flow_run)


@task(name="compose-alert", cache_policy=NO_CACHE)
def compose_matrix_alert(result: dict[str, Any], links: AlertLinks) -> Alert:
    """The matrix's one message, from the gates' run folders (baseline builds also from the history
    database when ``SERVEGATE_DB`` is set here)."""
    from prefect.runtime import deployment

    title = deployment.name or "nightly-matrix"
    if not os.environ.get("SERVEGATE_DB"):
        return compose_alert(result, title=title, links=links)
    with Store() as store:
        return compose_alert(result, title=title, links=links, store=store)


@task(name="send-alert", cache_policy=NO_CACHE)
def send_matrix_alert(alert: Alert, block_names: list[str]) -> list[dict[str, Any]]:
    """Send through each block; a failed send is logged as an error, never raised."""
    logger = get_run_logger()
    deliveries = send_alert(alert, block_names)
    for d in deliveries:
        if d["sent"]:
            logger.info("alert sent through notification block %s", d["block"])
        else:
            logger.error("ALERT NOT SENT through notification block %s: %s (the matrix verdict stands; "
                         "check the block with `prefect block inspect %s`)", d["block"], d["error"], d["block"])
    return deliveries


def not_sent(why: str | None, block_names: list[str]) -> list[dict[str, Any]]:
    """Each block's delivery when composing or sending the message failed as a whole (logged as an error)."""
    get_run_logger().error("ALERT NOT SENT: the matrix's message could not be composed or sent (%s); the verdict "
                           "stands", why or "no message")
    return [{"block": name, "sent": False, "error": f"alert failed: {why}"} for name in block_names]


@flow(name="nightly-matrix", log_prints=False, validate_parameters=True)
def nightly_matrix(gates: list[GateJob], timeout_s: float = 6 * 3600, alert_blocks: list[str] | None = None,
                   alert_links: AlertLinks | None = None, alert_on_pass: bool = False) -> dict[str, Any]:
    """Run every gate of the matrix at once (the work pools and device slots pace them); one verdict.

    ``alert_blocks``: Prefect notification blocks (``<block-type-slug>/<block-name>``) that get the
    matrix's one message when it failed or could not decide (and on a pass with ``alert_on_pass``);
    ``alert_links``: where the message's report and dashboard links point."""
    futures = [run_gate.submit(job, timeout_s) for job in gates]
    result = aggregate([f.result() for f in futures])
    publish("nightly", "matrix", _markdown(result), description=f"nightly matrix: {result['status']}")
    if alert_blocks and should_alert(result, on_pass=alert_on_pass):
        # An alert that cannot be composed or sent is logged; it never changes the matrix's verdict.
        alert = compose_matrix_alert(result, alert_links or AlertLinks(), return_state=True)
        sent = send_matrix_alert(alert.result(), alert_blocks, return_state=True) if alert.is_completed() else alert
        result["alerts"] = sent.result() if sent.is_completed() else not_sent(sent.message, alert_blocks)
    return result
