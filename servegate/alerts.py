"""The nightly matrix's alert: one message per matrix, composed from the gates' run folders, sent
through Prefect notification blocks (no home-made mailer).

- :func:`compose_alert` — the message (subject + markdown body) for a matrix result
  (:func:`servegate.flows.nightly.aggregate`): the matrix verdict and reason; per gate that failed
  or could not decide, its reason, its top regressed metrics (up to three: metric, ratio and
  interval, read from the gate's ``comparison`` and ``paired`` tables with
  :meth:`servegate.results.RunFolder.read_table`), its suspicious metrics (beyond the bound, not yet
  in ``compare.consecutive`` runs in a row: each with its ratio and the history rule's reason), its
  threshold breaches (``verdict.json``), why it could not decide, the baseline runs and the build
  range (baseline build -> candidate build, from the run manifests), and links to the report and
  the dashboard; improvements in a section of their own. Reads files, sends nothing.
- :func:`should_alert` — whether a matrix result is worth a message (failed or inconclusive; a
  pass only when asked for).
- :func:`load_notifier` — a saved Prefect notification block by its slug,
  ``<block-type-slug>/<block-name>`` (``slack-webhook/servegate-nightly``,
  ``custom-webhook/servegate-issues``).
- :func:`send_alert` — the message through each named block; a block that fails is reported in
  the returned list (type and HTTP status, never its URL or secrets), never raised: an alert that
  could not be sent must not change the matrix's verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from servegate.errors import ConfigError, ServegateError
from servegate.history import Store
from servegate.render import gated_paired_rows, markdown_code, markdown_text, percent_text, ratio_text
from servegate.report import failing_rows
from servegate.results import RunFolder
from servegate.verdict import observed_text

__all__ = ["Alert", "AlertLinks", "compose_alert", "load_notifier", "send_alert", "should_alert"]

TOP_REGRESSIONS = 3
"""Regressed metrics named per gate: a message people read on a phone, the report has the rest."""


class AlertLinks(BaseModel):
    """Where the message's links point. Unset: plain paths on the gate machines."""

    model_config = ConfigDict(extra="forbid")

    runs_base_url: str | None = Field(
        None, description="URL the run folders are served under (e.g. https://ci.example.com/servegate/runs): "
                          "a run's report is <runs_base_url>/<run id>/report.html; unset: the folder's path")
    dashboard_url: str | None = Field(
        None, description="URL of the site `servegate dashboard --out` writes; unset: not linked")


class Alert(BaseModel):
    """One message: ``subject`` (one line) and a markdown ``body``."""

    model_config = ConfigDict(extra="forbid")

    subject: str = Field(description="one line: matrix name, verdict and reason")
    body: str = Field(description="markdown: gates that failed or could not decide, improvements, links")


def should_alert(result: Mapping[str, Any], *, on_pass: bool = False) -> bool:
    """A failed or inconclusive matrix is always worth a message; a pass only when ``on_pass``."""
    return result.get("status") != "pass" or on_pass


# ---- reading one gate's run folder ------------------------------------------------------------
def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def _badness(row: Mapping[str, Any]) -> float:
    """How far a ratio moved in the bad direction, in log: the largest regressions first."""
    ratio = _finite(row.get("ratio"))
    if ratio is None:
        return -math.inf
    log = math.log(ratio)
    return -log if row.get("direction") == "higher_is_better" else log


