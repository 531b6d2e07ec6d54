"""The nightly matrix's alert, end to end: a real Prefect server, a process worker, a failing gate,
Prefect notification blocks posting to a webhook receiver on loopback.

One module fixture does the expensive part once: ``prefect server start`` (SQLite, loopback), the
gate and matrix deployments from ``deployments/prefect.yaml``, three notification blocks saved on
the server (a Slack-compatible webhook, the GitHub issue target with its token in the block's
``secrets``, and a webhook that answers HTTP 500), a baseline smoke run recorded in the history,
then the nightly matrix with one smoke gate whose worker makes every forward pass 5x slower
(``--fault-decode-slowdown-pct 400``): the decode metrics regress against the baseline, the gate
fails, the matrix fails and sends its one message through each block. The tests read what the
receiver got; the message composition is also checked against that real run folder.

The server and process helpers are test_prefect_multiworker's (same directory). ~2-3 min on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_prefect_multiworker import PREFECT, REPO, _cli, _env, _start, _wait_healthy

from servegate.alerts import AlertLinks, compose_alert, send_alert
from servegate.launch import free_port
from servegate.proctree import terminate_tree

pytestmark = [pytest.mark.gate, pytest.mark.timeout(900)]

GITHUB_TOKEN = "ghp_test0token0that0must0never0leak"  # stands in for a real token: only in the block's secrets
OWNER_REPO = "acme/servegate"
RUNS_URL = "https://ci.example.com/servegate/runs"
DASHBOARD_URL = "https://ci.example.com/servegate/dashboard/"
BLOCKS = ["custom-webhook/servegate-chat", "custom-webhook/servegate-issues", "custom-webhook/servegate-broken"]
# The smoke gate, small: 12 requests, no occupancy or quality stage, the baseline comparison on with
# the bounds tests/e2e/test_nightly_history.py measured this machine's run-to-run noise against (30 %
# on medians): a 5x slower forward pass moves ITL by x3.4-5.4, far beyond them.
FAST = ["serving.num_prompts=12", "occupancy.enabled=false", "quality.enabled=false", "report.html=false",
        "one_batch.batch_sizes=[1]", "one_batch.input_lens=[16]", "one_batch.output_lens=[8]",
        "compare.enabled=true", "compare.bound=0.30", "compare.tail_bound=0.50",
        # the test's own Prefect server and worker are "other processes" to a gate's host check
        "host.enabled=false"]
SLOWDOWN = 'worker.extra_args=["--fault-decode-slowdown-pct","400"]'
DECODE_METRICS = ("serving.itl_ms.median", "serving.tpot_ms.median")


class _Receiver(BaseHTTPRequestHandler):
    """Records every request; /broken answers 500, the GitHub path 201, anything else 200."""

    requests: list[dict] = []

    def _record(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                              "body": self.rfile.read(length).decode("utf-8")})
        code = 500 if self.path == "/broken" else 201 if self.path.endswith("/issues") else 200
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    do_POST = do_PUT = do_GET = _record

    def log_message(self, *args) -> None:  # quiet: the test reads .requests
        pass


@pytest.fixture(scope="module")
def receiver():
    handler = type("Receiver", (_Receiver,), {"requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    finally:
        server.shutdown()
        server.server_close()


def _blocks_script(base: str) -> str:
    """How docs/alerts.md creates the blocks, run against the test's server."""
    return f"""
import sys
from prefect.blocks.notifications import CustomWebhookNotificationBlock
CustomWebhookNotificationBlock(name="servegate-chat", url="{base}/hooks/chat",
    json_data={{"text": "*{{{{subject}}}}*\\n{{{{body}}}}"}}).save("servegate-chat", overwrite=True)
CustomWebhookNotificationBlock(name="servegate-issues", url="{base}/repos/{OWNER_REPO}/issues",
    headers={{"Authorization": "Bearer {{{{github_token}}}}", "Accept": "application/vnd.github+json",
             "X-GitHub-Api-Version": "2022-11-28"}},
    json_data={{"title": "{{{{subject}}}}", "body": "{{{{body}}}}"}},
    secrets={{"github_token": sys.stdin.read().strip()}}).save("servegate-issues", overwrite=True)
CustomWebhookNotificationBlock(name="servegate-broken", url="{base}/broken",
    json_data={{"text": "{{{{body}}}}"}}).save("servegate-broken", overwrite=True)
"""


