"""The host a gate measures on: its environment record and the checks made before the first measurement.

A latency gate on a shared machine measures its neighbours too: a process holding a core (a
build, another test, a stuck job) or a compute process on the GPU moves the figures by more than
the regressions the gate looks for. So before measuring, the gate

- **records** the environment (:class:`HostRecord`, written as ``host.json`` and in the run's
  manifest, hence its history row): the machine (``servegate.provenance.HostInfo``), the load
  average, each CPU's frequency governor and current/maximum frequency where ``/sys`` shows them,
  the thread settings (``OMP_NUM_THREADS`` and friends) of the gate's and each worker's environment,
  torch's thread count, and the GPUs' driver, clocks and compute processes when ``nvidia-smi`` exists;
- **checks** (``[host]`` config, :class:`HostCheck`): other processes' CPU use over
  ``host.sample_s`` (psutil) must stay within ``host.max_other_cpu_cores``; and no compute
  process on the GPU may be someone else's. A failed check makes the run inconclusive, naming
  the processes (pid, name, CPU share) — never a measurement, never a regression.

  What counts as *other*: every process except the gate's own tree, its ancestors (pytest, a CI
  runner, a Prefect worker) and its **host group** — the processes whose environment carries the
  same ``SERVEGATE_HOST_GROUP`` value as the gate's (:data:`HOST_GROUP_ENV`), and their descendants
  (a process that writes its title over its environment — a PostgreSQL backend — stays in). A job that runs
  processes beside its gate on purpose names them so: the test suite's parallel lanes do
  (``tests/conftest.py``), and its tests that assert a measured effect run alone, after them. The
  group's CPU is recorded (``group_cpu_cores``), not counted; a process outside the group — a
  build, another user's job — is counted as before, whatever started it.

:func:`environment_differences` says what differs, in what moves the figures (CPU model, thread
settings, governor, GPU driver), between a run's record and a baseline run's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from pydantic import BaseModel, ConfigDict, Field

from servegate.errors import InfraError
from servegate.provenance import HostInfo, collect_host_info, nvidia_smi

if TYPE_CHECKING:  # pragma: no cover
    from servegate.config import GateConfig, HostConfig, WorkerSpec

__all__ = ["HOST_GROUP_ENV", "THREAD_VARIABLES", "CpuFrequency", "CpuUser", "GpuState", "GpuProcess", "HostCheck", "HostRecord",
           "record_host", "thread_settings", "environment_differences", "GPU_QUERY", "GPU_PROCESS_QUERY"]

HOST_GROUP_ENV = "SERVEGATE_HOST_GROUP"
"""The environment variable that names a gate's host group: processes carrying the gate's own value are
the same job's, run beside it on purpose, and are not counted against ``host.max_other_cpu_cores``."""

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCH_NUM_THREADS")
"""Thread settings recorded by name; every ``VLLM_CPU_*`` variable is recorded too."""

GPU_QUERY = ["--query-gpu=index,uuid,name,driver_version,clocks.current.sm,clocks.max.sm,clocks.current.memory,"
             "clocks.max.memory", "--format=csv,noheader,nounits"]
"""Canonical field names (``nvidia-smi --help-query-gpu``): one unknown field fails the whole query."""
GPU_PROCESS_QUERY = ["--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits"]

_SHOWN_CPU_USERS = 0.01
"""Processes below a hundredth of a core are summed, not listed."""
_CPU_ROOT = Path("/sys/devices/system/cpu")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CpuFrequency(_Record):
    cpu: int = Field(description="logical CPU number")
    governor: str | None = Field(None, description="cpufreq scaling governor (performance, powersave, ...)")
    cur_khz: int | None = Field(None, description="current frequency, kHz (scaling_cur_freq)")
    max_khz: int | None = Field(None, description="maximum frequency, kHz (cpuinfo_max_freq)")


class CpuUser(_Record):
    pid: int
    name: str = Field(description="process name (never its command line: that may hold a secret)")
    username: str | None = None
    cpu_cores: float = Field(description="CPU held during the sample, in cores (1.0 = one core busy)")


class GpuState(_Record):
    index: int
    uuid: str | None = None
    name: str
    driver_version: str | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    mem_clock_mhz: float | None = None
    mem_clock_max_mhz: float | None = None


class GpuProcess(_Record):
    pid: int
    name: str
    used_memory_mib: float | None = None
    gpu_uuid: str | None = None
    ours: bool = Field(description="the gate's own process tree")


