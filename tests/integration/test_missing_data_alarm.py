"""Missing-data alarms (issue 19) on a real ``prefect server start``: automations fire, a webhook hears them.

One server on loopback (SQLite in a temporary PREFECT_HOME, its services running, the late-run and
proactive-trigger loops shortened to 1 s), a CustomWebhookNotificationBlock pointing at a receiver
on loopback (http.server in a thread), the deployments ``regression-gate/smoke-cpu`` and
``nightly-matrix/nightly-cpu`` as in deployments/prefect.yaml (created through the API: ``prefect
deploy`` would import every flow module), and ``servegate alerts install --deadline-s 10
--silence-s 10`` run as the real command, twice (the second updates, creates nothing). Then:

- the machine is down: a run of smoke-cpu is scheduled and no worker exists, so the server marks
  it Late; 10 s later the deadline automation sends one message naming the deployment, the run,
  and why (Late, no worker of its pool);
- a nightly run crashes (its state set to Crashed through the API, as a worker reports a lost
  process): one message at once, naming the deployment and the crash message;
- a nightly run completes in time (no deadline alert for it), then the deployment is paused: no
  run completes within the silence window, one message says the deployment is paused.

Each alarm fires exactly once per run. The proactive window's 10 s floor is Prefect's.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from uuid import UUID

import pytest
import yaml
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Completed, Crashed, Running

from test_prefect_multiworker import _start, _wait_healthy

from servegate import cli
from servegate.automations import NAME_PREFIX
from servegate.launch import free_port
from servegate.proctree import terminate_tree

pytestmark = [pytest.mark.gate]

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 10  # Prefect's floor for a proactive trigger's window


class _Receiver(BaseHTTPRequestHandler):
    messages: queue.Queue

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.messages.put(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, queue.Queue]]:
    messages: queue.Queue = queue.Queue()
    handler = type("Receiver", (_Receiver,), {"messages": messages})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", messages
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def prefect_api(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``prefect server start`` on loopback with its services; its late-run and trigger loops at 1 s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": url,
           # no UI to serve (a few seconds less to start); its URL is still what the messages link to
           "PREFECT_UI_ENABLED": "false", "PREFECT_UI_URL": f"http://127.0.0.1:{port}",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_SERVICES_LATE_RUNS_AFTER_SECONDS": "1",
           "PREFECT_SERVER_SERVICES_LATE_RUNS_LOOP_SECONDS": "1",
           "PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY": "PT1S",
           "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false"}  # runs here are created by the test
    (tmp_path / "prefect-home").mkdir()
    log = tmp_path / "server.log"
    server = _start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                    env, log)
    try:
        _wait_healthy(url, server, log, timeout_s=120)
        yield url, env
    finally:
        terminate_tree(server.pid, timeout_s=15)


def _deploy(client: SyncPrefectClient, webhook_url: str) -> dict[str, UUID]:
    """The two deployments as prefect.yaml declares them (name, flow, pool, parameters), and the block."""
    declared = {d["name"]: d for d in yaml.safe_load((REPO / "deployments/prefect.yaml").read_text())["deployments"]}
    ids = {}
    for flow, name in (("regression-gate", "smoke-cpu"), ("nightly-matrix", "nightly-cpu")):
        d = declared[name]
        client.create_work_pool(WorkPoolCreate(name=d["work_pool"]["name"], type="process"))
        ids[name] = client.create_deployment(
            flow_id=client.create_flow_from_name(flow), name=name, entrypoint=d["entrypoint"],
            parameters=d.get("parameters") or {}, work_pool_name=d["work_pool"]["name"], tags=d["tags"])
    CustomWebhookNotificationBlock(name="servegate", url=webhook_url,
                                   json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("servegate-test")
    return ids


def _servegate(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servegate", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@contextmanager
def _client(url: str) -> Iterator[SyncPrefectClient]:
    """Prefect's own client (it retries the 503s a busy SQLite server answers)."""
    from prefect.client.orchestration import get_client

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        yield client


def _collect(messages: queue.Queue, expected: int, not_before: float, give_up: float) -> list[dict]:
    """Every message until ``expected`` have come and ``not_before`` (monotonic) has passed, then 3 s more
    (a second message for the same run would come within a trigger loop or two); at most until ``give_up``."""
    got: list[dict] = []
    quiet_until = None
    while time.monotonic() < give_up:
        if len(got) >= expected and time.monotonic() >= not_before:
            quiet_until = quiet_until or time.monotonic() + 3
            if time.monotonic() >= quiet_until:
                break
        try:
            got.append(messages.get(timeout=0.2))
        except queue.Empty:
            pass
    return got


