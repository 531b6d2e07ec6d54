"""Which past runs a gate run is compared with: baseline policies and release-manager actions.

A baseline is per gate key (workload, engine, hardware, model) and is chosen by a policy:

- ``last_n`` (default): the last ``n`` passing runs (default 5), on ``branch`` when given
  (runs record their branch from the manifest's ``git_branch``/``branch`` or the config's);
- ``pinned``: the one run a release manager pinned (see below) — or ``run_id`` given here;
- ``window``: every passing run of the last ``days`` days.

"Passing" means the run group's effective (latest) attempt has verdict ``pass``; the baseline
uses that attempt's tables. The run being judged and its attempts are never in its own baseline.

Release-manager actions, each recorded with who, when and why (``baseline_actions`` table):

- :func:`pin` a run: the key's baseline is that run, whatever the policy, until :func:`unpin`;
- :func:`mark_distribution_change`: an intentional shift (new engine version, new hardware
  driver); runs that started before it are no longer baseline candidates, and a pin made before
  it is dropped, so the baseline restarts from the runs after the change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servegate.errors import ConfigError
from servegate.history import GateKey, RunRecord, Store

if TYPE_CHECKING:  # pragma: no cover
    from servegate.config import CompareConfig

__all__ = [
    "BaselinePolicy",
    "run_group_ids",
    "Baseline",
    "resolve_baseline",
    "active_pin",
    "pin_in_force",
    "last_distribution_change",
    "pin",
    "unpin",
    "mark_distribution_change",
]


class BaselinePolicy(BaseModel):
    """How a key's baseline runs are chosen (a config section: ``[baseline]``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["last_n", "pinned", "window"] = Field("last_n", description="last_n | pinned | window")
    n: int = Field(5, ge=1, description="last_n: how many passing runs")
    branch: str | None = Field(None, description="last_n/window: only runs on this branch (None: any branch)")
    run_id: str | None = Field(None, description="pinned: this run (default: the run pinned by `baseline pin`)")
    days: float | None = Field(None, gt=0, description="window: passing runs started in the last `days` days")
    min_runs: int = Field(1, ge=1, description="fewer baseline runs than this -> insufficient data")

    @model_validator(mode="after")
    def _window_needs_days(self) -> "BaselinePolicy":
        if self.kind == "window" and self.days is None:
            raise ValueError("baseline kind 'window' needs days (e.g. days = 14)")
        return self

    @classmethod
    def of(cls, compare: "CompareConfig") -> "BaselinePolicy":
        """The policy a gate config's ``[compare]`` section names."""
        return cls(kind=compare.policy, n=compare.n, branch=compare.branch, days=compare.days)

    def describe(self) -> str:
        if self.kind == "last_n":
            return f"last {self.n} passing" + (f" on {self.branch}" if self.branch else "")
        if self.kind == "window":
            return f"passing in last {self.days:g} days" + (f" on {self.branch}" if self.branch else "")
        return f"pinned {self.run_id}" if self.run_id else "pinned"


@dataclass(frozen=True)
class Baseline:
    """The runs a comparison pools, and how they were chosen."""

    key: GateKey
    policy: str  # human-readable: "last 5 passing on main", "pinned <run>"
    runs: list[RunRecord] = field(default_factory=list)
    reason: str | None = None  # why it is empty or short, when it is

    @property
    def run_ids(self) -> list[str]:
        return [r.run_id for r in self.runs]

    @property
    def sufficient(self) -> bool:
        return self.reason is None and bool(self.runs)

    def as_dict(self) -> dict[str, Any]:
        return {"key": str(self.key), "policy": self.policy, "run_ids": self.run_ids, "reason": self.reason}


def last_distribution_change(store: Store, key: GateKey) -> dict[str, Any] | None:
    changes = [a for a in store.baseline_actions(key) if a["action"] == "distribution_change"]
    return changes[-1] if changes else None


def active_pin(store: Store, key: GateKey) -> dict[str, Any] | None:
    """The pin in force for ``key``: the latest pin not followed by an unpin or a distribution change."""
    return pin_in_force(store.baseline_actions(key))


