"""Verdicts and untrusted text for people: the terminal table, the Markdown artifact.

:mod:`servegate.verdict` decides (and words an observed value, :func:`observed_text`, for its
messages and for these renderers); this module shows. :mod:`servegate.report` builds the HTML report, JUnit and CI summary on the same text helpers.

Breaches and infra errors carry text a server wrote (an error body, a model name). Rendered as
is, it could inject HTML into a Prefect artifact or CI summary, break a Markdown table, or send
escape sequences to a terminal: every renderer here passes it through :func:`terminal_text`,
:func:`markdown_text`, :func:`markdown_cell` or :func:`markdown_code`.

A ratio with its interval is worded here (:func:`ratio_text`; :func:`paired_text` for a metric
of the paired stage): the paired lines of the terminal verdict and summary.md, the report's
paired table, and ``servegate status`` (paired and comparison lines). The comparison tables of
the report and summary.md keep their three-digit cells.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from servegate.verdict import Verdict, observed_text

__all__ = [
    "calibration_text",
    "format_verdict_table",
    "UNDECIDED_HEADING",
    "gated_paired_rows",
    "interval_text",
    "markdown_cell",
    "markdown_code",
    "markdown_text",
    "metric_rows",
    "paired_text",
    "percent_text",
    "ratio_number_text",
    "ratio_text",
    "terminal_text",
    "verdict_markdown",
]


# ---- untrusted text -------------------------------------------------------------------------
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


def _grid(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(x.rstrip() for x in [line, sep, *body])


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def percent_text(value: Any) -> str:
    """A fraction as ``12.3%``; ``-`` for a missing or non-finite value."""
    number = _finite(value)
    return "-" if number is None else f"{100 * number:.1f}%"


def ratio_number_text(value: Any) -> str:
    """One ratio (or interval end) as ``1.0432``: four decimals below 10, because it is read against
    bounds of a few percent, and a paired stage stops at the first round its interval clears the
    bound, so an interval end usually lies just past it (1.015 would hide that 1.0154 clears a
    1.5 % bound); ``-`` for a missing or non-finite value."""
    number = _finite(value)
    if number is None:
        return "-"
    return f"{number:.4f}" if abs(number) < 10 else f"{number:.4g}"


def interval_text(ci_low: Any, ci_high: Any) -> str:
    """A ratio's interval: ``[1.0211, 1.0664]``, or ``[unbounded]`` while it has no finite, positive
    ends (a paired interval after one round is [0, inf]: no spread measured yet)."""
    low, high = _finite(ci_low), _finite(ci_high)
    if low is None or high is None or low <= 0:
        return "[unbounded]"
    return f"[{ratio_number_text(low)}, {ratio_number_text(high)}]"


def ratio_text(ratio: Any, ci_low: Any, ci_high: Any) -> str:
    """A ratio with its interval, as every text output writes it: ``×1.0432 [1.0211, 1.0664]``."""
    return f"×{ratio_number_text(ratio)} {interval_text(ci_low, ci_high)}"


def gated_paired_rows(paired: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of a ``paired`` table (as records) that decide the verdict (``gated``)."""
    return [row for row in paired if row.get("gated") == True]  # noqa: E712 - numpy's True_ is not True


def paired_text(row: Mapping[str, Any], *, why: bool = True) -> str:
    """One metric of the ``paired`` table for people, e.g. ``itl_median_ms: ×1.0432 [1.0211, 1.0664]
    vs bound 1.5% -> regression after 24 rounds (every gated metric decided)``; ``why`` adds the
    reason the rounds stopped. Untrusted: pass it through the renderer's escaping."""
    rounds = _finite(row.get("rounds"))
    rounds_text = "? rounds" if rounds is None else f"{rounds:.0f} round{'' if rounds == 1 else 's'}"
    text = (f"{row.get('metric')}: {ratio_text(row.get('ratio'), row.get('ci_low'), row.get('ci_high'))} "
            f"vs bound {percent_text(row.get('bound'))} -> {row.get('decision')} after {rounds_text}")
    because = row.get("stopped_because")
    if why and isinstance(because, str) and because:
        text += f" ({because.removesuffix(f' after {rounds_text}')})"
    reason = row.get("reason")
    if why and isinstance(reason, str) and reason.startswith(("confirmed:", "unconfirmed:")):
        text += f"; {reason}"  # paired.confirm: both measurements
    return text


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


_RANGE_TYPES = ("expect_column_values_to_be_between", "expect_column_max_to_be_between",
                "expect_column_min_to_be_between", "expect_column_mean_to_be_between",
                "expect_column_median_to_be_between")


