"""Provenance of a gate run: the machine it ran on and the git revision of the working directory.

This module owns ``HostInfo`` and how it is collected (``collect_host_info``: hostname, OS, CPU,
memory, GPUs) and reading git (``git_revision``, ``git_branch``) and running ``nvidia-smi`` (``nvidia_smi``, which
``servegate.hostcheck`` uses for the GPU's driver, clocks and processes). All of it is best effort: a
missing or hung ``git`` / ``nvidia-smi`` yields None or an empty list, never a failed gate run.
``servegate.results`` records what these return in each run's manifest.
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "HostInfo",
    "collect_host_info",
    "git_revision",
    "git_branch",
    "nvidia_smi",
    "source_identity",
]

_GIT_TIMEOUT_S = 5.0
_NVIDIA_SMI_TIMEOUT_S = 10.0


class HostInfo(BaseModel):
    """The machine a gate ran on.

    ``RunManifest.host`` embeds it: an incompatible change bumps ``servegate.results.SCHEMA_VERSION``.
    """

    model_config = ConfigDict(extra="forbid")

    hostname: str = Field(description="socket.gethostname()")
    platform: str = Field(description="platform.platform(), e.g. Linux-6.8-x86_64-with-glibc2.39")
    python: str = Field(description="Python version running the gate")
    cpu_model: str | None = Field(None, description="CPU model name when the OS reports one")
    cpu_count_logical: int | None = Field(None, description="logical CPUs (psutil)")
    cpu_count_physical: int | None = Field(None, description="physical cores (psutil)")
    memory_total_bytes: int | None = Field(None, description="total RAM in bytes (psutil)")
    gpus: list[str] = Field(default_factory=list, description="GPU names with memory, empty on CPU-only hosts")


def _run_git(args: list[str], cwd: Path) -> str | None:
    git = shutil.which("git")
    if git is None:
        return None
    try:
        proc = subprocess.run([git, *args], cwd=cwd, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S,
                              check=False)
    except (subprocess.TimeoutExpired, OSError):
        # Provenance is best effort: a hung or missing git must not stop a gate run.
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout


def git_revision(cwd: Path | None = None) -> tuple[str | None, bool | None]:
    """``(HEAD commit, dirty)`` of the git work tree at ``cwd``; ``(None, None)`` outside a repository."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    head = _run_git(["rev-parse", "HEAD"], cwd)
    if head is None:
        return None, None
    status = _run_git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return head.strip(), (None if status is None else bool(status.strip()))


def git_branch(cwd: Path | None = None) -> str | None:
    """The checked-out branch at ``cwd``; None when HEAD is detached or outside a repository."""
    out = _run_git(["rev-parse", "--abbrev-ref", "HEAD"], Path.cwd() if cwd is None else Path(cwd))
    branch = out.strip() if out else ""
    return branch if branch and branch != "HEAD" else None


def source_identity(root: Path | None = None) -> dict[str, str]:
    """Which servegate code this process runs (or the package folder ``root`` holds): the package's folder
    and a digest of its Python sources (relative path and bytes of every ``.py`` file, sorted), which does
    not depend on where the folder is. Two builds that differ in one line differ here; the embedded worker
    reports it in ``/get_server_info`` so that a paired gate can show, and check, that its candidate runs
    the candidate's code."""
    import hashlib

    root = Path(root).resolve() if root is not None else Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"path": str(root), "digest": digest.hexdigest()[:16]}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpu_names() -> list[str]:
    # Use torch only when the process already imported it: importing torch costs seconds
    # that the gate's overhead budget should not pay just to describe the host.
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                names = []
                for i in range(torch.cuda.device_count()):
                    props = torch.cuda.get_device_properties(i)
                    names.append(f"{props.name}, {props.total_memory // 2**20} MiB")
                return names
        except RuntimeError:
            pass
    out = nvidia_smi(["--query-gpu=name,memory.total", "--format=csv,noheader"])
    return [] if out is None else [line.strip() for line in out.splitlines() if line.strip()]


def nvidia_smi(args: list[str]) -> str | None:
    """``nvidia-smi <args>``'s output; None where there is no nvidia-smi or it fails or hangs (best effort)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        proc = subprocess.run([smi, *args], capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S,
                              check=False)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def collect_host_info() -> HostInfo:
    """Describe this machine: hostname, OS, CPU, memory and GPUs."""
    return HostInfo(
        hostname=socket.gethostname(),
        platform=platform.platform(),
        python=platform.python_version(),
        cpu_model=_cpu_model(),
        cpu_count_logical=psutil.cpu_count(logical=True),
        cpu_count_physical=psutil.cpu_count(logical=False),
        memory_total_bytes=psutil.virtual_memory().total,
        gpus=_gpu_names(),
    )
