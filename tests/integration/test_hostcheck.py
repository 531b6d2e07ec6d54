"""Host checks and the environment record (issue 19): a real gate run beside a real busy process is
inconclusive with the host-check reason; a run on a quiet host keeps its record in the run folder and
in the history; nvidia-smi (which cannot run here) is a fake executable that records its exact command."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from servegate.config import load_config
from servegate.history import Store
from servegate.hostcheck import GPU_PROCESS_QUERY, GPU_QUERY, HOST_GROUP_ENV, environment_differences, record_host

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from e2eutil import gate_env, stdout_json, worker_processes  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# Every measurement stage off: the host stage runs, nothing is launched, the run is recorded.
NOTHING_MEASURED = ["--set", "one_batch.enabled=false", "--set", "serving.enabled=false",
                    "--set", "occupancy.enabled=false", "--set", "quality.enabled=false"]


def _outside_the_group() -> dict[str, str]:
    """This test process's environment without the host group the test suite sets for its lanes."""
    return {name: value for name, value in os.environ.items() if name != HOST_GROUP_ENV}


def _gate(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "servegate", "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"),
           "--json", *args]
    return subprocess.run(cmd, cwd=REPO, env={**gate_env(tmp_path), **(env or {})}, capture_output=True, text=True,
                          timeout=240)


_BUSY = "while True: pass"
# A parent that stays (in the environment it was given) and a busy child whose environment lacks the group.
_PARENT_OF_BUSY = ("import os, subprocess, sys; env = {k: v for k, v in os.environ.items() if k != %r}; "
                   "subprocess.Popen([sys.executable, '-c', %r], env=env).wait()" % (HOST_GROUP_ENV, _BUSY))


def _orphan(env: dict[str, str], code: str) -> psutil.Process:
    """A process running ``code`` that is not this process's descendant (its launcher exits at once): a
    gate checked from this process would otherwise count it as its own tree, as it counts its workers."""
    launcher = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                               f"[sys.executable, '-c', {code!r}], start_new_session=True, "
                               "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                              env=env, capture_output=True, text=True, timeout=30, check=True)
    return psutil.Process(int(launcher.stdout))


@pytest.mark.gate
@pytest.mark.exclusive
def test_a_core_kept_busy_by_another_process_makes_the_gate_inconclusive(tmp_path: Path):
    """A busy-loop neighbour holds a whole core (twice the default allowance of half a core): the gate
    measures nothing, exits 2, and names the neighbour. The stages are the smoke gate's, shortened:
    a check that did not fire would launch the worker and pass. The neighbour is outside the test
    run's host group and not this test's descendant (as a stranger's process is), the gate inside it."""
    busy = _orphan(_outside_the_group(), _BUSY)
    try:
        time.sleep(0.5)
        proc = _gate(tmp_path, "--set", "one_batch.enabled=false", "--set", "occupancy.enabled=false",
                     "--set", "quality.enabled=false", "--set", "serving.num_prompts=4")
    finally:
        busy.kill()
        psutil.wait_procs([busy], timeout=10)
    verdict = stdout_json(proc)
    assert proc.returncode == 2, f"{verdict}\n{proc.stderr[-3000:]}"
    assert verdict["status"] == "inconclusive" and verdict["breaches"] == []
    host_errors = [e for e in verdict["infra_errors"] if e.startswith("host: InfraError: host check failed: other "
                                                                       "processes held")]
    assert len(host_errors) == 1 and "\n" not in host_errors[0], verdict["infra_errors"]
    run_dir = Path(verdict["run_dir"])
    record = json.loads((run_dir / "host.json").read_text())
    neighbour = [u for u in record["check"]["cpu_users"] if u["pid"] == busy.pid]
    # On a loaded 2-core machine the neighbour shares its core; alone it holds ~1.0.
    assert neighbour and neighbour[0]["cpu_cores"] >= 0.3, record["check"]
    if record["check"]["cpu_users"].index(neighbour[0]) < 8:  # the reason names the busiest eight
        assert f"pid {busy.pid} python" in host_errors[0], host_errors[0]
    stages = json.loads((run_dir / "stages.json").read_text())
    assert stages["host"]["status"] == "failed"
    assert all(stages[s]["status"] == "skipped" for s in ("launch", "warmup", "serving")), stages
    assert not (run_dir / "worker.log").exists() and not list(run_dir.glob("serving_*"))
    assert not worker_processes(tmp_path)
    with Store(str(tmp_path / "history.db")) as store:
        row = store.get_run(run_dir.name)
    assert row.status == "inconclusive" and row.manifest["environment"] == record


