"""Secrets planted in a whole gate run are found nowhere in its outputs, and hostile config text
reaches the HTML only escaped (issue 15; issue 11, finding 13).

One real smoke gate (`servegate run --config`, a subprocess, its own ephemeral Prefect server, a
real embedded worker) records into a real PostgreSQL history database whose URL holds a password,
named both in the config file (``store.url``) and in ``$SERVEGATE_DB`` (as a team sets it, for the
history CLIs), and authenticates to its worker with an API key given the documented way:
``worker.api_key_env`` names a variable that holds it (the name, not the key, is on the command
line). While the gate runs, every process of its tree is sampled; afterwards the
key, the password and the URL are looked for in the run folder, the gate's output, the history
and dashboard CLIs' output, Prefect's database and a ``pg_dump`` of the history database.

Where a secret may be by design: the gate's own environment (the user put both there), the
environment its own helpers inherit from it (Prefect's server, the tree guard: same user;
``/proc/PID/environ`` is readable by that user and root only), and ``$SERVEGATE_API_KEY`` in the
worker's (how the embedded worker takes its key, docs/contracts.md) — the worker inherits neither
the user's key variable nor the history's password (``launch.worker_base_environ``). Never a
command line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import markdown_it
import psutil
import pytest
import requests

from servegate.config import PROFILES_DIR
from servegate.proctree import terminate_tree
from servegate.worker.cli import API_KEY_ENV

pytestmark = [pytest.mark.gate, pytest.mark.timeout(600)]  # the gate (GATE_TIMEOUT_S), then the CLIs

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from e2eutil import tiny_gate  # noqa: E402

KEY = "sk-planted-4f1c9e2a7b"
KEY_VAR = "SECRETS_GATE_WORKER_KEY"  # what worker.api_key_env names
HOSTILE = "cpu-<img src=x onerror=alert(1)>"  # a config string (hardware) that is part of the gate key
HOSTILE_ESCAPED = "cpu-&lt;img src=x onerror=alert(1)&gt;"
GATE_KEY = f"smoke/embedded/{HOSTILE}/tiny-random"
GATE_MAX_WALL_S = 300  # the gate's own deadline (max_wall_s: past it, an inconclusive verdict) ...
GATE_TIMEOUT_S = 360.0  # ... and this test's, should the gate not keep it
# The smoke gate's stages that record and report, on a small load: launch, warm-up, serving,
# validate, record, report (one batch, occupancy and quality add nothing here but minutes), on the tiny model.
CHEAP = ["--set", "one_batch.enabled=false", "--set", "occupancy.enabled=false", *tiny_gate(),
         "--set", "serving.num_prompts=8"]


@dataclass
class ProcessSeen:
    """What the samples saw of one process of the gate's tree (the union over all samples)."""

    cmdline: str
    created: float  # psutil's create_time: with the pid, names the process (pids are reused)
    environ: dict[str, str] = field(default_factory=dict)

    def alive(self, pid: int) -> bool:
        try:
            p = psutil.Process(pid)
            return p.create_time() == self.created and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


@dataclass
class GateRun:
    proc: subprocess.CompletedProcess
    run_dir: Path
    home: Path
    url: str
    password: str
    db: str
    env: dict[str, str]
    processes: dict[int, ProcessSeen]
    unauthenticated_status: int | None  # the live worker's answer to a request without the key

    @property
    def redacted_url(self) -> str:
        return self.url.replace(self.password, "***")

    @property
    def secrets(self) -> dict[str, str]:
        return {"API key": KEY, "database password": self.password, "database URL": self.url}


def _sample(root: psutil.Process, seen: dict[int, ProcessSeen]) -> None:
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            cmdline, environ, created = " ".join(p.cmdline()), p.environ(), p.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        entry = seen.setdefault(p.pid, ProcessSeen(cmdline, created))
        entry.environ.update(environ)


def _probe_worker(seen: dict[int, ProcessSeen]) -> int | None:
    """The status code of an unauthenticated POST /generate to the live embedded worker; None while
    it is not listening yet (or no longer)."""
    for entry in seen.values():
        match = re.search(r"servegate worker .*--port (\d+)", entry.cmdline)
        if match:
            try:
                return requests.post(f"http://127.0.0.1:{match.group(1)}/generate", json={"text": "hi"},
                                     timeout=5).status_code
            except requests.RequestException:
                return None
    return None


