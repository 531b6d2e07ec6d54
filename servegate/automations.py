"""Missing-data alarms: Prefect automations that alert when a scheduled gate key produced no verdict.

A nightly gate is only useful if someone hears that it did *not* run. The deployments of
``deployments/prefect.yaml`` that are watched are the gates (``flows/gate.py:regression_gate``) and
every deployment with an active schedule (the nightly matrices, calibration). For each, the server's
own trigger evaluation (no poller of ours) sends a message through a notification block when:

``deadline``  (proactive, one per deployment) a flow run went ``Late`` (no worker picked it up: the
              machine is down) or started ``Running``, and did not reach a final state within the
              deployment's deadline (hung, or the machine died under it);
``ended``     (reactive, one per flow) a flow run ended ``Failed``, ``TimedOut``, ``Crashed`` or
              ``Cancelled``: it left no verdict (a gate that finds a regression still *completes*);
``silent``    (proactive, one per scheduled deployment) no run of the deployment completed within
              its schedule's longest gap plus its deadline after the last one that did: the
              deployment was paused, its schedule switched off, its runs deleted. It watches from
              the first completed run on, and alerts once per silence.

Deadlines come from the file: a matrix's ``timeout_s`` (the matrix gives up on its gates then) plus
:data:`MARGIN_S`; a gate's is the largest ``timeout_s`` of the matrices that start it plus the
margin (a gate may wait in its pool's queue behind the others, ``--limit 1`` per machine); any other
scheduled deployment gets :data:`DEFAULT_DEADLINE_S`. All can be overridden per deployment.

:func:`install` is idempotent: each automation is named :data:`NAME_PREFIX` + what it watches; one of
the same name is updated in place (duplicates removed), and one under the prefix that is no longer
defined (a deployment dropped from the file) is deleted. See docs/missing-data.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from uuid import UUID

import yaml
from pydantic import BaseModel, ConfigDict, Field

from servegate.errors import ConfigError, InfraError, ServerUnreachableError

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.events.schemas.automations import Automation, AutomationCore

__all__ = ["NAME_PREFIX", "MARGIN_S", "DEFAULT_DEADLINE_S", "GATE_ENTRYPOINT", "Watched", "InstallStep",
           "watched_deployments", "alarm_automations", "install", "install_missing_data_alarms",
           "list_alarms", "resolve_block", "flow_names"]

NAME_PREFIX = "servegate missing-data: "
"""Every automation of this module is named so; :func:`install` owns exactly the automations under it."""
MARGIN_S = 900.0
"""Added to a matrix's ``timeout_s``: after its last gate's timeout the matrix still reads results and records."""
DEFAULT_DEADLINE_S = 6 * 3600.0
"""For a scheduled deployment with no ``timeout_s`` parameter (calibration: 12 smoke gates take ~30 min)."""
GATE_ENTRYPOINT = "flows/gate.py:regression_gate"
T = TypeVar("T")
MIN_WINDOW_S = 10.0
"""Prefect evaluates a proactive trigger over at least 10 s (``EventTrigger.within``)."""

FINAL = ("prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.TimedOut",
         "prefect.flow-run.Crashed", "prefect.flow-run.Cancelled")
NO_VERDICT = ("prefect.flow-run.Failed", "prefect.flow-run.TimedOut", "prefect.flow-run.Crashed",
              "prefect.flow-run.Cancelled")


class Watched(BaseModel):
    """One deployment of the file that must produce a verdict, and by when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the deployment's name in prefect.yaml, e.g. 'nightly-cpu'")
    deadline_s: float = Field(ge=MIN_WINDOW_S, description="seconds from Late/Running to a final state")
    deadline_source: str = Field(description="where the deadline came from, said in every alert")
    silence_s: float | None = Field(None, ge=MIN_WINDOW_S, description=(
        "seconds after a completed run by which the next must complete (schedule gap + deadline); "
        "None for a deployment without an active schedule"))
    silence_source: str | None = Field(None, description="where the silence window came from")
    schedule: str | None = Field(None, description="the schedule as written, e.g. '0 1 * * * America/Los_Angeles'")