def _number_text(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"


def metric_rows(outcomes: Iterable[Mapping[str, Any]], comparison: Iterable[Mapping[str, Any]] = ()) -> list[list[str]]:
    """The measured numbers a person reads first, one row each: ``[mark, metric, value, bound, check]``.

    From the run's expectation outcomes (``expectations.json`` records): every range check with the
    value it saw (one-row tables; a many-row table says how many rows it checked and how many fell
    outside). From the ``comparison`` table (records): every gated metric with its current and
    baseline medians, its ratio and interval against the bound, and the decision. Marks: ``ok``,
    ``FAIL`` (breached), ``n/a`` (the engine cannot provide it), ``--`` (not evaluated), ``SUSPECT``
    (beyond the bound in this run, not yet in ``compare.consecutive`` runs in a row), ``UNDECIDED``
    (a gated comparison whose interval neither excludes nor shows a regression).
    """
    rows: list[list[str]] = []
    for o in outcomes:
        if o.get("expectation_type") not in _RANGE_TYPES or not o.get("table_produced", True):
            continue
        observed = o.get("observed")
        number = _finite(observed) if not isinstance(observed, (dict, list, bool)) else None
        if number is not None:
            value = _number_text(number)
        elif isinstance(observed, dict) and "element_count" in observed:
            n, bad = observed.get("element_count"), observed.get("unexpected_count")
            if not n:
                continue  # a conditional check with no row to check (e.g. accept length without speculation)
            value = f"{n} row(s), {bad} outside"
        else:
            value = "-"
        if o.get("applicable") is False:
            mark = "n/a"
        elif o.get("success") is None:
            mark = "--"
        else:
            mark = "ok" if o.get("success") else "FAIL"
        rows.append([mark, f"{o.get('table')}.{_cell(o.get('column'), 32)}", _cell(value, 24),
                     _cell(o.get("allowed"), 40), "threshold"])
    for c in comparison:
        if c.get("gated") != True:  # noqa: E712 - numpy's True_ is not True
            continue
        decision = str(c.get("decision") or "")
        mark = {"regression": "FAIL", "suspicious": "SUSPECT", "no_change": "ok", "improvement": "ok"}.get(
            decision, "UNDECIDED")
        name = str(c.get("metric"))
        case = c.get("case")
        if isinstance(case, str) and case:
            name += f" [{case}]"
        current, baseline = _finite(c.get("current_median")), _finite(c.get("baseline_median"))
        value = "-" if current is None else _number_text(current)
        if baseline is not None:
            value += f" vs {_number_text(baseline)}"
        bound = _finite(c.get("bound"))
        rows.append([mark, _cell(name, 44), _cell(value, 24),
                     _cell(ratio_text(c.get("ratio"), c.get("ci_low"), c.get("ci_high"))
                           + (f" vs bound {bound:.1%}" if bound is not None else ""), 48),
                     f"baseline: {_cell(decision, 20)}"])
    return rows


UNDECIDED_HEADING = "Undecided (not a regression, none excluded; more measurement or the next runs decide)"
"""The heading every output gives the verdict's ``undecided`` entries (``undecided: ...``, and
``suspicious: ...`` for the history rule's not-yet-called regressions)."""


def format_verdict_table(verdict: Verdict, paired: Sequence[Mapping[str, Any]] = (),
                         metrics: Sequence[Sequence[str]] = ()) -> str:
    """A plain-text report for the terminal: the measured numbers (``metrics``, rows of
    :func:`metric_rows`), status line, breaches table, infra errors, gaps, and one line per gated
    metric of the run's ``paired`` table (its rows as records) when it has one."""
    s = verdict.summary
    lines = []
    if metrics:
        lines += [_grid(["", "metric", "value", "allowed / ratio", "check"], [[terminal_text(c) for c in r]
                                                                            for r in metrics]), ""]
    lines += [f"VERDICT: {verdict.status.upper()} (exit {verdict.exit_code}) - {terminal_text(verdict.reason)}",
              f"expectations: {s.expectations}  passed: {s.passed}  failed: {s.failed}  "
              f"not evaluated: {s.not_evaluated}  not produced: {s.not_produced}"]
    if verdict.breaches:
        rows = [[b.table, _cell(b.column, 24), b.expectation.removeprefix("expect_"), _cell(observed_text(b.observed)),
                 _cell(b.allowed), _cell(b.source, 50)] for b in verdict.breaches]
        lines += ["", "Breaches:", _grid(["table", "column", "expectation", "observed", "allowed", "source"], rows)]
    if verdict.infra_errors:
        lines += ["", "Infrastructure problems (not a regression):",
                  *(f"  - {terminal_text(e)}" for e in verdict.infra_errors)]
    if verdict.undecided:
        lines += ["", UNDECIDED_HEADING + ":", *(f"  - {terminal_text(e)}" for e in verdict.undecided)]
    if verdict.not_validated:
        na = set(verdict.not_applicable)
        lines += ["", "Not validated (table not produced):",
                  *(f"  - {t}{' (stage skipped / not applicable)' if t in na else ''}" for t in verdict.not_validated)]
    gated = gated_paired_rows(paired)
    if gated:
        lines += ["", "Paired comparison (candidate / baseline):",
                  *(f"  - {terminal_text(paired_text(row))}" for row in gated)]
    calibration = calibration_text(verdict.calibration)
    if calibration:
        lines += ["", f"Trust: {terminal_text(calibration)}"]
    return "\n".join(lines)


def _md(value: Any) -> str:
    return markdown_cell(_cell(value, 80))


def verdict_markdown(verdict: Verdict, paired: Sequence[Mapping[str, Any]] = ()) -> str:
    """The verdict as Markdown (a Prefect artifact / CI summary); one line per gated metric of the
    run's ``paired`` table (its rows as records) when it has one."""
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
    if verdict.undecided:
        out += ["", f"### {UNDECIDED_HEADING}", ""]
        out += [f"- {markdown_text(e)}" for e in verdict.undecided]
    gated = gated_paired_rows(paired)
    if gated:
        out += ["", "### Paired comparison (candidate / baseline)", ""]
        out += [f"- {markdown_text(paired_text(row))}" for row in gated]
    if verdict.not_validated:
        na = set(verdict.not_applicable)
        out += ["", "### Not validated", ""]
        out += [f"- {markdown_code(t)}{' (stage skipped / not applicable)' if t in na else ' (not produced)'}"
                for t in verdict.not_validated]
    calibration = calibration_text(verdict.calibration)
    if calibration:
        out += ["", f"**Trust:** {markdown_text(calibration)}"]
    return "\n".join(out) + "\n"
