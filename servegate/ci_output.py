"""What a CI system renders from a gate run: GitHub's job summary, annotations and a PR comment.

With ``servegate run --github`` (or whenever ``GITHUB_ACTIONS=true``), after the verdict:

- the run's ``summary.md`` is appended to ``$GITHUB_STEP_SUMMARY`` (the job's summary page);
- one workflow-command annotation per finding is printed on stderr (the runner reads workflow
  commands from both streams, and stdout stays the verdict table or the ``--json`` document):
  ``::error`` per breach (a regression), ``::warning`` per undecided or suspicious gated metric, ``::warning`` per
  infrastructure problem (could not decide);
- ``pr_comment.md`` is written into the run folder: the summary under a hidden marker naming the
  gate key, so that a workflow can post it (``gh pr comment --body-file``) and later edit the same
  comment instead of adding one per run (``deployments/github/servegate-nightly.yml`` does).

Every string that reaches an annotation is escaped as GitHub's workflow-command syntax requires
(``%``, CR and LF in the message; also ``:`` and ``,`` in properties), so a server's error text
cannot end the command early or forge another one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from servegate.render import markdown_code, markdown_text, terminal_text
from servegate.verdict import Verdict, observed_text, undecided_kind

__all__ = ["github_enabled", "annotations", "write_github_outputs", "PR_COMMENT", "comment_marker"]

PR_COMMENT = "pr_comment.md"


def github_enabled(flag: bool) -> bool:
    """``--github`` given, or running inside GitHub Actions."""
    return flag or os.environ.get("GITHUB_ACTIONS", "").strip().lower() == "true"


def _data(text: str) -> str:
    return terminal_text(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _prop(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def _command(kind: str, title: str, message: str) -> str:
    return f"::{kind} title={_prop(title)}::{_data(message)}"


def annotations(verdict: Verdict, key: str) -> list[str]:
    """The workflow commands for ``verdict`` of gate key ``key``: errors first."""
    out = []
    for b in verdict.breaches:
        what = f"{b.table}.{b.column}" if b.column else b.table
        message = f"{what}: observed {observed_text(b.observed)}, allowed {b.allowed}"
        if b.source:
            message += f" ({b.source})"
        out.append(_command("error", f"servegate {key}: regression", message))
    for text in verdict.undecided:
        out.append(_command("warning", f"servegate {key}: {undecided_kind(text)}", text))
    undecided = set(verdict.undecided)
    for text in verdict.infra_errors:
        if text not in undecided:  # infra_errors repeats the undecided entries
            out.append(_command("warning", f"servegate {key}: could not decide", text))
    return out


def comment_marker(key: str) -> str:
    """The hidden line that names a gate key's PR comment (to find and edit it on the next run)."""
    return f"<!-- servegate:{_prop(key)} -->"


def write_github_outputs(verdict: Verdict, key: str, run_dir: Path, stream: TextIO | None = None) -> None:
    """Annotations on ``stream`` (default stderr), summary.md appended to ``$GITHUB_STEP_SUMMARY``
    when it is set, and ``pr_comment.md`` in the run folder."""
    stream = stream or sys.stderr
    for line in annotations(verdict, key):
        stream.write(line + "\n")
    stream.flush()
    summary_path = run_dir / "summary.md"
    summary = summary_path.read_text(encoding="utf-8") if summary_path.is_file() else (
        f"## servegate: **{verdict.status}** (exit {int(verdict.exit_code)}) — {markdown_code(key)}\n\n"
        f"{markdown_text(verdict.reason)}\n")
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY", "").strip()
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as fh:
            fh.write(summary.rstrip("\n") + "\n\n")
    (run_dir / PR_COMMENT).write_text(f"{comment_marker(key)}\n{summary}", encoding="utf-8")