def _change_rows(tables: Mapping[str, pd.DataFrame], decision: str) -> list[dict[str, Any]]:
    """Comparison rows (against the history baseline) and gated paired rows (against the baseline
    worker) with ``decision``, worst (regressions, suspicious) or best (improvements) first."""
    rows: list[dict[str, Any]] = []
    comparison = tables.get("comparison")
    if comparison is not None and "decision" in comparison:
        chosen = (failing_rows(comparison) if decision == "regression"
                  else comparison[comparison["decision"] == decision])
        for row in chosen.to_dict("records"):
            case = row.get("case") if isinstance(row.get("case"), str) and row.get("case") else None
            rows.append({**row, "metric": f"{row['metric']} ({case})" if case else row["metric"],
                         "against": "baseline runs"})
    if tables.get("paired") is not None:
        for row in gated_paired_rows(tables["paired"].to_dict("records")):
            if row.get("decision") == decision:
                rows.append({**row, "against": "baseline worker (paired)"})
    return sorted(rows, key=_badness, reverse=decision in ("regression", "suspicious"))


def _tables(folder: RunFolder) -> dict[str, pd.DataFrame]:
    """The run's ``comparison`` and ``paired`` tables, those it has."""
    return {name: folder.read_table(name) for name in ("comparison", "paired") if folder.has_table(name)}


def _change_line(row: Mapping[str, Any]) -> str:
    bound = f", bound {percent_text(row.get('bound'))}" if _finite(row.get("bound")) else ""
    return (f"{markdown_code(row['metric'])}: {ratio_text(row.get('ratio'), row.get('ci_low'), row.get('ci_high'))}"
            f" vs {markdown_text(row['against'])}{bound}")


def _baseline_runs(comparison: pd.DataFrame | None) -> tuple[str | None, list[str]]:
    """The comparison's baseline policy and run ids (the table's attrs, as compare wrote them)."""
    if comparison is None:
        return None, []
    baseline = comparison.attrs.get("baseline") or {}
    run_ids = list(baseline.get("run_ids") or [])
    if not run_ids and "baseline_runs" in comparison:
        run_ids = [r for cell in comparison["baseline_runs"].dropna() for r in str(cell).split(",") if r]
    return baseline.get("policy"), sorted(set(run_ids))


def _revision(manifest: Mapping[str, Any]) -> str:
    rev = manifest.get("git_revision")
    if not rev:
        return "unknown build"
    text = str(rev)[:12] + ("+dirty" if manifest.get("git_dirty") else "")
    return f"{text} ({manifest['git_branch']})" if manifest.get("git_branch") else text


def _baseline_manifest(run_id: str, near: Path, store: Store | None) -> dict[str, Any] | None:
    """A baseline run's manifest: from its folder next to the candidate's (one output_dir per gate
    machine), else from the history database when one is given."""
    try:
        return RunFolder.open(near / run_id).manifest.model_dump(mode="json")
    except (ConfigError, OSError):
        pass
    if store is not None:
        try:
            return store.get_run(run_id).manifest
        except (ServegateError, LookupError, KeyError):
            return None
    return None


def _report_link(run_dir: Path, links: AlertLinks) -> str:
    """The run's HTML report (its markdown summary when the report was not rendered), under
    ``runs_base_url`` when set, else its path."""
    name = next((n for n in ("report.html", "summary.md") if (run_dir / n).is_file()), "report.html")
    if links.runs_base_url:
        return f"{links.runs_base_url.rstrip('/')}/{run_dir.name}/{name}"
    return str(run_dir / name)


