"""Helpers for the worker tests: real worker processes, SSE and metrics parsing.

Each worker is ``servegate worker ...`` on a free 127.0.0.1 port with the tiny random-weight model
(float32, so batched and solo greedy decoding agree exactly), forked from the lane's fork server
(servegate/worker/forkserver.py: torch and transformers imported once) or, where the test's subject is
the process's own start (its command line), started as ``python -m servegate worker``; teardown ends
the whole process tree.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from servegate.proctree import terminate_tree
from servegate.worker.forkserver import ForkServer

READY_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerProcess:
    """One worker subprocess; ``url`` is its base URL."""

    def __init__(self, args: list[str], env: dict[str, str] | None, log_path: Path,
                 fork_server: ForkServer | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        worker_args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.cmd = [sys.executable, "-m", "servegate", "worker", *worker_args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self._log = log_path.open("wb")
        if fork_server is not None:
            self.proc = fork_server.spawn(worker_args, env=full_env, log_path=log_path)
        else:
            self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> "WorkerProcess":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode} during start-up:\n{self.log_text()}")
            try:
                if requests.get(self.url + "/health", timeout=10).status_code == 200:
                    return self
            except (requests.ConnectionError, requests.Timeout):
                pass  # not listening yet, or too busy loading the model to answer: poll again
            time.sleep(0.1)
        raise AssertionError(f"worker not ready after {timeout_s} s:\n{self.log_text()}")

    def wait_exit(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        terminate_tree(self.proc.pid, timeout_s=10)
        if self.proc.poll() is None:
            self.proc.wait(timeout=5)
        self._log.close()


TINY_ARGS = ["--model", "tiny-random", "--dtype", "float32", "--context-length", "1024", "--num-threads", "1"]


def generate(url: str, body: dict, timeout: float = 60, **kwargs) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=timeout, **kwargs)


def sse_events(resp: requests.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order (``[DONE]`` included)."""
    events = []
    for line in resp.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            events.append(line[len("data: "):])
    return events


def scrape(url: str) -> dict[str, list]:
    """Metric samples by sample name, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = requests.get(url + "/metrics", timeout=10)
    resp.raise_for_status()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def metric_value(url: str, name: str) -> float:
    samples = scrape(url)[name]
    assert len(samples) == 1, samples
    return samples[0].value