class HostCheck(_Record):
    """What the checks found; ``problems`` empty means the host may be measured on."""

    sample_s: float = Field(description="how long other processes' CPU use was sampled")
    max_other_cpu_cores: float = Field(description="host.max_other_cpu_cores")
    other_cpu_cores: float = Field(description=(
        "CPU held by processes outside the gate's tree, its ancestors and its host group, cores"))
    cpu_users: list[CpuUser] = Field(default_factory=list, description="those processes, busiest first")
    host_group: str | None = Field(None, description=(
        "the gate's SERVEGATE_HOST_GROUP: processes carrying the same value are not counted; None when unset"))
    group_cpu_cores: float = Field(0.0, description=(
        "CPU held during the sample by the host group's processes outside the gate's tree, cores (not counted)"))
    gpus_checked: list[int] | None = Field(None, description=(
        "indexes of the GPUs the gate's workers see (CUDA_VISIBLE_DEVICES), whose processes are checked; None: all"))
    foreign_gpu_processes: list[GpuProcess] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list, description="why the host fails the checks, one line each")

    @property
    def passed(self) -> bool:
        return not self.problems


class HostRecord(_Record):
    """The environment a gate run measured in (``host.json``; ``RunManifest.environment``)."""

    machine: HostInfo
    load_avg: tuple[float, float, float] | None = Field(None, description="1, 5 and 15 minute load averages")
    cpus: list[CpuFrequency] = Field(default_factory=list, description="per CPU, where /sys shows cpufreq")
    threads: dict[str, dict[str, str]] = Field(default_factory=dict, description=(
        "thread settings per environment: gate, worker, baseline (only the variables that are set)"))
    torch_threads: int | None = Field(None, description="torch.get_num_threads() when the gate imported torch")
    gpus: list[GpuState] = Field(default_factory=list, description="nvidia-smi, where present")
    gpu_processes: list[GpuProcess] = Field(default_factory=list, description="compute processes on the GPUs")
    check: HostCheck | None = Field(None, description="the checks' findings; None when host.enabled is false")

    def raise_for_problems(self) -> None:
        """InfraError (the run is inconclusive) naming every problem the checks found."""
        if self.check is not None and self.check.problems:
            raise InfraError("host check failed: " + "; ".join(self.check.problems))


