"""Helpers shared by the end-to-end tests: each test's processes get their own history database,
Prefect home and (through SERVEGATE_DB) a marker that finds the workers its gates started."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def tiny_gate(decode_delay_ms: int = 20) -> list[str]:
    """``--set`` arguments that run a gate's plumbing on the tiny random-weight model, every forward pass
    delayed by a fixed ``decode_delay_ms`` (the worker's ``--fault-decode-delay-ms``, a sleep): it loads in
    a fraction of the real model's time and its speed hardly depends on what else the machine does, so a
    test of stage order, exit codes, outputs or tear-down can run beside another lane. Quality needs a real
    model: off. The real SmolLM2 stays where the property needs it (docs/testing.md lists those tests)."""
    return ["--set", "worker.model=tiny-random",
            "--set", f'worker.extra_args=["--fault-decode-delay-ms","{decode_delay_ms}"]',
            "--set", "quality.enabled=false"]


def gate_env(tmp_path: Path, *, own_prefect: bool = False) -> dict[str, str]:
    """The environment of a servegate CLI run that belongs to this test only. Its Prefect API is the
    session's server when the test is marked ``gate`` (conftest puts ``PREFECT_API_URL`` in the test's
    environment); ``own_prefect``: none, so the gate starts Prefect's temporary server itself, as a
    user's first run does (for the tests whose subject is that start-up or its tear-down)."""
    env = dict(os.environ)
    env["SERVEGATE_DB"] = str(tmp_path / "history.db")  # the test's history; also marks its processes
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    if own_prefect:
        env.pop("PREFECT_API_URL", None)
    env.pop("SERVEGATE_DEVICE_SLOT", None)  # a test's gates never take a device machine's slot
    return env


def stdout_json(proc: subprocess.CompletedProcess) -> dict:
    """The JSON document a ``--json`` command printed (after any log lines)."""
    start = proc.stdout.find("{")
    assert start >= 0, f"no JSON on stdout.\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout[start:])


def marked_processes(tmp_path: Path, *words: str) -> list[psutil.Process]:
    """Live processes (not zombies) started by this test's gates — they inherit its SERVEGATE_DB —
    whose command line holds every one of ``words`` (none: all of them)."""
    marker = str(tmp_path / "history.db")
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if p.pid == os.getpid() or not all(w in cmd for w in words):
            continue
        try:
            if p.environ().get("SERVEGATE_DB") == marker and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def survivors(tmp_path: Path, within_s: float, *words: str) -> list[str]:
    """The processes :func:`marked_processes` finds (``words`` as there) still running ``within_s`` seconds
    from now, or as soon as none is (the guardian gets that long), as ``"pid command line"``."""
    deadline = time.monotonic() + within_s
    while True:
        alive = marked_processes(tmp_path, *words)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = []
    for p in alive:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
    return out


def worker_processes(tmp_path: Path) -> list[psutil.Process]:
    """Live embedded workers started by this test's gates."""
    return marked_processes(tmp_path, "servegate", "worker")