def _gate_section(gate: Mapping[str, Any], links: AlertLinks, store: Store | None) -> tuple[list[str], list[str]]:
    """(lines of the gate's section, lines of its improvements)."""
    lines = [f"### {markdown_text(gate['deployment'])}: {markdown_text(gate['status']).upper()}",
             markdown_text(gate.get("reason") or "no reason given")]
    if not gate.get("run_dir"):
        lines.append(f"No run folder (flow run {markdown_code(gate.get('flow_run_name'))}): see its logs in Prefect.")
        return lines, []
    run_dir = Path(gate["run_dir"])
    try:
        folder = RunFolder.open(run_dir)
        verdict = folder.read_json("verdict") if (run_dir / "verdict.json").is_file() else {}
        tables = _tables(folder)
        regressions = _change_rows(tables, "regression")
        suspicious = _change_rows(tables, "suspicious")
        improvements = _change_rows(tables, "improvement")
        policy, baseline_ids = _baseline_runs(tables.get("comparison"))
    except (ServegateError, OSError, ValueError) as exc:
        lines.append(f"Run folder {markdown_code(run_dir)} could not be read here ({markdown_text(exc)}): share the "
                     f"runs folder with the matrix's machine, or set runs_base_url and follow the link.")
        return lines, []
    if regressions:
        lines.append(f"\nTop regressed metrics ({min(len(regressions), TOP_REGRESSIONS)} of {len(regressions)}):")
        lines += [f"- {_change_line(r)}" for r in regressions[:TOP_REGRESSIONS]]
    if suspicious:
        lines.append(f"\nSuspicious metrics, not yet called a regression ({min(len(suspicious), TOP_REGRESSIONS)} of "
                     f"{len(suspicious)}):")
        lines += [f"- {_change_line(r)}: {markdown_text(r.get('reason') or '')}" for r in suspicious[:TOP_REGRESSIONS]]
    # Threshold breaches; a comparison breach is the regressions above.
    breaches = [b for b in verdict.get("breaches") or [] if b.get("table") != "comparison"]
    if breaches:
        lines.append(f"\nThreshold breaches ({min(len(breaches), TOP_REGRESSIONS)} of {len(breaches)}):")
        lines += [f"- {markdown_code(str(b.get('table')) + '.' + str(b.get('column')))}: observed "
                  f"{markdown_text(observed_text(b.get('observed')))}, allowed {markdown_text(b.get('allowed'))}"
                  for b in breaches[:TOP_REGRESSIONS]]
    undecided = [*(verdict.get("infra_errors") or []), *(verdict.get("undecided") or [])]
    if gate["status"] == "inconclusive" and undecided:
        lines.append("\nCould not decide:")
        lines += [f"- {markdown_text(u)}" for u in undecided[:TOP_REGRESSIONS]]
    candidate = folder.manifest.model_dump(mode="json")
    if baseline_ids:
        manifests = {rid: _baseline_manifest(rid, run_dir.parent, store) for rid in baseline_ids}
        lines.append(f"\n- Baseline ({markdown_text(policy or 'history')}): "
                     + ", ".join(f"{markdown_code(rid)} at {markdown_text(_revision(m) if m else 'build not found')}"
                                 for rid, m in manifests.items()))
        latest = manifests[baseline_ids[-1]]
        lines.append(f"- Build range: {markdown_text(_revision(latest) if latest else 'unknown build')} -> "
                     f"{markdown_text(_revision(candidate))} (latest baseline -> this run)")
    else:
        lines.append(f"\n- Build: {markdown_text(_revision(candidate))} (no baseline runs compared)")
    lines.append(f"- Run {markdown_code(candidate['run_id'])}, report: <{_report_link(run_dir, links)}>")
    shown = [f"- {markdown_text(gate['deployment'])}: {_change_line(r)}" for r in improvements]
    return lines, shown


def compose_alert(result: Mapping[str, Any], *, title: str = "nightly-matrix", links: AlertLinks | None = None,
                  store: Store | None = None) -> Alert:
    """The one message for a matrix ``result`` (``aggregate``'s dict: status, reason, gates with
    deployment, status, reason, run_dir, flow_run_name). Reads the gates' run folders (and, for a
    baseline run whose folder is not next to the candidate's, ``store``); sends nothing."""
    links = links or AlertLinks()
    status = str(result.get("status", "unknown"))
    subject = f"servegate {title}: {status.upper()}: {result.get('reason') or ''}".strip()
    body = [f"## servegate {markdown_text(title)}: **{markdown_text(status).upper()}**",
            markdown_text(result.get("reason") or "")]
    improvements: list[str] = []
    gates: Sequence[Mapping[str, Any]] = result.get("gates") or []
    for gate in gates:
        if gate.get("status") == "pass":
            improvements += _passing_improvements(gate)
            continue
        section, improved = _gate_section(gate, links, store)
        body += ["", *section]
        improvements += improved
    passed = [g for g in gates if g.get("status") == "pass"]
    if passed:
        body += ["", "Passed: " + ", ".join(markdown_text(g["deployment"]) for g in passed)]
    if improvements:
        body += ["", "### Improvements", *improvements]
    body += ["", f"Dashboard: <{links.dashboard_url}>" if links.dashboard_url
             else "Dashboard: not linked (set the matrix's alert_links.dashboard_url)"]
    return Alert(subject=" ".join(subject.split()), body="\n".join(body) + "\n")