def thread_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The thread variables ``environ`` sets."""
    return {k: environ[k] for k in sorted(environ) if k in THREAD_VARIABLES or k.startswith("VLLM_CPU_")}


def _worker_environ(spec: "WorkerSpec") -> dict[str, str]:
    from servegate.engines import get_engine
    from servegate.errors import ConfigError
    from servegate.launch import worker_base_environ  # here: the run folder's import need not pull in requests

    try:
        added = get_engine(spec.engine).launch_env(spec)
    except ConfigError:  # a snapshot's redacted secret: the thread settings are still in spec.env
        added = dict(spec.env)
    return {**worker_base_environ(spec), **added}


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cpu_frequencies() -> list[CpuFrequency]:
    found = []
    for cpu in range(os.cpu_count() or 0):
        base = _CPU_ROOT / f"cpu{cpu}" / "cpufreq"
        if not base.is_dir():
            continue
        try:
            governor = (base / "scaling_governor").read_text().strip() or None
        except OSError:
            governor = None
        found.append(CpuFrequency(cpu=cpu, governor=governor, cur_khz=_read_int(base / "scaling_cur_freq"),
                                  max_khz=_read_int(base / "cpuinfo_max_freq")))
    return found


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _smi_rows(query: list[str], columns: int) -> list[list[str]]:
    """The rows of an ``nvidia-smi --query-*`` CSV answer (none without nvidia-smi): stripped cells, only
    rows with ``columns`` cells whose first is a number (an index or a pid)."""
    rows = ([c.strip() for c in line.split(",")] for line in (nvidia_smi(query) or "").splitlines())
    return [cells for cells in rows if len(cells) == columns and cells[0].isdigit()]


def _gpus() -> list[GpuState]:
    return [GpuState(index=int(c[0]), uuid=c[1] or None, name=c[2], driver_version=c[3] or None,
                     sm_clock_mhz=_number(c[4]), sm_clock_max_mhz=_number(c[5]),
                     mem_clock_mhz=_number(c[6]), mem_clock_max_mhz=_number(c[7]))
            for c in _smi_rows(GPU_QUERY, 8)]


def _gpu_processes(ours: set[int]) -> list[GpuProcess]:
    found = []
    for cells in _smi_rows(GPU_PROCESS_QUERY, 4):
        pid = int(cells[0])
        found.append(GpuProcess(pid=pid, name=Path(cells[1]).name or cells[1], used_memory_mib=_number(cells[2]),
                                gpu_uuid=cells[3] or None, ours=pid in ours))
    return found


def _own_tree() -> set[int]:
    """The gate's process, its children (a Prefect server, a worker) and its ancestors (pytest, a CI
    runner, a Prefect worker): their CPU is the gate's business, not a neighbour's."""
    me = psutil.Process()
    ours = {me.pid}
    for related in (me.children(recursive=True), me.parents()):
        ours.update(p.pid for p in related)
    return ours


class _Group:
    """Which processes belong to host group ``group``: those whose environment names it, and their
    descendants. Descent matters because a process may overwrite the memory that ``/proc/PID/environ``
    shows with its title — PostgreSQL's backends and every ``setproctitle`` user (vLLM's engine core)
    do — while its parent, started by the group, still shows the group's value. So does a zombie's parent:
    a test's child that ended during the sample is a zombie until reaped, with no environment left to read
    (a CI lane once counted one, "pid N python (0.55 core)", and refused a gate). A process we cannot see
    into, with no ancestor in the group, is counted; so is every process when ``group`` is None."""

    def __init__(self, group: str | None) -> None:
        self.group = group
        self._known: dict[int, bool] = {}

    def __contains__(self, proc: psutil.Process) -> bool:
        if not self.group:
            return False
        chain: list[int] = []
        current: psutil.Process | None = proc
        member = False
        while current is not None and current.pid > 1:
            if current.pid in self._known:
                member = self._known[current.pid]
                break
            chain.append(current.pid)
            try:
                environ: Mapping[str, str] | None = current.environ()
            except (psutil.ZombieProcess, psutil.AccessDenied):
                # A zombie (it exited during the sample, its parent has not reaped it yet) has no environment
                # left, and another user's is closed to us; its parent still says whose it is.
                environ = None
            except (psutil.NoSuchProcess, OSError):
                break
            if environ is not None and environ.get(HOST_GROUP_ENV) == self.group:
                member = True
                break
            try:
                current = current.parent()
            except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
                current = None
        for pid in chain:
            self._known[pid] = member
        return member


def _other_cpu_users(sample_s: float, group: str | None = None) -> tuple[list[CpuUser], float]:
    """Every process outside the gate's tree, its ancestors and its host ``group`` that held at least a
    hundredth of a core during ``sample_s``, busiest first (processes that start during the sample are not
    seen); and the CPU, in cores, that the group's processes held (recorded, not counted)."""
    procs: list[psutil.Process] = []
    for proc in psutil.process_iter(["name", "username"]):
        try:
            proc.cpu_percent(None)  # starts the process's sample
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        procs.append(proc)
    before = _own_tree()
    time.sleep(sample_s)
    ours = before | _own_tree()
    users, group_cores, members = [], 0.0, _Group(group)
    for proc in procs:
        if proc.pid in ours or proc.pid == 0:
            continue
        try:
            cores = proc.cpu_percent(None) / 100.0
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if cores < _SHOWN_CPU_USERS:
            continue
        if proc in members:
            group_cores += cores
            continue
        users.append(CpuUser(pid=proc.pid, name=proc.info.get("name") or "?", username=proc.info.get("username"),
                             cpu_cores=round(cores, 3)))
    return sorted(users, key=lambda u: -u.cpu_cores), round(group_cores, 3)


def _gate_gpus(gpus: list[GpuState], environs: list[Mapping[str, str]]) -> list[int] | None:
    """The GPUs the gate's workers see: those their ``CUDA_VISIBLE_DEVICES`` name (an index or a UUID
    prefix), None (all) when a worker's environment leaves it unset. On a machine with a gate per GPU,
    the other GPUs' processes are other gates', not neighbours of this one's measurement."""
    seen: set[int] = set()
    for environ in environs:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return None
        for item in (x.strip() for x in visible.split(",") if x.strip()):
            seen.update(g.index for g in gpus if item == str(g.index) or (g.uuid and g.uuid.startswith(item)))
    return sorted(seen)


