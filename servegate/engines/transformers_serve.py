"""transformers: ``transformers serve --continuous-batching``, Hugging Face's own OpenAI-compatible server.

What the server has (transformers 5.23, ``transformers/cli/serving/server.py``): ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``GET /health`` (503 once the batching worker died). What it
has not, and so the capabilities below say: no Prometheus ``/metrics`` (404: no occupancy stage), no
log-probabilities (``logprobs`` and ``echo`` are ignored: no quality stage), no server info (capacity
``inf``), no API key, no list of prompts in one request (no one-batch stage). Its ``/v1/completions``
follows OpenAI's schema strictly — a text prompt, no ``ignore_eos``, no ``data: [DONE]`` — so the gate
speaks the "openai-text" dialect to it (``servegate.bench.protocol.openai``). Its continuous-batching cache shares blocks between requests with a common
prefix, but no route drops them (``/reset`` unloads the model): ``flush`` returns False, and the
flush stage warns that the measurement runs unflushed.

The model is preloaded (the ``FORCE_MODEL`` argument). ``GET /v1/models`` does not list that model:
it lists the Hugging Face cache (and answers 500 when there is none), while a request naming any other
model than the preloaded one is refused. So a local model directory (servegate's aliases included) is
served under a hub-style id, ``servegate/<alias>``, from a small cache of symbolic links made for the
server (``HF_HUB_CACHE``, offline): the cache lists exactly that model, and the id it lists is the one
the server accepts. A hub id is passed through; the server then lists the machine's Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import ClassVar

import requests

from servegate.budgets import TransformersBudget
from servegate.config import WorkerSpec
from servegate.engine_install import resolve_engine_python
from servegate.engines.base import Engine, Protocol, ServerCapacity, user_env
from servegate.errors import ConfigError
from servegate.models import MODEL_ALIASES, cache_dir, ensure_model

__all__ = ["TransformersServeEngine", "served_model", "ensure_hub_view", "HUB_VIEW_DIR"]

HUB_VIEW_DIR = "transformers-hub"
"""Under servegate's model cache: the Hugging Face cache layout the server's ``/v1/models`` lists."""


def _hub_id(model: str, directory: Path) -> str:
    """The hub-style id a local model is served under: ``servegate/<alias>``, or
    ``local/<folder>-<hash of its path>`` so that two folders of one name stay two models."""
    if model in MODEL_ALIASES:
        return f"servegate/{model}"
    digest = hashlib.sha1(str(directory.resolve()).encode()).hexdigest()[:8]
    return f"local/{directory.name}-{digest}"


def served_model(model: str) -> tuple[str, Path | None]:
    """``(FORCE_MODEL, HF_HUB_CACHE)`` for ``worker.model``: an alias or a local directory becomes a
    hub-style id in servegate's view of it (the view's root is the second item); a hub id stays, with
    no cache of its own (None). Pure: ``ensure_hub_view`` makes the view."""
    directory = Path(model).expanduser()
    if model not in MODEL_ALIASES and not directory.is_dir():
        return model, None
    return _hub_id(model, directory), cache_dir() / HUB_VIEW_DIR


def ensure_hub_view(hub_id: str, directory: Path, root: Path) -> Path:
    """``root`` in the Hugging Face cache layout with one model, ``hub_id``, whose files are symbolic
    links to ``directory``'s; returns the snapshot folder.

    The snapshot's name hashes the directory's path and its files (names, sizes, times), so a changed
    model gets a new snapshot; ``refs/main`` is replaced atomically and a concurrent launch that made
    the same snapshot first wins, so two gates can start at once.
    """
    directory = directory.resolve()
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    if not files:
        raise ConfigError(f"model directory {directory} holds no files; give a directory loadable by from_pretrained")
    digest = hashlib.sha1(str(directory).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.relative_to(directory)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    revision = digest.hexdigest()
    repo = root / ("models--" + hub_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    if not snapshot.is_dir():
        (repo / "snapshots").mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{revision}.", dir=repo / "snapshots"))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users of the cache
        for path in files:
            link = staging / path.relative_to(directory)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
        try:
            os.rename(staging, snapshot)
        except OSError:
            if not snapshot.is_dir():
                raise
            shutil.rmtree(staging)  # another launch made it first (rmtree removes links, not their targets)
    (repo / "refs").mkdir(exist_ok=True)
    ref_tmp = repo / "refs" / f".main.{os.getpid()}"
    ref_tmp.write_text(revision)
    os.replace(ref_tmp, repo / "refs" / "main")
    return snapshot


class TransformersServeEngine(Engine):
    name: ClassVar[str] = "transformers"
    # Text prompts only, no ignore_eos (422), no [DONE]: OpenAI's schema strictly (bench.protocol.openai).
    protocol: ClassVar[Protocol] = "openai-text"
    readiness_path: ClassVar[str] = "/health"
    metric_names: ClassVar[dict[str, str]] = {}
    metrics_hint: ClassVar[str] = (
        "transformers serve has no /metrics route (404 in transformers 5.23); disable the occupancy stage"
    )
    can_flush: ClassVar[bool] = False  # no route drops the shared prefix blocks (/reset unloads the model)
    has_metrics: ClassVar[bool] = False
    has_occupancy_gauge: ClassVar[bool] = False
    reports_capacity: ClassVar[bool] = False  # no server-info route
    has_logprobs: ClassVar[bool] = False  # /v1/completions ignores logprobs and echo
    takes_prompt_batches: ClassVar[bool] = False  # a list of prompts is 400 "prompt must be a string"
    budget_model: ClassVar[type[TransformersBudget]] = TransformersBudget

    def launch_command(self, spec: WorkerSpec, port: int) -> list[str]:
        budget = self.budget(spec)
        self._refuse_unsupported(spec)
        # The interpreter servegate runs in (transformers is its pinned dependency), not whichever
        # `transformers` script is first on PATH; worker.python names another (an engine venv).
        python = resolve_engine_python(spec.python) if spec.python is not None else sys.executable
        force_model, hub_root = served_model(spec.model)
        if hub_root is not None:
            ensure_hub_view(force_model, ensure_model(spec.model), hub_root)
        cmd = [python, "-m", "transformers.cli.transformers", "serve", force_model, "--continuous-batching",
               "--host", spec.host, "--port", str(port)]
        for field, value in budget.settings().items():
            cmd += ["--" + field.replace("_", "-"), str(value)]
        return cmd + list(spec.extra_args)

    def launch_env(self, spec: WorkerSpec) -> dict[str, str]:
        # The CLI would otherwise ask PyPI for a newer transformers once a day, at start-up.
        env = {"HF_HUB_DISABLE_UPDATE_CHECK": "1"}
        _, hub_root = served_model(spec.model)
        if hub_root is not None:
            # The view is local only: offline, so that loading servegate/<alias> never asks a hub.
            env.update(HF_HUB_CACHE=str(hub_root), HF_HUB_OFFLINE="1")
        env.update(user_env(spec))
        return env

    def _refuse_unsupported(self, spec: WorkerSpec) -> None:
        if spec.api_key_value() is not None:
            raise ConfigError("transformers serve checks no API key: it would serve anyone while the gate believes "
                              "it is protected; unset worker.api_key / worker.api_key_env, or put an authenticating "
                              "proxy in front of it and attach with engine 'external'")
        if spec.speculative_num_draft_tokens is not None:
            raise ConfigError("transformers serve has no speculative decoding flag; unset "
                              "worker.speculative_num_draft_tokens")

    def flush(self, session: requests.Session, base_url: str, timeout_s: float,
              request_timeout_s: float | None = None) -> bool:
        return False  # no flush route: the flush stage warns and measures unflushed

    def server_capacity(self, session: requests.Session, base_url: str) -> ServerCapacity:
        return ServerCapacity(token_capacity=math.inf, max_running_requests=math.inf, raw={})