class InstallStep(BaseModel):
    """What :func:`install` did with one automation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    action: Literal["created", "updated", "deleted"]
    id: UUID


# ---- what to watch, from deployments/prefect.yaml ---------------------------------------------
def _load(prefect_file: Path | str) -> dict[str, Any]:
    path = Path(prefect_file)
    if not path.is_file():
        raise ConfigError(f"no Prefect project file at {path}: run from the repository root or pass "
                          f"--prefect-file deployments/prefect.yaml")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("deployments"), list):
        raise ConfigError(f"{path} has no 'deployments:' list; is it a prefect.yaml?")
    return doc


def _longest_gap_s(schedule: Mapping[str, Any], name: str) -> float:
    """The longest time between two runs of the schedule over the coming year (a nightly cron in a
    zone with summer time has a 25-hour night), computed by the same code as Prefect's scheduler."""
    if "interval" in schedule:
        return float(schedule["interval"])
    if "cron" not in schedule:
        raise ConfigError(f"deployment {name}: only cron and interval schedules are understood, got "
                          f"{sorted(schedule)}; give its window with --silence-s {name}=SECONDS")
    from prefect.server.schemas.schedules import CronSchedule

    cron = CronSchedule(cron=schedule["cron"], timezone=schedule.get("timezone") or "UTC",
                        day_or=schedule.get("day_or", True))
    start = datetime.now(timezone.utc)
    dates = asyncio.run(cron.get_dates(n=1000, start=start, end=start + timedelta(days=400)))
    if len(dates) < 2:
        raise ConfigError(f"deployment {name}: its schedule {schedule['cron']!r} fires less than twice a year; "
                          f"give its window with --silence-s {name}=SECONDS")
    return max((b - a).total_seconds() for a, b in zip(dates, dates[1:]))


def _per_deployment(option: str, values: Sequence[str], names: Iterable[str]) -> tuple[float | None, dict[str, float]]:
    """``--deadline-s 600`` (all) and ``--deadline-s nightly-cpu=18000`` (one) as (default, per name)."""
    known = set(names)
    default, per = None, {}
    for raw in values:
        name, sep, number = raw.rpartition("=")
        name = name.rpartition("/")[2]
        try:
            seconds = float(number)
        except ValueError:
            raise ConfigError(f"{option} {raw!r}: expected SECONDS or DEPLOYMENT=SECONDS") from None
        if not seconds >= MIN_WINDOW_S or seconds == float("inf"):
            raise ConfigError(f"{option} {raw!r}: must be a finite number of seconds >= {MIN_WINDOW_S:g} "
                              f"(Prefect's shortest window for a proactive trigger)")
        if not sep:
            default = seconds
        elif name not in known:
            raise ConfigError(f"{option} {raw!r}: no watched deployment {name!r}; watched: {sorted(known)}")
        else:
            per[name] = seconds
    return default, per


