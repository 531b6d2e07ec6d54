"""The worker's API key reaches the embedded worker by environment, never on its command line
(issue 11, finding 13), and the gate's clients still authenticate with it. A real worker
process (tiny model) launched by launch_worker, as the launch stage does."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import requests

from servegate.config import WarmupConfig, WorkerSpec
from servegate.bench.warmup import run_warmup
from servegate.engines import EmbeddedEngine
from servegate.errors import ServegateError
from servegate.launch import launch_worker

pytestmark = pytest.mark.timeout(240)

KEY = "sk-live-0123456789"
TINY = ["--dtype", "float32", "--context-length", "1024", "--num-threads", "1"]


@pytest.fixture(scope="module", autouse=True)
def _tiny_model_cached() -> None:
    from servegate.models import ensure_model

    ensure_model("tiny-random")


def test_embedded_worker_gets_the_key_by_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATE_TEST_KEY", KEY)
    monkeypatch.setenv("SERVEGATE_DB", "postgresql+psycopg://gate:pg-pass-4711@db.example/history")
    spec = WorkerSpec(engine="embedded", model="tiny-random", memory_profile="cpu-small", extra_args=TINY,
                      enable_metrics=False, api_key_env="GATE_TEST_KEY")
    log = tmp_path / "worker.log"
    with launch_worker(spec, log, ready_timeout_s=180) as handle:
        worker = psutil.Process(handle.pid)
        argv = " ".join(worker.cmdline() + [a for c in worker.children(recursive=True) for a in c.cmdline()])
        assert KEY not in argv and "--api-key" not in argv  # nothing in `ps`
        # The environment it started with (`ps e`, /proc/PID/environ: the kernel's copy, which the worker
        # cannot wipe): the key only under the engine's own variable, not also under the user's; the
        # history's URL without its password (a worker never writes the history).
        environ = worker.environ()
        assert "GATE_TEST_KEY" not in environ and environ["SERVEGATE_API_KEY"] == KEY
        assert environ["SERVEGATE_DB"] == "postgresql+psycopg://gate:***@db.example/history"
        assert not [k for k, v in environ.items() if "pg-pass-4711" in v]
        assert KEY not in log.read_text()
        # The worker requires the key ...
        assert requests.post(handle.base_url + "/generate", json={"text": "hi"}, timeout=30).status_code == 401
        # ... and a client given WorkerSpec.api_key_value() (what the stages must get) is let in.
        cfg = WarmupConfig(num_requests=2, max_new_tokens=2)
        assert run_warmup(handle.base_url, EmbeddedEngine(), cfg, api_key=spec.api_key_value()) == 2
        with pytest.raises(ServegateError, match="401"):
            run_warmup(handle.base_url, EmbeddedEngine(), cfg, api_key=None)