@pytest.fixture(scope="module")
def gate_run(pg_cluster, tmp_path_factory: pytest.TempPathFactory) -> GateRun:
    home = tmp_path_factory.mktemp("secrets-gate")
    db = pg_cluster.create_database("secrets_gate")
    url = pg_cluster.url(db)
    env = dict(os.environ)
    env.update(SERVEGATE_DB=url, PREFECT_HOME=str(home / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               HF_HUB_OFFLINE="1", **{KEY_VAR: KEY})
    for name in ("PREFECT_API_URL", "SERVEGATE_DEVICE_SLOT", API_KEY_ENV):
        env.pop(name, None)
    # The smoke profile as a team's config file that names its history database (store.url): the URL
    # then travels in the config itself (config.json, Prefect's flow-run parameters, the history's
    # config snapshot), besides $SERVEGATE_DB, which the history CLIs read.
    config = home / "gate.toml"
    config.write_text((PROFILES_DIR / "smoke.toml").read_text() + f"\n[store]\nurl = {json.dumps(url)}\n")
    cmd = [sys.executable, "-m", "servegate", "run", "--config", str(config), "--output-dir", str(home / "runs"),
           "--json", "--set", f"worker.api_key_env={KEY_VAR}", "--set", f"hardware={HOSTILE}",
           "--set", f"max_wall_s={GATE_MAX_WALL_S}", *CHEAP]
    seen: dict[int, ProcessSeen] = {}
    unauthenticated: int | None = None
    out, err = home / "gate.stdout", home / "gate.stderr"  # files: a pipe not read while sampling could fill
    with out.open("w") as out_file, err.open("w") as err_file:
        gate = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out_file, stderr=err_file)
    try:
        root = psutil.Process(gate.pid)
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while gate.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gate ran past {GATE_TIMEOUT_S} s; its stderr: {err.read_text()[-3000:]}")
            _sample(root, seen)
            if unauthenticated is None:
                unauthenticated = _probe_worker(seen)
            time.sleep(0.2)
    finally:
        terminate_tree(gate.pid, timeout_s=20.0)
        gate.wait(timeout=30)
    stdout, stderr = out.read_text(), err.read_text()
    proc = subprocess.CompletedProcess(cmd, gate.returncode, stdout, stderr)
    assert proc.returncode == 0, f"the gate exited {proc.returncode}:\n{stdout[-3000:]}\n{stderr[-4000:]}"
    verdict = json.loads(stdout)  # --json: the verdict alone on stdout
    return GateRun(proc, Path(verdict["run_dir"]), home, url, pg_cluster.password, db, env, seen, unauthenticated)