@pytest.mark.exclusive
def test_the_host_group_is_not_counted_and_a_process_outside_it_is(monkeypatch: pytest.MonkeyPatch):
    """Three busy neighbours outside the gate's tree: one carrying the gate's SERVEGATE_HOST_GROUP (a lane of
    the same test run), one whose environment lacks it but whose parent carries it (a PostgreSQL backend
    writes its title over the environment /proc shows), and one without it (a stranger): the check names
    and counts only the stranger, and records the group's CPU beside it. Without a group of its own the
    gate counts all three."""
    monkeypatch.setenv(HOST_GROUP_ENV, "servegate-test-group")
    friend = _orphan({**os.environ}, _BUSY)
    parent = _orphan({**os.environ}, _PARENT_OF_BUSY)
    stranger = _orphan(_outside_the_group(), _BUSY)
    try:
        deadline = time.monotonic() + 20
        while not parent.children() and time.monotonic() < deadline:
            time.sleep(0.1)
        [child] = parent.children()
        assert HOST_GROUP_ENV not in child.environ()
        time.sleep(0.5)
        config = load_config(profile="smoke", overrides=["host.sample_s=1.5", "host.max_other_cpu_cores=0.1"])
        check = record_host(config).check
        monkeypatch.delenv(HOST_GROUP_ENV)
        ungrouped = record_host(config).check
    finally:
        procs = [friend, stranger, parent, *parent.children()]
        for proc in procs:
            proc.kill()
        psutil.wait_procs(procs, timeout=10)
    assert check is not None and ungrouped is not None
    listed = {u.pid: u.cpu_cores for u in check.cpu_users}
    assert friend.pid not in listed and child.pid not in listed and listed.get(stranger.pid, 0) >= 0.2, check
    assert check.host_group == "servegate-test-group" and check.group_cpu_cores >= 0.4, check
    assert check.other_cpu_cores >= listed[stranger.pid] and check.problems, check  # 0.1 core allowed: refused
    assert f"pid {stranger.pid} python" in check.problems[0] and f"pid {friend.pid} " not in check.problems[0]
    counted = {u.pid for u in ungrouped.cpu_users}
    assert {friend.pid, child.pid, stranger.pid} <= counted and ungrouped.host_group is None, ungrouped


# A parent that leaves its child (whose environment lacks the group) unreaped: a zombie once it ends.
_PARENT_OF_ZOMBIE = ("import os, subprocess, sys, time; env = {k: v for k, v in os.environ.items() if k != %r}; "
                     "subprocess.Popen([sys.executable, '-c', 'pass'], env=env); time.sleep(60)" % HOST_GROUP_ENV)


def test_a_zombie_child_of_the_group_is_the_groups():
    """A child of a group member that ended during the host check's sample is a zombie until its parent
    reaps it: its environment is gone from /proc, yet it is the group's, by its parent (a CI lane once
    counted such a child, 0.55 core, and refused the other lane's gate). A zombie whose parent is outside the
    group is still counted."""
    from servegate.hostcheck import _Group

    friend = _orphan({**_outside_the_group(), HOST_GROUP_ENV: "servegate-test-group"}, _PARENT_OF_ZOMBIE)
    stranger = _orphan(_outside_the_group(), _PARENT_OF_ZOMBIE)
    try:
        deadline = time.monotonic() + 20
        zombies: list[psutil.Process] = []
        while time.monotonic() < deadline:
            zombies = [c for p in (friend, stranger) for c in p.children() if c.status() == psutil.STATUS_ZOMBIE]
            if len(zombies) == 2:
                break
            time.sleep(0.05)
        assert len(zombies) == 2, zombies
        ours, theirs = zombies
        assert ours.ppid() == friend.pid and theirs.ppid() == stranger.pid
        with pytest.raises(psutil.ZombieProcess):
            ours.environ()
        group = _Group("servegate-test-group")
        assert ours in group and theirs not in group
    finally:
        for proc in (friend, stranger):
            proc.kill()
        psutil.wait_procs([friend, stranger], timeout=10)