def _passing_improvements(gate: Mapping[str, Any]) -> list[str]:
    """A passing gate's improvements (its folder unreadable here: none to show)."""
    if not gate.get("run_dir"):
        return []
    try:
        rows = _change_rows(_tables(RunFolder.open(gate["run_dir"])), "improvement")
    except (ServegateError, OSError, ValueError):
        return []
    return [f"- {markdown_text(gate['deployment'])}: {_change_line(r)}" for r in rows]


# ---- sending -----------------------------------------------------------------------------------
def load_notifier(name: str):  # -> prefect.blocks.abstract.NotificationBlock
    """A saved Prefect notification block, by ``<block-type-slug>/<block-name>`` (e.g.
    ``slack-webhook/servegate-nightly``, ``custom-webhook/servegate-issues``)."""
    from prefect.blocks.abstract import NotificationBlock
    from prefect.blocks.core import Block

    if name.count("/") != 1 or not all(name.split("/")):
        raise ConfigError(f"alert block {name!r}: give '<block-type-slug>/<block-name>', e.g. "
                          f"'slack-webhook/servegate-nightly' or 'custom-webhook/servegate-issues' "
                          f"(`prefect block ls` lists the saved blocks)")
    try:
        block = Block.load(name)
    except ValueError as exc:  # Prefect's "Unable to find block document", or a saved block that fails validation
        raise ConfigError(f"alert block {name!r} could not be loaded from this Prefect server ({exc}); create it "
                          f"as docs/alerts.md says, or fix the matrix's alert_blocks") from exc
    except KeyError as exc:  # a custom webhook's template names a {{placeholder}} that is not in its secrets
        raise ConfigError(f"alert block {name!r} uses the placeholder {exc} that is neither subject, body, name "
                          f"nor a key of its secrets; fix the block's templates") from exc
    if not isinstance(block, NotificationBlock):
        raise ConfigError(f"alert block {name!r} is a {type(block).__name__}, not a notification block; "
                          f"use a slack-webhook or custom-webhook block")
    return block


def _failure_text(exc: BaseException) -> str:
    # A webhook's URL can be its secret (Slack's is): name the failure by type and HTTP status only.
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        return f"{type(exc).__name__}: HTTP {status} {getattr(response, 'reason_phrase', '')}".rstrip()
    if isinstance(exc, ConfigError):
        return str(exc)
    return type(exc).__name__


def send_alert(alert: Alert, block_names: Iterable[str]) -> list[dict[str, Any]]:
    """Send ``alert`` through each named block; one {block, sent, error} per block. Never raises:
    a failed send is returned (and the caller logs it), the matrix's verdict stays what it was."""
    import httpx
    from prefect.blocks.abstract import NotificationError

    outcomes = []
    for name in block_names:
        try:
            block = load_notifier(name)
            with block.raise_on_failure():
                block.notify(alert.body, alert.subject)
        except (ConfigError, NotificationError, httpx.HTTPError, OSError, ValueError) as exc:
            outcomes.append({"block": name, "sent": False, "error": _failure_text(exc)})
        else:
            outcomes.append({"block": name, "sent": True, "error": None})
    return outcomes