def watched_deployments(prefect_file: Path | str, only: Sequence[str] = (), deadlines: Sequence[str] = (),
                        silences: Sequence[str] = ()) -> list[Watched]:
    """The gate deployments and the actively scheduled ones of ``prefect_file``, with their deadlines
    (``deadlines``/``silences``: ``SECONDS`` for all or ``NAME=SECONDS`` for one; ``only``: names to keep)."""
    doc = _load(prefect_file)
    deployments = [d for d in doc["deployments"] if isinstance(d, dict) and d.get("name")]
    matrix_timeout: dict[str, float] = {}
    for d in deployments:
        params = d.get("parameters") or {}
        for job in params.get("gates") or []:
            gate = str(job.get("deployment", "")).rpartition("/")[2]
            if "timeout_s" in params:
                matrix_timeout[gate] = max(matrix_timeout.get(gate, 0.0), float(params["timeout_s"]))

    candidates = {}
    for d in deployments:
        active = [s for s in d.get("schedules") or [] if isinstance(s, dict) and s.get("active", True)]
        if d.get("entrypoint") == GATE_ENTRYPOINT or active:
            candidates[d["name"]] = (d, active)
    if only:
        wanted = [name.rpartition("/")[2] for name in only]
        unknown = sorted(set(wanted) - set(candidates))
        if unknown:
            raise ConfigError(f"--deployment {unknown}: not a gate or scheduled deployment of {prefect_file}; "
                              f"choose from {sorted(candidates)}")
        candidates = {k: v for k, v in candidates.items() if k in wanted}
    default_deadline, deadline_for = _per_deployment("--deadline-s", deadlines, candidates)
    default_silence, silence_for = _per_deployment("--silence-s", silences, candidates)

    out = []
    for name, (d, active) in candidates.items():
        params = d.get("parameters") or {}
        if name in deadline_for or default_deadline is not None:
            deadline = deadline_for.get(name, default_deadline)
            source = "set at install"
        elif "timeout_s" in params:
            deadline = float(params["timeout_s"]) + MARGIN_S
            source = f"its timeout_s {params['timeout_s']} + {MARGIN_S:g} s"
        elif name in matrix_timeout:
            deadline = matrix_timeout[name] + MARGIN_S
            source = f"the timeout_s {matrix_timeout[name]:g} of the matrix that starts it + {MARGIN_S:g} s"
        else:
            deadline, source = DEFAULT_DEADLINE_S, f"servegate's default {DEFAULT_DEADLINE_S:g} s"
        silence = schedule = silence_source = None
        if active:
            schedule = "; ".join(" ".join(str(s.get(k)) for k in ("cron", "interval", "timezone") if s.get(k))
                                 for s in active)
            silence = silence_for.get(name, default_silence)
            silence_source = "set at install"
            if silence is None:
                # several schedules: any one of them keeps the deployment alive
                gap = min(_longest_gap_s(s, name) for s in active)
                silence, silence_source = gap + deadline, f"its schedule's longest gap {_duration(gap)} + the deadline"
        out.append(Watched(name=name, deadline_s=deadline, deadline_source=source, silence_s=silence,
                           silence_source=silence_source, schedule=schedule))
    return out


# ---- the automations ---------------------------------------------------------------------------
def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return " ".join(f"{v}{u}" for v, u in ((h, "h"), (m, "min"), (s, "s")) if v) or "0s"


def _related(flow: str, deployments: str | list[str]) -> list[dict[str, Any]]:
    return [{"prefect.resource.role": "flow", "prefect.resource.name": flow},
            {"prefect.resource.role": "deployment", "prefect.resource.name": deployments}]


_DEADLINE_BODY = """\
{key}: flow run {{{{ flow_run.name }}}} has no verdict {deadline} after it was due or started \
(deadline {deadline}: {source}).
Why: {{% if event.event == 'prefect.flow-run.Late' %}}it went Late at {{{{ event.occurred }}}} and no worker of \
work pool {{{{ flow_run.work_pool_name }}}} picked it up: the worker machine is down, its Prefect worker stopped, \
or the pool is paused or busy.{{% else %}}it started at {{{{ event.occurred }}}} and has not finished: it hung, \
or its machine died while it ran.{{% endif %}}
Flow run {{{{ flow_run.id }}}}: {{{{ flow_run|ui_url }}}}"""

_ENDED_BODY = """\
{{{{ flow.name }}}}/{{{{ deployment.name }}}}: flow run {{{{ flow_run.name }}}} ended {{{{ flow_run.state.name }}}} \
at {{{{ event.occurred }}}} and left no verdict.
Why: {{{{ flow_run.state.message or 'no message' }}}}
Flow run {{{{ flow_run.id }}}}: {{{{ flow_run|ui_url }}}}"""

_SILENT_BODY = """\
{key}: no run completed within {silence} of the last one (schedule {schedule}; window {silence}: {source}).
Last completed: flow run {{{{ flow_run.name }}}} at {{{{ event.occurred }}}}.
Why: {{% if deployment.paused %}}the deployment is paused.{{% else %}}the deployment is not paused: its schedule \
may be inactive or removed, or its runs were deleted or never finished (see the other servegate missing-data \
alerts).{{% endif %}}
Last completed run {{{{ flow_run.id }}}}: {{{{ flow_run|ui_url }}}}"""