def pin_in_force(actions: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The pin in force after ``actions`` (a key's baseline actions in recorded order), or None."""
    current = None
    for action in actions:
        if action["action"] == "pin":
            current = action
        elif action["action"] in ("unpin", "distribution_change"):
            current = None
    return current


def run_group_ids(store: Store, run_id: str | None) -> set[str]:
    """The ids of every attempt of ``run_id``'s run group (its root's included): the runs a judgement of
    ``run_id`` leaves out. Only ``run_id`` itself when it is not recorded yet; empty for None."""
    if run_id is None:
        return set()
    try:
        attempts = store.attempts(run_id)
    except ConfigError:
        return {run_id}  # not recorded yet: only its own id to leave out
    return {r.run_id for r in attempts} | {r.root_id for r in attempts}


def resolve_baseline(store: Store, key: GateKey, policy: BaselinePolicy | None = None, *,
                     exclude_run: str | None = None, now: datetime | None = None) -> Baseline:
    """The baseline runs of ``key`` under ``policy`` (an active pin wins over last_n and window).

    ``exclude_run``: the run being judged; its whole run group is left out.
    """
    policy = policy or BaselinePolicy()
    now = now or datetime.now(timezone.utc)
    excluded = run_group_ids(store, exclude_run)
    change = last_distribution_change(store, key)
    pinned = active_pin(store, key)
    pin_id = policy.run_id if policy.kind == "pinned" and policy.run_id else (pinned or {}).get("run_id")
    if pin_id is not None and (policy.kind == "pinned" or pinned is not None):
        record = store.effective(pin_id)
        if record.key != key:
            raise ConfigError(f"pinned run {pin_id} belongs to gate {record.key}, not {key}; pin a run of {key}")
        label = f"pinned {record.root_id}" + (f" by {pinned['actor']}" if pinned and not policy.run_id else "")
        if record.run_id in excluded:
            return Baseline(key, label, [], reason="the pinned run is the run being judged")
        return Baseline(key, label, [record])
    if policy.kind == "pinned":
        return Baseline(key, "pinned", [], reason=f"no run is pinned for {key}; pin one with "
                                                  f"`servegate baseline pin RUN --reason ...`")

    candidates = [r for r in store.runs(key, include_attempts=False)
                  if (r.status == "pass" or bool((r.verdict or {}).get("baseline_eligible")))
                  and r.root_id not in excluded and r.run_id not in excluded]
    if policy.branch is not None:
        candidates = [r for r in candidates if r.branch == policy.branch]
    if change is not None:
        candidates = [r for r in candidates if r.started_at > change["at"]]
    if policy.kind == "window":
        assert policy.days is not None  # the validator guarantees it
        cutoff = now - timedelta(days=policy.days)
        chosen = [r for r in candidates if r.started_at >= cutoff]
    else:
        chosen = candidates[: policy.n]
    reason = None
    if len(chosen) < policy.min_runs:
        after = (f" since the distribution change of {change['at']:%Y-%m-%d %H:%M} ({change['reason']})"
                 if change else "")
        reason = (f"{len(chosen)} passing run(s) of {key}{after} under policy '{policy.describe()}', "
                  f"{policy.min_runs} needed: too little history")
    return Baseline(key, policy.describe(), chosen, reason=reason)


def pin(store: Store, run_id: str, *, reason: str, actor: str | None = None) -> int:
    """Pin ``run_id`` as its key's baseline (recorded with who/when/why); returns the action id."""
    record = store.get_run(run_id)
    if record.status != "pass":
        # A failing run can be pinned on purpose (accepting a known state) but the reason must say so.
        reason = f"{reason} [pinned run verdict: {record.status}]"
    return store.record_baseline_action(record.key, "pin", run_id=record.run_id, reason=reason, actor=actor)


def unpin(store: Store, key: GateKey, *, reason: str, actor: str | None = None) -> int:
    """Remove ``key``'s pin; the baseline policy applies again."""
    def pinned(actions: list[dict[str, Any]]) -> None:
        # Checked under the store's write lock: of two unpins racing, the second finds nothing to unpin.
        if pin_in_force(actions) is None:
            raise ConfigError(f"no run is pinned for {key}; nothing to unpin (see `servegate baseline show {key}`)")

    return store.record_baseline_action(key, "unpin", reason=reason, actor=actor, check=pinned)


def mark_distribution_change(store: Store, key: GateKey, *, reason: str, actor: str | None = None,
                             at: datetime | None = None) -> int:
    """Record an intentional shift for ``key``: the baseline restarts from runs after ``at`` (now)."""
    return store.record_baseline_action(key, "distribution_change", reason=reason, actor=actor, at=at)