@pytest.mark.timeout(240)
def test_a_run_without_a_verdict_raises_the_missing_data_alert(prefect_api, webhook, capsys):
    url, env = prefect_api
    webhook_url, messages = webhook
    with _client(url) as client:
        ids = _deploy(client, webhook_url)

    install = ["alerts", "install", "--block", "custom-webhook/servegate-test", "--prefect-file",
               str(REPO / "deployments/prefect.yaml"), "--deployment", "smoke-cpu",
               "--deployment", "nightly-cpu", "--deadline-s", str(DEADLINE_S), "--silence-s", str(DEADLINE_S)]
    first = _servegate(install, env)
    assert first.returncode == 0, first.stderr
    assert "alerts: 5 created, 0 updated, 0 deleted" in first.stdout, first.stdout
    with temporary_settings({PREFECT_API_URL: url}):  # the same command in this process: no second start-up
        assert cli.main(install) == 0
        assert "alerts: 0 created, 5 updated, 0 deleted" in capsys.readouterr().out
        assert cli.main(["alerts", "list"]) == 0
        assert "5 missing-data automation(s)" in capsys.readouterr().out
        # what is missing on the server is named, with what exists instead; exit 2, nothing changed
        assert cli.main([*install[:2], "--block", "custom-webhook/nope", "--deadline-s", "60"]) == 2
        assert "existing: ['custom-webhook/servegate-test']" in capsys.readouterr().err
        assert cli.main([*install, "--deployment", "vllm-cpu"]) == 2
        assert "deployments ['vllm-cpu'] are not on the Prefect server" in capsys.readouterr().err

    with _client(url) as client:
        installed = [a.name for a in client.read_automations() if a.name.startswith(NAME_PREFIX)]
        assert len(installed) == 5 and len(set(installed)) == 5, installed
        started = time.monotonic()
        stranded = client.create_flow_run_from_deployment(ids["smoke-cpu"])  # no worker polls its pool: Late
        crashed = client.create_flow_run_from_deployment(ids["nightly-cpu"])
        client.set_flow_run_state(crashed.id, Running(), force=True)
        client.set_flow_run_state(crashed.id, Crashed(message="Flow run infrastructure exited with non-zero "
                                                              "status -9"), force=True)
        finished = client.create_flow_run_from_deployment(ids["nightly-cpu"])
        client.set_flow_run_state(finished.id, Running(), force=True)
        client.set_flow_run_state(finished.id, Completed(), force=True)
        client.pause_deployment(ids["nightly-cpu"])

    # Each window is 10 s and the late-run and trigger loops run every second: the three alarms come
    # within ~15 s. Listening until 5 s past the completed run's own deadline shows that it raised none.
    got = _collect(messages, expected=3, not_before=started + DEADLINE_S + 5, give_up=started + 90)
    print("\n\n".join(f"{m['subject']}\n{m['body']}" for m in got))
    bodies = [m["body"] for m in got]

    late = [m for m in got if stranded.name in m["body"]]
    assert len(late) == 1, bodies
    assert late[0]["subject"] == "servegate: no verdict from regression-gate/smoke-cpu by its deadline"
    assert "it went Late at" in late[0]["body"] and "no worker of work pool servegate-cpu" in late[0]["body"]
    assert f"/runs/flow-run/{stranded.id}" in late[0]["body"], late[0]["body"]  # the link to the run

    crash = [m for m in got if crashed.name in m["body"]]
    assert len(crash) == 1, bodies
    assert crash[0]["subject"] == "servegate: nightly-matrix/nightly-cpu ended Crashed without a verdict"
    assert "non-zero status -9" in crash[0]["body"]

    silent = [m for m in got if m["subject"].startswith("servegate: no verdict from nightly-matrix/nightly-cpu for")]
    assert len(silent) == 1, bodies
    assert finished.name in silent[0]["body"] and "the deployment is paused" in silent[0]["body"]
    assert f"/runs/flow-run/{finished.id}" in silent[0]["body"], silent[0]["body"]

    # the completed run had its verdict in time: it appears only as the silent alarm's last good run
    assert [m for m in got if finished.name in m["body"]] == silent, bodies
    assert len(got) == 3, bodies
