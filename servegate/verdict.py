"""Turn expectation outcomes and infra errors into one verdict: pass, fail or inconclusive.

The rule, applied after every outcome has been collected (so a verdict lists every breach,
never only the first):

1. **inconclusive** when anything says the infrastructure broke: an ``infra_errors`` entry,
   a stage with status ``failed``, or an expectation that could not be evaluated on a table
   that was produced (empty table, missing column, GX error). Breaches found in the same run
   are still listed, but they are not reported as a regression: data from a run whose
   infrastructure broke is not trusted (design: "Infra failures are inconclusive, never pass,
   and never reported as a regression").
2. otherwise **fail** when any expectation failed (a breach).
3. otherwise **inconclusive** when a table with a suite was not produced and its stage was
   not deliberately left out (stage status ``skipped`` or ``not_applicable``), or when no
   expectation was evaluated at all: a gate never passes on nothing.
4. otherwise **pass**.

Exit codes: pass 0, fail 1, inconclusive 2.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servegate.tables import TABLE_STAGE
from servegate.validate import ExpectationOutcome

__all__ = [
    "VERDICT_SCHEMA_VERSION",
    "calibration_text",
    "percent_text",
    "Breach",
    "VerdictSummary",
    "Verdict",
    "decide",
    "format_verdict_table",
    "observed_text",
    "verdict_markdown",
    "markdown_text",
    "markdown_cell",
    "markdown_code",
    "terminal_text",
]

VERDICT_SCHEMA_VERSION = "1"

_EXEMPT_STAGE_STATUS = ("skipped", "not_applicable")
_EXIT_CODES = {"pass": 0, "fail": 1, "inconclusive": 2}


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
    infra_errors: list[str] = Field(default_factory=list, description="everything that kept the gate from deciding")
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
    def exit_code(self) -> int:
        """0 pass, 1 fail (regression), 2 inconclusive (could not decide)."""
        return _EXIT_CODES[self.status]


def _breach(o: ExpectationOutcome) -> Breach:
    source = o.meta.get("source")
    return Breach(table=o.table, expectation=o.expectation_type, column=o.column, observed=o.observed,
                  allowed=o.allowed, source=None if source is None else str(source))


def decide(outcomes: list[ExpectationOutcome], infra_errors: list[str],
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
    breaches = [_breach(o) for o in outcomes if o.success is False and o not in insufficient]
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
    eligible = status == "pass" or (only_history_missing and not unevaluated and not breaches and not required_missing)
    return Verdict(status=status, reason=reason, breaches=breaches, infra_errors=errors,
                   not_validated=missing_tables, not_applicable=[*exempt, *inapplicable], summary=summary,
                   baseline_eligible=eligible)


# ---- untrusted text -------------------------------------------------------------------------
# Breaches and infra errors carry text a server wrote (an error body, a model name). Rendered
# as is, it could inject HTML into a Prefect artifact or CI summary, break a Markdown table, or
# send escape sequences to a terminal.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0/C1 controls but tab and newline
_MARKDOWN_PUNCT_RE = re.compile(r"([\\`*\[\]])")  # code spans, emphasis, links and images


def terminal_text(value: Any) -> str:
    """``value`` as text without control characters (terminal escape sequences); lines kept."""
    return _CONTROL_RE.sub("\N{REPLACEMENT CHARACTER}", str(value))


_HTML_START_RE = re.compile(r"&(?=#?\w+;)|<(?=[A-Za-z/!?])")  # what can start an entity or a tag


def markdown_text(value: Any) -> str:
    """Untrusted ``value`` as one line of Markdown prose that renders as the same text: ``<`` and
    ``&`` that could start an HTML tag, comment or entity escaped (``<= 0`` stays readable),
    ``\\ ` * [ ]`` backslash-escaped (no code span, emphasis, link or image), control
    characters and line breaks made spaces."""
    text = " ".join(_CONTROL_RE.sub(" ", str(value)).split())
    text = _MARKDOWN_PUNCT_RE.sub(r"\\\1", text)
    return _HTML_START_RE.sub(lambda m: html.escape(m.group(0)), text)


def markdown_cell(value: Any) -> str:
    """``markdown_text`` for a table cell: pipes escaped too (a ``|`` would start a new column)."""
    return markdown_text(value).replace("|", "\\|")


def markdown_code(value: Any, *, in_table: bool = False) -> str:
    """``value`` as an inline code span it cannot close: fenced by one backtick more than its
    longest run of backticks (CommonMark); in a table, pipes are escaped (GFM splits cells on
    them even inside code)."""
    text = " ".join(_CONTROL_RE.sub(" ", str(value)).split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    code = f"{fence}{pad}{text}{pad}{fence}"
    return code.replace("|", "\\|") if in_table else code


def _cell(value: Any, width: int = 40) -> str:
    text = "-" if value is None else str(value)
    text = " ".join(_CONTROL_RE.sub(" ", text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


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


def _grid(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(x.rstrip() for x in [line, sep, *body])


def percent_text(value: Any) -> str:
    """A fraction as ``12.3%``; ``-`` for a missing or non-finite value."""
    return f"{100 * float(value):.1f}%" if value is not None and math.isfinite(float(value)) else "-"


def calibration_text(calibration: Mapping[str, Any] | None) -> str | None:
    """One paragraph on how far the relative verdict can be trusted (``servegate calibrate``
    figures), or None when the gate key was never calibrated."""
    if not calibration:
        return None
    gate = calibration.get("gate_false_alarms_at_bound") or {}
    bound = calibration.get("bound")
    at = str(calibration.get("at") or "")[:16].replace("T", " ")
    text = (f"calibrated {at} UTC from {calibration.get('aa_runs')} A/A and {calibration.get('ab_runs')} "
            f"slowdown run(s)")
    if gate and bound is not None:
        upper = gate.get("false_alarm_upper95")
        text += (f": gate-level false alarms {gate.get('false_alarms')}/{gate.get('comparisons')} at a "
                 f"{bound:.0%} bound" + (f" (95% upper bound {upper:.0%})" if upper is not None else ""))
    detectable = [f"{m['metric']}{' [' + m['case'] + ']' if m.get('case') else ''} {m['min_detectable']:.1%}"
                  for m in calibration.get("metrics") or [] if m.get("min_detectable") is not None]
    if detectable:
        text += "; smallest change detected 95% of the time: " + ", ".join(detectable)
    return text


def format_verdict_table(verdict: Verdict) -> str:
    """A plain-text report for the terminal: status line, breaches table, infra errors, gaps."""
    s = verdict.summary
    lines = [f"VERDICT: {verdict.status.upper()} (exit {verdict.exit_code}) - {terminal_text(verdict.reason)}",
             f"expectations: {s.expectations}  passed: {s.passed}  failed: {s.failed}  "
             f"not evaluated: {s.not_evaluated}  not produced: {s.not_produced}"]
    if verdict.breaches:
        rows = [[b.table, _cell(b.column, 24), b.expectation.removeprefix("expect_"), _cell(observed_text(b.observed)),
                 _cell(b.allowed), _cell(b.source, 50)] for b in verdict.breaches]
        lines += ["", "Breaches:", _grid(["table", "column", "expectation", "observed", "allowed", "source"], rows)]
    if verdict.infra_errors:
        lines += ["", "Infrastructure problems (not a regression):",
                  *(f"  - {terminal_text(e)}" for e in verdict.infra_errors)]
    if verdict.not_validated:
        na = set(verdict.not_applicable)
        lines += ["", "Not validated (table not produced):",
                  *(f"  - {t}{' (stage skipped / not applicable)' if t in na else ''}" for t in verdict.not_validated)]
    calibration = calibration_text(verdict.calibration)
    if calibration:
        lines += ["", f"Trust: {terminal_text(calibration)}"]
    return "\n".join(lines)


def _md(value: Any) -> str:
    return markdown_cell(_cell(value, 80))


def verdict_markdown(verdict: Verdict) -> str:
    """The verdict as Markdown (a Prefect artifact / CI summary)."""
    icon = {"pass": "✅", "fail": "❌", "inconclusive": "⚠️"}[verdict.status]
    s = verdict.summary
    out = [f"## {icon} Verdict: **{verdict.status}** (exit {verdict.exit_code})", "", markdown_text(verdict.reason), "",
           "| expectations | passed | failed | not evaluated | not produced |",
           "|---:|---:|---:|---:|---:|",
           f"| {s.expectations} | {s.passed} | {s.failed} | {s.not_evaluated} | {s.not_produced} |"]
    if verdict.breaches:
        out += ["", "### Breaches", "", "| table | column | expectation | observed | allowed | source |",
                "|---|---|---|---|---|---|"]
        out += [f"| {_md(b.table)} | {_md(b.column)} | {markdown_code(b.expectation, in_table=True)} | "
                f"{_md(observed_text(b.observed))} | {_md(b.allowed)} | {_md(b.source)} |" for b in verdict.breaches]
    if verdict.infra_errors:
        out += ["", "### Infrastructure problems (not a regression)", ""]
        out += [f"- {markdown_text(e)}" for e in verdict.infra_errors]
    if verdict.not_validated:
        na = set(verdict.not_applicable)
        out += ["", "### Not validated", ""]
        out += [f"- {markdown_code(t)}{' (stage skipped / not applicable)' if t in na else ' (not produced)'}"
                for t in verdict.not_validated]
    calibration = calibration_text(verdict.calibration)
    if calibration:
        out += ["", f"**Trust:** {markdown_text(calibration)}"]
    return "\n".join(out) + "\n"