def alarm_automations(watched: Sequence[Watched], flow_of: Mapping[str, str], block_document_id: UUID,
                      ) -> list[AutomationCore]:
    """The automations for ``watched`` (``flow_of``: deployment name -> its flow's name), each sending
    through the notification block ``block_document_id``."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    def notify(subject: str, body: str) -> list[SendNotification]:
        return [SendNotification(block_document_id=block_document_id, subject=subject, body=body)]

    out = []
    per_flow: dict[str, list[str]] = {}
    for w in watched:
        flow = flow_of[w.name]
        key = f"{flow}/{w.name}"
        per_flow.setdefault(flow, []).append(w.name)
        out.append(AutomationCore(
            name=f"{NAME_PREFIX}{key} no verdict by its deadline",
            description=f"A run of {key} that went Late or started Running must end within {w.deadline_s:g} s "
                        f"({w.deadline_source}). servegate.automations; docs/missing-data.md",
            trigger=EventTrigger(
                posture=Posture.Proactive, match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=_related(flow, w.name), after={"prefect.flow-run.Late", "prefect.flow-run.Running"},
                expect=set(FINAL), for_each={"prefect.resource.id"}, threshold=1,
                within=timedelta(seconds=w.deadline_s)),
            actions=notify(f"servegate: no verdict from {key} by its deadline",
                           _DEADLINE_BODY.format(key=key, deadline=_duration(w.deadline_s), source=w.deadline_source))))
        if w.silence_s is not None:
            out.append(AutomationCore(
                name=f"{NAME_PREFIX}{key} silent too long",
                description=f"After a completed run of {key}, the next must complete within {w.silence_s:g} s "
                            f"(schedule {w.schedule}). servegate.automations; docs/missing-data.md",
                trigger=EventTrigger(
                    posture=Posture.Proactive, match={"prefect.resource.id": "prefect.flow-run.*"},
                    match_related=_related(flow, w.name), after={"prefect.flow-run.Completed"},
                    expect={"prefect.flow-run.Completed"}, for_each={"related:deployment:prefect.resource.id"},
                    threshold=1, within=timedelta(seconds=w.silence_s)),
                actions=notify(f"servegate: no verdict from {key} for {_duration(w.silence_s)}",
                               _SILENT_BODY.format(key=key, silence=_duration(w.silence_s), schedule=w.schedule,
                                                   source=w.silence_source))))
    for flow, names in per_flow.items():
        out.append(AutomationCore(
            name=f"{NAME_PREFIX}{flow} run ended without a verdict",
            description=f"A run of {flow} deployments {names} ended Failed, TimedOut, Crashed or Cancelled. "
                        f"servegate.automations; docs/missing-data.md",
            trigger=EventTrigger(
                posture=Posture.Reactive, match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=_related(flow, sorted(names)), expect=set(NO_VERDICT),
                for_each={"prefect.resource.id"}, threshold=1, within=timedelta(0)),
            actions=notify("servegate: {{ flow.name }}/{{ deployment.name }} ended {{ flow_run.state.name }} "
                           "without a verdict", _ENDED_BODY.format())))
    return out


# ---- the server --------------------------------------------------------------------------------
def install(client: SyncPrefectClient, automations: Sequence[AutomationCore]) -> list[InstallStep]:
    """Create or update each automation by name; delete duplicates and automations under
    :data:`NAME_PREFIX` that are no longer defined."""
    existing: dict[str, list[Automation]] = {}
    for a in client.read_automations():
        if a.name.startswith(NAME_PREFIX):
            existing.setdefault(a.name, []).append(a)
    steps = []
    for automation in automations:
        same = existing.pop(automation.name, [])
        if same:
            client.update_automation(same[0].id, automation)
            steps.append(InstallStep(name=automation.name, action="updated", id=same[0].id))
        else:
            steps.append(InstallStep(name=automation.name, action="created",
                                     id=client.create_automation(automation)))
        for duplicate in same[1:]:
            client.delete_automation(duplicate.id)
            steps.append(InstallStep(name=duplicate.name, action="deleted", id=duplicate.id))
    for stale in (a for same in existing.values() for a in same):
        client.delete_automation(stale.id)
        steps.append(InstallStep(name=stale.name, action="deleted", id=stale.id))
    return steps


def resolve_block(client: SyncPrefectClient, block: str) -> UUID:
    """The id of the notification block ``TYPE/NAME`` (e.g. ``custom-webhook/servegate``) or ``NAME``."""
    slug, _, name = block.rpartition("/")
    documents = [d for d in client.read_block_documents(include_secrets=False) if not d.is_anonymous]
    notifiers = [d for d in documents if d.block_schema and "notify" in (d.block_schema.capabilities or [])]
    found = [d for d in notifiers if d.name == name and (not slug or (d.block_type and d.block_type.slug == slug))]
    choices = sorted(f"{d.block_type.slug if d.block_type else '?'}/{d.name}" for d in notifiers)
    if len(found) == 1:
        return found[0].id
    if found:
        raise ConfigError(f"--block {block}: several notification blocks are named {name!r}; give TYPE/NAME, "
                          f"one of {choices}")
    raise ConfigError(f"--block {block}: no notification block of that name on the Prefect server; existing: "
                      f"{choices or 'none'}. Create one first (e.g. CustomWebhookNotificationBlock or "
                      f"SlackWebhook(...).save(NAME), or in the UI under Blocks)")


def flow_names(client: SyncPrefectClient, names: Sequence[str]) -> dict[str, str]:
    """Deployment name -> its flow's name, as deployed on the server (automations match both)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowFilter, FlowFilterId

    deployments = client.read_deployments(
        deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=list(names))))
    flow_ids = [d.flow_id for d in deployments]
    flows = {f.id: f.name for f in client.read_flows(flow_filter=FlowFilter(id=FlowFilterId(any_=flow_ids)))}
    found: dict[str, list[str]] = {}
    for d in deployments:
        found.setdefault(d.name, []).append(flows.get(d.flow_id, "?"))
    missing = sorted(set(names) - set(found))
    if missing:
        raise ConfigError(f"deployments {missing} are not on the Prefect server: deploy them first (SERVEGATE_REPO=... "
                          f"prefect --no-prompt deploy --prefect-file deployments/prefect.yaml --all) or leave them "
                          f"out with --deployment NAME for each one to watch")
    twice = {name: flows_ for name, flows_ in found.items() if len(flows_) > 1}
    if twice:
        raise ConfigError(f"deployment names used by several flows on the server: {twice}; servegate's deployment "
                          f"names must be unique")
    return {name: flows_[0] for name, flows_ in found.items()}


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError("PREFECT_API_URL is not set: automations live on a long-lived Prefect server (an "
                          "ephemeral one forgets them when it stops); export PREFECT_API_URL=http://HOST:4200/api")
    return url


