"""Turn expectation outcomes and infra errors into one verdict: pass, fail or inconclusive.

The rule, applied after every outcome has been collected (so a verdict lists every breach,
never only the first):

1. **inconclusive** when anything says the infrastructure broke: an ``infra_errors`` entry,
   a stage with status ``failed``, an expectation that could not be evaluated on a table
   that was produced (empty table, missing column, GX error), or a failed expectation whose
   ``meta.failure_means`` is ``insufficient_data`` (too little history for a gated comparison)
   or ``invalid_measurement`` (the load generator fell behind its schedule, a paired round without
   a log ratio). Breaches found in
   the same run are still listed, but they are not reported as a regression: data from a run
   whose infrastructure broke is not trusted (design: "Infra failures are inconclusive, never
   pass, and never reported as a regression").
2. otherwise **fail** when any expectation failed (a breach).
3. otherwise **inconclusive** when a failed expectation's ``meta.failure_means`` is
   ``undecided``: e.g. a gated comparison whose ratio interval straddles the bound (decision
   ``inconclusive``) has shown neither a regression nor that a regression of the bound is
   excluded (the non-inferiority rule of :mod:`servegate.compare`), so it can neither pass
   nor fail the gate; more measurement decides it. It is listed with the infra errors, never
   as a breach, and it does not hide a regression shown by another check (rule 2 first).
   Likewise ``failure_means`` ``suspicious``: a gated comparison beyond the bound in this run but
   not in the ``compare.consecutive`` runs in a row the history rule asks for (decision
   ``suspicious``, :mod:`servegate.compare`): not yet called a regression, never a pass; the next
   runs decide. Its entries and the reason begin with "suspicious:".
4. otherwise **inconclusive** when a table with a suite was not produced and its stage was
   not deliberately left out (stage status ``skipped`` or ``not_applicable``), or when no
   expectation was evaluated at all: a gate never passes on nothing.
5. otherwise **pass**.

A run may serve as a baseline (``baseline_eligible``) when it passed, or when it is
inconclusive only because gated comparisons lacked history (so that a new gate key can build
its history) — never when a gated metric was undecided or suspicious: a run whose change could
not be excluded must not become the reference for the next (a suspicious run in the baseline
would drag it toward the regression the next runs are deciding).

Exit codes (:class:`ExitCode`, the only definition; every command returns one): pass 0,
fail 1, inconclusive 2 — and 2 for anything else that kept a command from deciding (bad
input, infra failure, interruption, a crash).

Deciding lives here; showing a verdict to people (terminal table, Markdown) is
:mod:`servegate.render`. This module imports only pydantic (no pandas, no GX), so that the
command line can take :class:`ExitCode` from it cheaply.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servegate.tables import TABLE_STAGE

if TYPE_CHECKING:  # pragma: no cover
    from servegate.validate import ExpectationOutcome

__all__ = [
    "VERDICT_SCHEMA_VERSION",
    "ExitCode",
    "Breach",
    "VerdictSummary",
    "Verdict",
    "decide_verdict",
    "observed_text",
    "undecided_kind",
]

VERDICT_SCHEMA_VERSION = "1"

_EXEMPT_STAGE_STATUS = ("skipped", "not_applicable")
_MORE = {"comparison": "more runs or repeats, or the paired mode",
         "paired": "more rounds: a larger paired.max_measure_s or paired.max_rounds"}
"""What measuring more means for an undecided row of each table."""


class ExitCode(enum.IntEnum):
    """The exit status of every ``servegate`` command: what a nightly pipeline blocks on."""

    PASS = 0
    """pass; for commands that do not judge a gate (status, report, ...): done."""
    FAIL = 1
    """a regression was found (only ever from a verdict)."""
    UNDECIDED = 2
    """could not decide: inconclusive verdict, bad input, infra failure, interruption, crash."""

    @classmethod
    def of(cls, status: str) -> "ExitCode":
        """The exit code of a verdict status (``pass`` | ``fail`` | ``inconclusive``)."""
        return {"pass": cls.PASS, "fail": cls.FAIL, "inconclusive": cls.UNDECIDED}[status]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Breach(_Record):
    """One failed expectation."""

    table: str = Field(description="table the expectation is about")
    expectation: str = Field(description="GX expectation type")
    column: str | None = Field(None, description="column checked, None for table-level checks")
    observed: Any = Field(None, description="what was measured (value, or unexpected counts and values)")
    allowed: str = Field(description="what the suite allows, e.g. '>= 50'")
    source: str | None = Field(None, description="where the threshold comes from (meta.source)")


class VerdictSummary(_Record):
    """Counts over all expectations of the profile."""

    expectations: int = Field(description="expectations in the profile's suites")
    passed: int = Field(description="evaluated and met")
    failed: int = Field(description="evaluated and breached")
    not_evaluated: int = Field(description="on produced tables but could not be evaluated (infra)")
    not_produced: int = Field(description="whose table was not produced")
    not_applicable: int = Field(0, description="on produced tables, but the engine cannot provide what they check")


class Verdict(_Record):
    """The gate's decision, with everything that led to it."""

    schema_version: str = Field(VERDICT_SCHEMA_VERSION, description="version of this record layout")
    status: Literal["pass", "fail", "inconclusive"] = Field(description="pass | fail (regression) | inconclusive")
    reason: str = Field(description="one sentence: why this status")
    breaches: list[Breach] = Field(default_factory=list, description="every failed expectation")
    infra_errors: list[str] = Field(default_factory=list, description=(
        "everything that kept the gate from deciding, gated metrics left undecided included"))
    undecided: list[str] = Field(default_factory=list, description=(
        "gated metrics neither shown to regress nor shown unchanged (their interval straddles the bound; "
        "'undecided: ...'), or beyond the bound in fewer consecutive runs than compare.consecutive asks for "
        "('suspicious: ...'): not a regression and not infrastructure, but they keep the gate from passing; "
        "more measurement or the next runs decide"))
    not_validated: list[str] = Field(default_factory=list, description="tables with a suite that were not produced")
    not_applicable: list[str] = Field(default_factory=list, description=(
        "tables of not_validated whose stage was skipped or not applicable, and table.column checks the engine "
        "cannot provide (meta.applies_when false)"))
    summary: VerdictSummary = Field(description="counts over all expectations")
    calibration: dict[str, Any] | None = Field(None, description=(
        "the gate key's latest `servegate calibrate` figures (compare stage): A/A false alarms and the "
        "smallest detectable change per gated metric, so a reader knows how much a relative verdict is worth"))
    baseline_eligible: bool = Field(False, description=(
        "the run may serve as a baseline: every absolute check passed and nothing broke; true for a pass, "
        "and for a run that is inconclusive only because the relative checks lacked history (so a new "
        "gate key can build its history)"))

    @property
    def exit_code(self) -> ExitCode:
        """0 pass, 1 fail (regression), 2 inconclusive (could not decide)."""
        return ExitCode.of(self.status)


