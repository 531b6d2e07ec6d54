"""Fixtures for the worker tests: real worker processes, one per configuration per module, forked from
one fork server per lane (servegate/worker/forkserver.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from workerutil import TINY_ARGS, WorkerProcess

from servegate.worker.forkserver import ForkServer


@pytest.fixture(scope="session", autouse=True)
def _tiny_model_cached() -> None:
    """Build the tiny model once (from the cached SmolLM2 tokenizer) before any worker starts."""
    from servegate.models import ensure_model

    ensure_model("tiny-random")


@pytest.fixture(scope="session")
def worker_fork_server(_tiny_model_cached: None) -> Iterator[ForkServer]:
    """The lane's fork server: torch and transformers imported once, each worker a fork (~0.5 s to ready
    instead of ~3.3 s)."""
    server = ForkServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def start_worker(tmp_path_factory: pytest.TempPathFactory,
                 worker_fork_server: ForkServer) -> Iterator[Callable[..., WorkerProcess]]:
    """Factory: start a worker with extra args/env; every worker it made is stopped at module end.
    ``exec_start=True`` starts it as ``python -m servegate worker`` (for a test of its command line)."""
    started: list[WorkerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None, *, wait: bool = True,
              model_args: list[str] | None = None, exec_start: bool = False) -> WorkerProcess:
        log_path = tmp_path_factory.mktemp("worker") / "worker.log"
        worker = WorkerProcess([*(TINY_ARGS if model_args is None else model_args), *args], env, log_path,
                               fork_server=None if exec_start else worker_fork_server)
        started.append(worker)
        return worker.wait_ready() if wait else worker

    yield start
    for worker in started:
        worker.stop()


