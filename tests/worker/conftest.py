"""Fixtures for the worker tests: real worker processes, one per configuration per module."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from workerutil import TINY_ARGS, WorkerProcess


@pytest.fixture(scope="session", autouse=True)
def _tiny_model_cached() -> None:
    """Build the tiny model once (from the cached SmolLM2 tokenizer) before any worker starts."""
    from servegate.models import ensure_model

    ensure_model("tiny-random")


@pytest.fixture(scope="module")
def start_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., WorkerProcess]]:
    """Factory: start a worker with extra args/env; every worker it made is stopped at module end."""
    started: list[WorkerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None, *, wait: bool = True,
              model_args: list[str] | None = None) -> WorkerProcess:
        log_path = tmp_path_factory.mktemp("worker") / "worker.log"
        worker = WorkerProcess([*(TINY_ARGS if model_args is None else model_args), *args], env, log_path)
        started.append(worker)
        return worker.wait_ready() if wait else worker

    yield start
    for worker in started:
        worker.stop()