CLI_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def history_cli(gate_run: GateRun) -> dict[str, subprocess.CompletedProcess]:
    """What the history and dashboard commands print, run (at once: each is mostly its start-up) on
    the recorded run, as ``servegate ARGS`` processes with the gate's environment; the site goes to
    ``home/site``."""
    commands = [("status",), ("status", "--json"), ("baseline", "show", GATE_KEY),
                ("dashboard", "--out", str(gate_run.home / "site"))]
    started = {" ".join(args): subprocess.Popen([sys.executable, "-m", "servegate", *args], cwd=REPO, env=gate_run.env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for args in commands}
    results = {}
    deadline = time.monotonic() + CLI_TIMEOUT_S
    try:
        for name, cli in started.items():
            stdout, stderr = cli.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[name] = subprocess.CompletedProcess(cli.args, cli.returncode, stdout, stderr)
    finally:
        for cli in started.values():
            terminate_tree(cli.pid, timeout_s=10.0)
            cli.wait(timeout=30)
    failed = {name: (r.returncode, r.stderr[-2000:]) for name, r in results.items() if r.returncode != 0}
    assert not failed, failed
    return results


def _leaks(run: GateRun, where: str, data: bytes | str) -> list[str]:
    blob = data if isinstance(data, bytes) else data.encode()
    return [f"{what} in {where}" for what, secret in run.secrets.items() if secret.encode() in blob]


def test_the_gate_used_the_key_and_the_database(gate_run: GateRun, history_cli, pg_cluster) -> None:
    # The worker demanded the key (so the gate's warm-up and serving requests, all answered, sent it) ...
    assert gate_run.unauthenticated_status == 401, (
        f"the live worker answered {gate_run.unauthenticated_status} to a request without the key (None: it was "
        f"never seen listening while the gate ran)")
    # ... and the run is recorded in the PostgreSQL history database, as `servegate status` reads it.
    status = json.loads(history_cli["status --json"].stdout)
    assert [(row["key"], row["run_id"]) for row in status] == [(GATE_KEY, gate_run.run_dir.name)], status
    assert gate_run.run_dir.name in pg_cluster.dump(gate_run.db)


def test_no_secret_on_any_command_line_nor_in_an_unexpected_environment(gate_run: GateRun) -> None:
    workers = [pid for pid, p in gate_run.processes.items() if "servegate worker" in p.cmdline]
    assert workers, f"no embedded worker was seen among {[p.cmdline[:80] for p in gate_run.processes.values()]}"
    leaks = []
    for pid, seen in gate_run.processes.items():
        leaks += _leaks(gate_run, f"the command line of {pid} ({seen.cmdline[:80]})", seen.cmdline)
        # Where a secret may be: the variables the user set (inherited by the gate's own helpers), and in
        # the worker only its key variable.
        allowed = {API_KEY_ENV} if pid in workers else {"SERVEGATE_DB", KEY_VAR}
        leaks += [leak for name, value in seen.environ.items() if name not in allowed
                  for leak in _leaks(gate_run, f"${name} of {pid} ({seen.cmdline[:80]})", value)]
    assert not leaks, leaks
    assert all(gate_run.processes[pid].environ.get(API_KEY_ENV) == KEY for pid in workers)  # how it got the key
    assert len(gate_run.processes) >= 3, gate_run.processes  # the gate, Prefect's server, the worker: all sampled
    assert not [p.cmdline for pid, p in gate_run.processes.items() if p.alive(pid)]  # none outlived the gate


def test_no_secret_in_the_run_folder_the_output_or_prefect(gate_run: GateRun) -> None:
    files = sorted(p for p in gate_run.run_dir.rglob("*") if p.is_file())
    names = {p.name for p in files}
    assert {"config.json", "worker.log", "gate.log", "report.html", "summary.md", "serving_requests.parquet",
            "verdict.json", "manifest.json"} <= names, sorted(names)
    prefect_files = sorted(p for p in (gate_run.home / "prefect-home").rglob("*") if p.is_file())
    assert any(p.name == "prefect.db" for p in prefect_files), prefect_files
    leaks = [leak for path in files + prefect_files for leak in _leaks(gate_run, str(path), path.read_bytes())]
    leaks += _leaks(gate_run, "the gate's stdout", gate_run.proc.stdout)
    leaks += _leaks(gate_run, "the gate's stderr", gate_run.proc.stderr)
    assert not leaks, leaks
    # The key was configured by name: the snapshot keeps the name, never a value.
    snapshot = json.loads((gate_run.run_dir / "config.json").read_text())
    assert (snapshot["worker"]["api_key"], snapshot["worker"]["api_key_env"]) == (None, KEY_VAR)
    assert snapshot["store"]["url"] == gate_run.redacted_url  # the URL was there, redacted
    # So was it in the flow run's parameters, in Prefect's database (its WAL, or the file once checkpointed)
    assert any(gate_run.redacted_url.encode() in path.read_bytes() for path in prefect_files)


def test_no_secret_in_the_history_cli_output_the_dashboard_or_the_database(gate_run: GateRun, history_cli,
                                                                          pg_cluster) -> None:
    leaks = [leak for name, result in history_cli.items()
             for leak in _leaks(gate_run, f"servegate {name}", result.stdout + result.stderr)]
    site = [path for path in (gate_run.home / "site").rglob("*") if path.is_file()]
    assert site, "the dashboard wrote nothing"
    leaks += [leak for path in site for leak in _leaks(gate_run, str(path), path.read_bytes())]
    dump = pg_cluster.dump(gate_run.db)
    leaks += _leaks(gate_run, "pg_dump of the history database", dump)
    assert not leaks, leaks
    assert gate_run.redacted_url in dump  # the run's config and manifest hold the URL, redacted


class _Tags(HTMLParser):
    """Every start tag with its attributes, and the text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _shows_as_text(where: str, html_text: str) -> None:
    """``html_text`` shows the hostile gate key as text: no tag of it, no event handler anywhere."""
    assert "<img src=x" not in html_text, f"{where}: the config's tag is raw"
    parser = _Tags()
    parser.feed(html_text)
    handlers = [(tag, a) for tag, a in parser.tags if any(name.startswith("on") for name in a)]
    assert not handlers, f"{where}: tags with event handlers: {handlers}"
    assert HOSTILE in "".join(parser.text), f"{where}: the gate key does not read as text"


def test_config_text_reaches_the_report_the_summary_and_the_dashboard_escaped(gate_run: GateRun,
                                                                             history_cli) -> None:
    report = (gate_run.run_dir / "report.html").read_text(encoding="utf-8")
    assert HOSTILE_ESCAPED in report
    _shows_as_text("report.html", report)
    pages = sorted((gate_run.home / "site").rglob("*.html"))
    assert len(pages) >= 2, pages  # the index and the gate key's page
    for page in pages:
        _shows_as_text(str(page), page.read_text(encoding="utf-8"))
    # summary.md as a CI page renders it (CommonMark + GFM tables, raw HTML allowed)
    summary = (gate_run.run_dir / "summary.md").read_text(encoding="utf-8")
    _shows_as_text("summary.md", markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(summary))