def _breach(o: ExpectationOutcome) -> Breach:
    source = o.meta.get("source")
    return Breach(table=o.table, expectation=o.expectation_type, column=o.column, observed=o.observed,
                  allowed=o.allowed, source=None if source is None else str(source))


def observed_text(observed: Any) -> str:
    """A breach's observed value for people: the value, or '1 of 3 rows: ['failed']'."""
    if isinstance(observed, dict) and "unexpected_count" in observed:
        values = observed.get("unexpected_values") or []
        return (f"{observed['unexpected_count']} of {observed.get('element_count')} rows"
                + (f": {values}" if values else ""))
    if isinstance(observed, dict) and "missing_values" in observed:
        return f"missing {observed['missing_values']}"
    if isinstance(observed, float):
        return f"{observed:.6g}"
    return "-" if observed is None else str(observed)


def undecided_kind(entry: str) -> str:
    """``"suspicious"`` for an entry of ``Verdict.undecided`` that the history rule left not yet called
    (it begins "suspicious:"), else ``"undecided"``: what JUnit and CI annotations call it."""
    return "suspicious" if entry.startswith("suspicious:") else "undecided"


def decide_verdict(outcomes: list[ExpectationOutcome], infra_errors: list[str],
           stage_status: dict[str, str] | None = None) -> Verdict:
    """Decide pass / fail / inconclusive by the rule in this module's docstring.

    ``stage_status`` maps stage name (``one_batch``, ``serving``, ``occupancy``, ...) to
    ``ok | failed | skipped | not_applicable``; without it every missing table counts as
    not produced for an unknown reason (inconclusive).
    """
    stage_status = dict(stage_status or {})
    errors = list(infra_errors)
    for stage, status in stage_status.items():
        if status == "failed" and not any(stage in e for e in errors):
            errors.append(f"stage {stage} failed")

    # An expectation whose meta says ``"failure_means": "insufficient_data"`` (e.g. "every gated
    # comparison has enough history") cannot show a regression when it fails, only that the gate
    # could not decide: it counts with the infra errors, never as a breach.
    # Likewise ``"failure_means": "invalid_measurement"`` (the load generator fell behind its own
    # schedule): the numbers describe the client, not the engine.
    insufficient = [o for o in outcomes if o.success is False
                    and o.meta.get("failure_means") in ("insufficient_data", "invalid_measurement")]
    for o in insufficient:
        label = "insufficient data" if o.meta.get("failure_means") == "insufficient_data" else "invalid measurement"
        errors.append(f"{label}: {o.table}.{o.column or ''} {o.expectation_type} failed "
                      f"({observed_text(o.observed)}); {o.meta.get('source', '')}")
    # ``"failure_means": "undecided"`` (a gated metric neither shown to regress nor shown unchanged,
    # e.g. a comparison interval across the bound) is listed with the infra errors too, but it
    # only keeps a run from passing (rule 3): the data is trusted, so a regression another check
    # shows still fails the run.
    undecided = [o for o in outcomes if o.success is False and o.meta.get("failure_means") == "undecided"]
    undecided_errors = [f"undecided: {o.table}.{o.column or ''} {o.expectation_type} failed "
                        f"({observed_text(o.observed)}); not a regression, and a regression of the bound is not "
                        f"excluded either: more measurement ({_MORE.get(o.table, _MORE['comparison'])}) decides it; "
                        f"{o.meta.get('source', '')}" for o in undecided]
    # ``"failure_means": "suspicious"`` (the history rule of compare.consecutive): beyond the bound in
    # this run, not yet in enough runs in a row. Kept from passing like an undecided metric (rule 3).
    suspicious = [o for o in outcomes if o.success is False and o.meta.get("failure_means") == "suspicious"]
    suspicious_errors = [f"suspicious: {o.table}.{o.column or ''} {o.expectation_type} failed "
                         f"({observed_text(o.observed)}); beyond the bound in this run, not yet in compare.consecutive "
                         f"runs in a row: not called a regression, not a pass; the next runs decide (each row's "
                         f"reason says how many); {o.meta.get('source', '')}" for o in suspicious]
    breaches = [_breach(o) for o in outcomes
                if o.success is False and o not in insufficient and o not in undecided and o not in suspicious]
    only_history_missing = (bool(insufficient) and len(errors) == len(insufficient)
                            and all(o.meta.get("failure_means") == "insufficient_data" for o in insufficient))
    passed = sum(1 for o in outcomes if o.success is True)
    unevaluated = [o for o in outcomes if o.success is None and o.table_produced and o.applicable]
    inapplicable = [f"{o.table}.{o.column}" for o in outcomes if not o.applicable]
    for o in unevaluated:
        msg = f"{o.table}: {o.expectation_type}({o.column or ''}) not evaluated: {o.reason}"
        if msg not in errors:
            errors.append(msg)

    missing_tables = sorted({o.table for o in outcomes if o.success is None and not o.table_produced})
    exempt = sorted(t for t in missing_tables if stage_status.get(TABLE_STAGE.get(t, t)) in _EXEMPT_STAGE_STATUS)
    required_missing = [t for t in missing_tables if t not in exempt]
    summary = VerdictSummary(expectations=len(outcomes), passed=passed, failed=len(breaches),
                             not_evaluated=len(unevaluated), not_applicable=len(inapplicable),
                             not_produced=sum(1 for o in outcomes if o.success is None and not o.table_produced))

    if errors:
        status = "inconclusive"
        reason = (f"{len(errors)} infrastructure problem(s); "
                  + (f"{len(breaches)} breach(es) listed but not trusted as a regression" if breaches
                     else "no regression can be claimed"))
    elif breaches:
        status = "fail"
        reason = f"{len(breaches)} expectation(s) breached"
    elif suspicious:
        status = "inconclusive"
        reason = (f"suspicious: gated metric(s) beyond the bound in this run but not yet in compare.consecutive runs "
                  f"in a row ({'; '.join(f'{o.table}: {observed_text(o.observed)}' for o in suspicious)}): not yet "
                  f"called a regression, not a pass; the next runs decide"
                  + (f"; {len(undecided)} check(s) undecided as well" if undecided else ""))
    elif undecided:
        status = "inconclusive"
        reason = (f"gated metric(s) undecided ({'; '.join(f'{o.table}: {observed_text(o.observed)}' for o in undecided)}): "
                  f"no regression shown and none excluded; more measurement decides")
    elif required_missing:
        status = "inconclusive"
        reason = f"table(s) {required_missing} not produced, so their expectations were not checked"
    elif passed == 0:
        status = "inconclusive"
        reason = "no expectation was evaluated; a gate does not pass on nothing"
    else:
        status = "pass"
        reason = f"all {passed} evaluated expectation(s) met"
        if exempt or inapplicable:
            reason += f" ({[*exempt, *inapplicable]} skipped or not applicable)"
    eligible = status == "pass" or (only_history_missing and not undecided and not suspicious and not unevaluated
                                    and not breaches and not required_missing)
    return Verdict(status=status, reason=reason, breaches=breaches, infra_errors=errors,
                   undecided=[*suspicious_errors, *undecided_errors],
                   not_validated=missing_tables, not_applicable=[*exempt, *inapplicable], summary=summary,
                   baseline_eligible=eligible)