@pytest.fixture(scope="module")
def failed_matrix(tmp_path_factory, receiver):
    """One failing nightly matrix under a real Prefect server: (matrix result, matrix process, env, tmp)."""
    base, _ = receiver
    tmp = tmp_path_factory.mktemp("alerts")
    (tmp / "prefect-home").mkdir()
    port = free_port()
    env = _env(tmp, port, f"sqlite+aiosqlite:///{tmp / 'prefect.db'}", f"sqlite:///{tmp / 'history.db'}")
    procs: list[subprocess.Popen] = []
    server_log = tmp / "server.log"
    procs.append(_start([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, server_log))
    try:
        _wait_healthy(env["PREFECT_API_URL"], procs[0], server_log)
        for pool in ("servegate-cpu", "servegate-control"):
            _cli([*PREFECT, "work-pool", "create", pool, "--type", "process"], env)
        deployed = _cli([*PREFECT, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml",
                         "--name", "smoke-cpu", "--name", "nightly-cpu"], env, timeout=300)
        assert "regression-gate/smoke-cpu" in deployed.stdout and "nightly-matrix/nightly-cpu" in deployed.stdout
        # The token goes in on stdin: never on a command line.
        blocks = subprocess.run([sys.executable, "-c", _blocks_script(base)], input=GITHUB_TOKEN, cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        assert blocks.returncode == 0, blocks.stderr[-3000:]

        # The baseline: one smoke night recorded in the history (no history before it: inconclusive,
        # and baseline-eligible).
        runs = tmp / "runs"
        sets = [arg for item in FAST for arg in ("--set", item)]
        night1 = subprocess.run([sys.executable, "-m", "servegate", "run", "--profile", "smoke", "--json",
                                 "--output-dir", str(runs), *sets], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=600)
        assert night1.returncode == 2, f"baseline night exit {night1.returncode}\n{night1.stderr[-3000:]}"

        procs.append(_start([*PREFECT, "worker", "start", "--pool", "servegate-cpu", "--type", "process",
                             "--name", "alerts-machine", "--limit", "1"], env, tmp / "worker.log"))
        gates = [{"deployment": "regression-gate/smoke-cpu",
                  "parameters": {"overrides": [*FAST, f"output_dir={runs}", SLOWDOWN]}}]
        links = {"runs_base_url": RUNS_URL, "dashboard_url": DASHBOARD_URL}
        script = ("import json, sys; from servegate.flows.nightly import nightly_matrix; "
                  "print('RESULT ' + json.dumps(nightly_matrix(gates=json.loads(sys.argv[1]), timeout_s=600, "
                  "alert_blocks=json.loads(sys.argv[2]), alert_links=json.loads(sys.argv[3]))))")
        matrix = subprocess.run([sys.executable, "-c", script, json.dumps(gates), json.dumps(BLOCKS),
                                 json.dumps(links)], cwd=REPO, env=env, capture_output=True, text=True, timeout=700)
        assert matrix.returncode == 0, \
            f"matrix exit {matrix.returncode}\n{matrix.stdout[-3000:]}\n{matrix.stderr[-3000:]}"
        line = next(x for x in matrix.stdout.splitlines() if x.startswith("RESULT "))
        yield json.loads(line.removeprefix("RESULT ")), matrix, env, tmp
    finally:
        for proc in reversed(procs):
            terminate_tree(proc.pid, timeout_s=15)
            if proc.stdout is not None:
                proc.stdout.close()


def _gate_dir(result: dict) -> Path:
    [gate] = result["gates"]
    return Path(gate["run_dir"])


def _regressed(run_dir: Path) -> pd.DataFrame:
    """The run's regressed comparison rows, worst first (largest log ratio in the bad direction)."""
    comparison = pd.read_parquet(run_dir / "comparison.parquet")
    rows = comparison[comparison["decision"] == "regression"]
    sign = rows["direction"].map({"lower_is_better": 1.0, "higher_is_better": -1.0})
    return rows.assign(badness=sign * np.log(rows["ratio"].astype(float))).sort_values("badness", ascending=False)


def test_a_failed_matrix_sends_one_message_with_the_top_regressions_and_links(failed_matrix, receiver):
    result, matrix, _, _ = failed_matrix
    _, requests = receiver
    assert result["status"] == "fail" and result["exit_code"] == 1, result
    # one message per matrix and block, nothing else
    assert sorted(r["path"] for r in requests) == sorted(["/hooks/chat", f"/repos/{OWNER_REPO}/issues", "/broken"])
    chat = [r for r in requests if r["path"] == "/hooks/chat"]
    text = json.loads(chat[0]["body"])["text"]
    run_dir = _gate_dir(result)
    regressed = _regressed(run_dir)
    assert set(DECODE_METRICS) & set(regressed["metric"]), regressed
    assert text.startswith("*servegate nightly-matrix: FAIL: 1 of 1 gate(s) found a regression*\n"), text
    assert "regression-gate/smoke-cpu: FAIL" in text
    # each named regression with its ratio and interval, as every text output writes them
    for row in regressed.head(3).itertuples(index=False):
        name = f"{row.metric} ({row.case})" if row.case else row.metric
        shown = f"`{name}`: ×{row.ratio:.4f} [{row.ci_low:.4f}, {row.ci_high:.4f}] vs baseline runs"
        assert shown in text, (shown, text)
    # the baseline run and the build range (both runs are builds of this checkout)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    [baseline] = pd.read_parquet(run_dir / "comparison.parquet").attrs["baseline"]["run_ids"]
    assert f"`{baseline}`" in text and "Build range: " in text and manifest["git_revision"][:12] in text, text
    assert f"<{RUNS_URL}/{run_dir.name}/summary.md>" in text, text
    assert f"Dashboard: <{DASHBOARD_URL}>" in text, text


def test_the_github_issue_target_gets_the_exact_request(failed_matrix, receiver):
    result, _, _, _ = failed_matrix
    _, requests = receiver
    issues = [r for r in requests if r["path"] == f"/repos/{OWNER_REPO}/issues"]
    assert len(issues) == 1, [r["path"] for r in requests]
    request = issues[0]
    assert request["method"] == "POST"
    assert request["headers"]["Authorization"] == f"Bearer {GITHUB_TOKEN}"
    assert request["headers"]["Accept"] == "application/vnd.github+json"
    assert request["headers"]["Content-Type"] == "application/json"
    payload = json.loads(request["body"])
    assert set(payload) == {"title", "body"}, payload
    assert payload["title"] == "servegate nightly-matrix: FAIL: 1 of 1 gate(s) found a regression"
    assert payload["body"].startswith("## servegate nightly-matrix: **FAIL**\n"), payload["body"]
    assert all(f"`{m}`" in payload["body"] for m in _regressed(_gate_dir(result))["metric"].head(3)), payload["body"]
    assert {"block": "custom-webhook/servegate-issues", "sent": True, "error": None} in result["alerts"]


def test_a_failed_send_is_logged_and_leaves_the_verdict(failed_matrix, receiver):
    result, matrix, _, tmp = failed_matrix
    _, requests = receiver
    assert [r["path"] for r in requests].count("/broken") == 1
    assert result["exit_code"] == 1 and result["status"] == "fail"
    broken = next(a for a in result["alerts"] if a["block"] == "custom-webhook/servegate-broken")
    assert broken == {"block": "custom-webhook/servegate-broken", "sent": False,
                      "error": "HTTPStatusError: HTTP 500 Internal Server Error"}, result["alerts"]
    assert "ALERT NOT SENT through notification block custom-webhook/servegate-broken" in matrix.stderr
    # The token lives in the block's secrets on the server only: no log, run folder or output has it.
    outputs = matrix.stdout + matrix.stderr
    leaks = [str(p) for p in tmp.rglob("*")
             if p.is_file() and not p.name.startswith("prefect.db") and GITHUB_TOKEN.encode() in p.read_bytes()]
    assert GITHUB_TOKEN not in outputs and not leaks, leaks


def test_the_message_composed_from_the_real_run_folder(failed_matrix):
    result, _, _, _ = failed_matrix
    run_dir = _gate_dir(result)
    # Links unset: plain paths on the gate machine.
    alert = compose_alert(result)
    assert f"report: <{run_dir / 'summary.md'}>" in alert.body, alert.body
    assert "Dashboard: not linked" in alert.body
    regressed = _regressed(run_dir)
    named = [line for line in alert.body.splitlines() if line.startswith("- `") and "vs baseline runs" in line]
    assert len(named) == min(3, len(regressed)), alert.body
    assert "### Improvements" not in alert.body or "improvement" in set(
        pd.read_parquet(run_dir / "comparison.parquet")["decision"]), alert.body
    # With a base URL the report link is the run's folder under it.
    linked = compose_alert(result, links=AlertLinks(runs_base_url=RUNS_URL + "/"))
    assert f"<{RUNS_URL}/{run_dir.name}/summary.md>" in linked.body


def test_an_unknown_block_is_reported_not_raised(failed_matrix):
    _, _, env, _ = failed_matrix
    from prefect.settings import PREFECT_API_URL, temporary_settings

    alert = compose_alert({"status": "inconclusive", "reason": "r", "gates": []})
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        outcomes = send_alert(alert, ["custom-webhook/no-such-block", "no-slash"])
    assert [o["sent"] for o in outcomes] == [False, False]
    assert "could not be loaded from this Prefect server" in outcomes[0]["error"], outcomes
    assert "give '<block-type-slug>/<block-name>'" in outcomes[1]["error"], outcomes


def test_a_message_that_cannot_be_composed_leaves_the_verdict(prefect_server, monkeypatch, caplog):
    # An empty matrix decides nothing (inconclusive, exit 2) without starting a gate; the history
    # database the message would read baseline builds from cannot be opened.
    from servegate.flows.nightly import nightly_matrix

    monkeypatch.setenv("SERVEGATE_DB", "nosuchdriver://history")
    result = nightly_matrix(gates=[], alert_blocks=["custom-webhook/servegate-chat"])
    assert (result["status"], result["exit_code"]) == ("inconclusive", 2), result
    [delivery] = result["alerts"]
    assert delivery["sent"] is False and delivery["error"].startswith("alert failed: "), delivery
    assert "cannot open history database" in delivery["error"], delivery
    logged = [r.getMessage() for r in caplog.records]
    assert any("ALERT NOT SENT: the matrix's message could not be composed or sent" in m for m in logged), logged