def _check(cfg: "HostConfig", gpus: list[GpuState], gpu_processes: list[GpuProcess],
           checked_gpus: list[int] | None) -> HostCheck:
    group = os.environ.get(HOST_GROUP_ENV) or None
    users, group_cores = _other_cpu_users(cfg.sample_s, group)
    held = round(sum(u.cpu_cores for u in users), 3)
    problems = []
    if held > cfg.max_other_cpu_cores:
        named = ", ".join(f"pid {u.pid} {u.name} ({u.cpu_cores:.2f} core)" for u in users[:8])
        more = f" and {len(users) - 8} more" if len(users) > 8 else ""
        problems.append(f"other processes held {held:.2f} CPU cores over {cfg.sample_s:g} s, more than "
                        f"host.max_other_cpu_cores = {cfg.max_other_cpu_cores:g}: {named}{more}; run the gate when "
                        f"they are done or on a quiet machine (or raise host.max_other_cpu_cores, knowing that "
                        f"they share the CPU with what is measured)")
    watched = None if checked_gpus is None else {g.uuid for g in gpus if g.index in checked_gpus}
    foreign = [p for p in gpu_processes if not p.ours and (watched is None or p.gpu_uuid in watched)]
    if foreign and not cfg.foreign_gpu_processes:
        named = ", ".join(f"pid {p.pid} {p.name} ({p.used_memory_mib:g} MiB)" if p.used_memory_mib is not None
                          else f"pid {p.pid} {p.name}" for p in foreign)
        problems.append(f"compute processes that are not the gate's run on the GPU: {named}; stop them, or set "
                        f"host.foreign_gpu_processes = true to measure beside them")
    return HostCheck(sample_s=cfg.sample_s, max_other_cpu_cores=cfg.max_other_cpu_cores, other_cpu_cores=held,
                     cpu_users=users, host_group=group, group_cpu_cores=group_cores, gpus_checked=checked_gpus, foreign_gpu_processes=foreign, problems=problems)


def record_host(config: "GateConfig", machine: HostInfo | None = None) -> HostRecord:
    """The environment record of this machine for ``config``'s gate, with the checks' findings when
    ``host.enabled`` (their sample takes ``host.sample_s``). ``machine``: the run manifest's
    description of the machine, when there is one (collected once per run); else collected here.
    Never raises for what it finds: :meth:`HostRecord.raise_for_problems` does."""
    environs = {"worker": _worker_environ(config.worker)}
    if config.baseline is not None:
        environs["baseline"] = _worker_environ(config.baseline)
    threads = {"gate": thread_settings(os.environ), **{k: thread_settings(v) for k, v in environs.items()}}
    torch = sys.modules.get("torch")
    gpu_processes = _gpu_processes(_own_tree())
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    gpus = _gpus()
    check = None
    if config.host.enabled:
        check = _check(config.host, gpus, gpu_processes, _gate_gpus(gpus, list(environs.values())))
    return HostRecord(
        machine=machine or collect_host_info(), load_avg=None if load is None else tuple(round(x, 2) for x in load),
        cpus=_cpu_frequencies(), threads=threads,
        torch_threads=torch.get_num_threads() if torch is not None else None,
        gpus=gpus, gpu_processes=gpu_processes, check=check)


def _what_matters(record: Mapping[str, Any]) -> dict[str, Any]:
    machine = record.get("machine") or {}
    governors = sorted({c.get("governor") for c in record.get("cpus") or [] if c.get("governor")})
    drivers = sorted({g.get("driver_version") for g in record.get("gpus") or [] if g.get("driver_version")})
    return {"CPU model": machine.get("cpu_model"), "logical CPUs": machine.get("cpu_count_logical"),
            "thread settings": record.get("threads") or {}, "CPU governor": governors or None,
            "GPU driver": drivers or None, "GPUs": [g.get("name") for g in record.get("gpus") or []] or None}


def environment_differences(current: Mapping[str, Any] | HostRecord | None,
                            baselines: Sequence[tuple[str, Mapping[str, Any] | None]]) -> list[str]:
    """One line per thing that moves the figures and differs between ``current``'s environment record
    and the records of the baseline runs (``[(run_id, host.json document or None)]``); a run without
    a record (recorded before them) is left out, and so is everything when ``current`` has none."""
    if current is None:
        return []
    if isinstance(current, HostRecord):
        current = current.model_dump(mode="json")
    now = _what_matters(current)
    differing: dict[tuple[str, str], list[str]] = {}
    for run_id, record in baselines:
        if record is None:
            continue
        then = _what_matters(record)
        for what in now:
            if now[what] != then[what]:
                differing.setdefault((what, repr(then[what])), []).append(run_id)
    return [f"{what} differs from the baseline's ({', '.join(runs)}): {then} there, {now[what]!r} here"
            for (what, then), runs in differing.items()]