def _on_server(work: Callable[[SyncPrefectClient], T]) -> T:
    """Run ``work(client)`` against PREFECT_API_URL, foreign errors mapped to servegate's."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    url = _api_url()
    try:
        with get_client(sync_client=True) as client:
            return work(client)
    except (httpx.ConnectError, httpx.TimeoutException, httpx.RemoteProtocolError) as exc:
        raise ServerUnreachableError(f"no Prefect server answers at {url} ({type(exc).__name__}: {exc}); start it "
                                     f"(prefect server start) or fix PREFECT_API_URL") from exc
    except (PrefectHTTPStatusError, httpx.HTTPStatusError) as exc:
        raise InfraError(f"the Prefect server at {url} refused a request: {exc}") from exc


def install_missing_data_alarms(block: str, prefect_file: Path | str = "deployments/prefect.yaml",
                                only: Sequence[str] = (), deadlines: Sequence[str] = (),
                                silences: Sequence[str] = ()) -> tuple[list[Watched], list[InstallStep]]:
    """Install (or update) the alarms for the deployments of ``prefect_file`` on the server at PREFECT_API_URL."""
    watched = watched_deployments(prefect_file, only, deadlines, silences)
    if not watched:
        raise ConfigError(f"{prefect_file} has no gate or scheduled deployment to watch")

    def work(client: SyncPrefectClient) -> list[InstallStep]:
        block_id = resolve_block(client, block)
        flows = flow_names(client, [w.name for w in watched])
        return install(client, alarm_automations(watched, flows, block_id))

    return watched, _on_server(work)


def list_alarms() -> list[Automation]:
    """The automations under :data:`NAME_PREFIX` on the server at PREFECT_API_URL, by name."""
    return sorted((a for a in _on_server(lambda client: client.read_automations()) if a.name.startswith(NAME_PREFIX)),
                  key=lambda a: a.name)