@pytest.mark.gate
@pytest.mark.exclusive
def test_a_quiet_host_is_recorded_in_the_run_folder_and_the_history(tmp_path: Path):
    """The allowances are raised past what the machine could hold (and GPU neighbours allowed), so that
    the record is tested on a machine that other tests keep busy; the thread settings of the gate and
    the worker are recorded."""
    cores = os.cpu_count() or 1
    proc = _gate(tmp_path, *NOTHING_MEASURED, "--set", f"host.max_other_cpu_cores={4 * cores}",
                 "--set", "host.foreign_gpu_processes=true", "--set", "host.sample_s=0.5",
                 "--set", 'worker.env.OMP_NUM_THREADS="1"',
                 env={"OMP_NUM_THREADS": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    verdict = stdout_json(proc)
    assert not any(e.startswith("host") for e in verdict["infra_errors"]), verdict
    run_dir = Path(verdict["run_dir"])
    stages = json.loads((run_dir / "stages.json").read_text())
    assert stages["host"]["status"] == "ok", stages["host"]
    record = json.loads((run_dir / "host.json").read_text())
    assert record["check"]["problems"] == [] and record["check"]["sample_s"] == 0.5
    assert record["threads"]["gate"] == {"OMP_NUM_THREADS": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert record["threads"]["worker"] == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert record["machine"]["cpu_count_logical"] == cores and len(record["load_avg"]) == 3
    # pytest, the gate's ancestor, is never counted as a neighbour
    assert os.getpid() not in [u["pid"] for u in record["check"]["cpu_users"]]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["environment"] == record
    with Store(str(tmp_path / "history.db")) as store:
        assert store.get_run(run_dir.name).manifest["environment"] == record


FAKE_SMI = """#!{python}
import json, sys
with open({log!r}, "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if args[0] == "--query-gpu=name,memory.total":
    print("NVIDIA H200, 143771 MiB")
    print("NVIDIA H200, 143771 MiB")
elif args[0].startswith("--query-gpu="):
    print("0, GPU-aaaa-0000, NVIDIA H200, 570.86.15, 1980, 1980, 3201, 3201")
    print("1, GPU-bbbb-1111, NVIDIA H200, 570.86.15, 345, 1980, 3201, 3201")
elif args[0].startswith("--query-compute-apps="):
    print("{ours}, /usr/bin/python3, 1024, GPU-aaaa-0000")
    print("4242, /opt/other/bin/trainer, 70000, GPU-aaaa-0000")
    print("4343, [Not Found], [N/A], GPU-aaaa-0000")
    print("5151, /opt/gate-gpu1/bin/python, 60000, GPU-bbbb-1111")
"""


@pytest.mark.gate
def test_nvidia_smi_is_queried_with_the_exact_commands_and_foreign_gpu_processes_fail(tmp_path: Path,
                                                                                        monkeypatch):
    log = tmp_path / "smi.log"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI.format(python=sys.executable, log=str(log), ours=os.getpid()))
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    overrides = ["host.sample_s=0.2", "host.max_other_cpu_cores=1000"]
    config = load_config(profile="smoke", overrides=overrides)

    record = record_host(config)

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(calls) == sorted([GPU_PROCESS_QUERY, GPU_QUERY, ["--query-gpu=name,memory.total",
                                                                   "--format=csv,noheader"]])
    assert GPU_QUERY == ["--query-gpu=index,uuid,name,driver_version,clocks.current.sm,clocks.max.sm,"
                         "clocks.current.memory,clocks.max.memory", "--format=csv,noheader,nounits"]
    assert GPU_PROCESS_QUERY == ["--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
                                 "--format=csv,noheader,nounits"]
    assert record.machine.gpus == ["NVIDIA H200, 143771 MiB"] * 2
    gpu = record.gpus[1]
    assert (gpu.uuid, gpu.driver_version, gpu.sm_clock_mhz, gpu.sm_clock_max_mhz) == ("GPU-bbbb-1111", "570.86.15",
                                                                                      345.0, 1980.0)
    assert [(p.pid, p.ours) for p in record.gpu_processes] == [(os.getpid(), True), (4242, False), (4343, False),
                                                                (5151, False)]
    [problem] = record.check.problems
    assert record.check.gpus_checked is None  # CUDA_VISIBLE_DEVICES unset: the worker sees every GPU
    assert problem.startswith("compute processes that are not the gate's run on the GPU: pid 4242 trainer "
                              "(70000 MiB), pid 4343 [Not Found], pid 5151 python (60000 MiB);"), problem
    # A gate on GPU 1 of the machine (by index; by UUID prefix for GPU 0): the other GPU's processes are
    # another gate's business.
    on_gpu1 = record_host(load_config(profile="smoke", overrides=[*overrides, 'worker.env.CUDA_VISIBLE_DEVICES="1"']))
    assert on_gpu1.check.gpus_checked == [1] and [p.pid for p in on_gpu1.check.foreign_gpu_processes] == [5151]
    on_gpu0 = record_host(load_config(profile="smoke", overrides=[*overrides,
                                                                  'worker.env.CUDA_VISIBLE_DEVICES="GPU-aaaa"']))
    assert on_gpu0.check.gpus_checked == [0]
    assert [p.pid for p in on_gpu0.check.foreign_gpu_processes] == [4242, 4343]
    with pytest.raises(Exception, match="host check failed: compute processes"):
        record.raise_for_problems()

    allowed = record_host(config.model_copy(update={"host": config.host.model_copy(
        update={"foreign_gpu_processes": True})}))
    assert allowed.check.problems == [] and len(allowed.check.foreign_gpu_processes) == 3

    # A baseline run on another driver with other thread settings: the comparison says so.
    baseline = record.model_dump(mode="json")
    for gpu in baseline["gpus"]:
        gpu["driver_version"] = "550.54.14"
    baseline["threads"]["worker"] = {"OMP_NUM_THREADS": "8"}
    same = record.model_dump(mode="json")
    notes = environment_differences(record, [("r1", baseline), ("r2", same), ("r3", baseline), ("r4", None)])
    assert [n.split(" differs")[0] for n in notes] == ["thread settings", "GPU driver"], notes
    assert notes[1] == "GPU driver differs from the baseline's (r1, r3): ['550.54.14'] there, ['570.86.15'] here"
    assert environment_differences(record, [("r2", same), ("r4", None)]) == []
    assert environment_differences(None, [("r1", baseline)]) == []


def test_a_baseline_measured_in_another_environment_is_named_by_the_comparison_and_the_reports(tmp_path: Path):
    """Recorded baseline runs (a real SQLite history): one with other worker thread settings, one in
    the same environment, one from before the records; the comparison, summary.md and report.html
    say what differs, and nothing fails because of it."""
    from test_store import KEY, T0, run_inputs, synthetic_tables

    from servegate.compare import compare_run
    from servegate.report import build_report, write_markdown_summary

    here = record_host(load_config(profile="smoke", overrides=["host.enabled=false"])).model_dump(mode="json")
    other = json.loads(json.dumps(here))
    other["threads"]["worker"] = {"OMP_NUM_THREADS": "8"}
    with Store(str(tmp_path / "history.db")) as store:
        for i, environment in enumerate([other, here, None, other]):
            inputs = run_inputs(f"night-{i}", started_at=T0 + timedelta(days=i), seed=i)
            if environment is not None:
                inputs["manifest"]["environment"] = environment
            store.record_run(**inputs)
        current = synthetic_tables(99)
        comparison = compare_run(store, current, KEY, environment=here)
        [note] = comparison.attrs["environment"]
        assert note == ("thread settings differs from the baseline's (night-3, night-0): "
                        f"{other['threads']!r} there, {here['threads']!r} here"), note
        assert "regression" not in set(comparison["decision"])
        summary = write_markdown_summary({"status": "pass"}, [], comparison)
        assert "\nEnvironment: thread settings differs from the baseline's (night-3, night-0)" in summary

        inputs = run_inputs("night-4", started_at=T0 + timedelta(days=4), seed=99,
                            tables={**current, "comparison": comparison})
        inputs["manifest"]["environment"] = here
        store.record_run(**inputs)
        report = build_report(store, "night-4")
        assert "<dt>environment differs</dt><dd>thread settings differs from the baseline&#x27;s (night-3, night-0)" \
            in report
        assert compare_run(store, "night-4").attrs["environment"] == [note]


@pytest.mark.parametrize("bad,says", [("-0.5", "greater than or equal to 0"), ("nan", "finite number"),
                                      ("true", "must be a number")])
def test_host_allowance_must_be_a_finite_number_of_cores(bad: str, says: str):
    from servegate.errors import ConfigError

    with pytest.raises(ConfigError, match=f"host.max_other_cpu_cores = .*{says}"):
        load_config(profile="smoke", overrides=[f"host.max_other_cpu_cores={bad}"])
