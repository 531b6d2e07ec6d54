"""The missing-data alarms without a server: what deployments/prefect.yaml makes watched, with which
deadlines, the automations built from it (checked by Prefect's server-side models, as the API checks
them), and the command's errors when no server is there (exit 2, what to do)."""

from __future__ import annotations

from pathlib import Path
from uuid import uuid4

import pytest
import yaml
from prefect.settings import PREFECT_API_URL, temporary_settings

from servegate import cli
from servegate.automations import (DEFAULT_DEADLINE_S, MARGIN_S, NAME_PREFIX, alarm_automations,
                                   watched_deployments)
from servegate.errors import ConfigError
from servegate.launch import free_port

PREFECT_FILE = Path(__file__).resolve().parents[2] / "deployments" / "prefect.yaml"
HOUR = 3600.0


def _flows(watched) -> dict[str, str]:
    return {w.name: {"nightly-cpu": "nightly-matrix", "nightly-gpu": "nightly-matrix",
                     "calibrate-smoke-cpu": "calibrate-gate"}.get(w.name, "regression-gate") for w in watched}


def test_the_shipped_project_watches_its_gates_and_scheduled_deployments() -> None:
    declared = {d["name"]: d for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"]}
    by_name = {w.name: w for w in watched_deployments(PREFECT_FILE)}
    gates = {n for n, d in declared.items() if d.get("entrypoint") == "flows/gate.py:regression_gate"}
    assert set(by_name) == gates | {"nightly-cpu", "nightly-gpu", "calibrate-smoke-cpu"}  # not the re-runs
    # a gate may wait in its pool behind the others: the deadline is its matrix's timeout, plus the margin
    assert by_name["smoke-cpu"].deadline_s == declared["nightly-cpu"]["parameters"]["timeout_s"] + MARGIN_S
    assert by_name["vllm-h100"].deadline_s == declared["nightly-gpu"]["parameters"]["timeout_s"] + MARGIN_S
    assert by_name["smoke-cpu"].silence_s is None  # started by the matrix, not by a schedule
    # 01:00 in Los Angeles: the night the clocks go back lasts 25 h
    assert by_name["nightly-cpu"].silence_s == 25 * HOUR + by_name["nightly-cpu"].deadline_s
    assert by_name["calibrate-smoke-cpu"].deadline_s == DEFAULT_DEADLINE_S
    assert by_name["calibrate-smoke-cpu"].silence_s == (7 * 24 + 1) * HOUR + DEFAULT_DEADLINE_S


def test_deadlines_are_set_for_all_or_per_deployment() -> None:
    watched = watched_deployments(PREFECT_FILE, only=["regression-gate/smoke-cpu", "nightly-cpu"],
                                  deadlines=["600", "nightly-cpu=18000"], silences=["nightly-cpu=90000"])
    assert [(w.name, w.deadline_s, w.silence_s) for w in watched] == [("smoke-cpu", 600, None),
                                                                       ("nightly-cpu", 18000, 90000)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"deadlines": ["5"]}, "must be a finite number of seconds >= 10"),
    ({"deadlines": ["inf"]}, "must be a finite number of seconds >= 10"),
    ({"deadlines": ["soon"]}, "expected SECONDS or DEPLOYMENT=SECONDS"),
    ({"silences": ["nightly-cpux=60"]}, "no watched deployment 'nightly-cpux'"),
    ({"only": ["rerun-cpu"]}, "not a gate or scheduled deployment"),
])
def test_bad_input_says_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        watched_deployments(PREFECT_FILE, **kwargs)


def test_a_missing_project_file_says_where_to_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--prefect-file"):
        watched_deployments(tmp_path / "prefect.yaml")


def test_the_automations_pass_the_servers_own_validation() -> None:
    from prefect.server.events.schemas.automations import AutomationCore as ServerAutomation

    watched = watched_deployments(PREFECT_FILE)
    block = uuid4()
    automations = alarm_automations(watched, _flows(watched), block)
    names = [a.name for a in automations]
    scheduled = [w for w in watched if w.silence_s is not None]
    assert len(names) == len(set(names)) == len(watched) + len(scheduled) + 3  # + one per flow
    assert all(n.startswith(NAME_PREFIX) for n in names)
    for automation in automations:
        # what POST /automations does with the body: templates must compile in Prefect's sandbox
        server = ServerAutomation.model_validate(automation.model_dump(mode="json"))
        assert [a.block_document_id for a in server.actions] == [block]

    deadline = next(a for a in automations if a.name == f"{NAME_PREFIX}regression-gate/smoke-cpu no verdict by its "
                                                         f"deadline")
    smoke = next(w for w in watched if w.name == "smoke-cpu")
    assert deadline.trigger.posture == "Proactive" and deadline.trigger.within.total_seconds() == smoke.deadline_s
    assert deadline.trigger.after == {"prefect.flow-run.Late", "prefect.flow-run.Running"}
    assert "prefect.flow-run.Completed" in deadline.trigger.expect


def test_without_a_server_the_command_exits_2_and_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["alerts", "install", "--block", "custom-webhook/x", "--prefect-file", str(PREFECT_FILE)]
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert cli.main(argv) == 2
    assert "PREFECT_API_URL is not set" in capsys.readouterr().err
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        assert cli.main(argv) == 2
        assert cli.main(["alerts", "list"]) == 2
    err = capsys.readouterr().err
    assert err.count("ServerUnreachableError: no Prefect server answers at http://127.0.0.1:") == 2, err
