"""The CI examples under deployments/ (issue 14): valid YAML whose commands are real servegate
commands, which keep the run folder and its JUnit file whatever the verdict."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from servegate.cli import build_parser
from servegate.config import load_config

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


def _servegate_commands(script: str, profile: str) -> list[list[str]]:
    out = []
    for line in script.splitlines():
        line = line.strip()
        if line.startswith("servegate "):
            line = line.replace('"${{ matrix.profile }}"', profile).replace('"$SERVEGATE_PROFILE"', profile)
            out.append(shlex.split(line)[1:])
    return out


def _parses(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)  # SystemExit (a test error) on an unknown command or flag
    assert args.command == "run" and args.profile
    load_config(profile=args.profile)  # a shipped profile


def test_github_workflow_runs_the_gate_for_each_profile_and_keeps_its_outputs_whatever_the_verdict():
    doc = yaml.safe_load((DEPLOYMENTS / "github" / "servegate-nightly.yml").read_text())
    assert doc[True]["schedule"][0]["cron"]  # YAML 1.1 reads the key `on` as True
    job = doc["jobs"]["gate"]
    assert "gpu-h100" in job["runs-on"] and "self-hosted" in job["runs-on"]
    profiles = job["strategy"]["matrix"]["profile"]
    commands = [c for step in job["steps"] for p in profiles for c in _servegate_commands(step.get("run", ""), p)]
    assert len(commands) == len(profiles)
    for argv in commands:
        _parses(argv)
        assert "--github" in argv and "--output-dir" in argv
    after = job["steps"][[i for i, s in enumerate(job["steps"]) if s.get("id") == "gate"][0] + 1:]
    assert after and all(str(s.get("if", "")).startswith("always()") for s in after)
    uses = {s.get("uses", "").split("@")[0] for s in after}
    assert {"actions/upload-artifact", "mikepenz/action-junit-report"} <= uses
    comment = [s for s in after if "gh pr comment" in s.get("run", "")]
    assert comment and "pr_comment.md" in comment[0]["run"]


def test_gitlab_job_runs_the_gate_and_reports_junit_whatever_the_verdict():
    doc = yaml.safe_load((DEPLOYMENTS / "gitlab" / "servegate.gitlab-ci.yml").read_text())
    base = doc[".servegate"]
    assert base["artifacts"]["when"] == "always" and base["artifacts"]["reports"]["junit"]
    jobs = {name: job for name, job in doc.items() if isinstance(job, dict) and job.get("extends") == ".servegate"}
    assert jobs
    for job in jobs.values():
        (argv,) = _servegate_commands("\n".join(base["script"]), job["variables"]["SERVEGATE_PROFILE"])
        _parses(argv)


@pytest.mark.parametrize("argv", [["run", "--profile", "smoke", "--github"], ["rerun", "RUN", "--task", "serving",
                                                                              "--github"]])
def test_the_github_flag_exists_where_the_examples_need_it(argv):
    assert build_parser().parse_args(argv).github is True
