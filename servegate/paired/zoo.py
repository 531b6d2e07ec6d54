"""The regression zoo: real code changes to the embedded worker, to calibrate the paired gate with.

A synthetic fault (a sleep, extra computation after the forward) is an instrument, not proof that the gate
sees the regressions people write. Each member here is a patch of servegate's own source
(``servegate/paired/regressions/<name>.patch``), of a kind that reaches serving engines: a kernel left on
its slow path, a slower attention path, Python work added to every step, a sampler that lost its fast path.
:func:`build_tree` copies this package into a folder and applies the patch there; a worker launched with
that folder first on its ``PYTHONPATH`` (the embedded worker runs ``python -P``, so the working directory
does not shadow it) runs the changed build, and reports its source digest in ``/get_server_info``, which
the paired stage checks differs from the baseline's.

``servegate calibrate --paired --regressions NAMES`` decides each member like a slowdown arm and measures
each one's solo effect (:mod:`servegate.paired.solo`: the two builds' decode steps alternated in one
process), what the gate's reading is held against; ``benchmarks/zoo_solo.py`` prints the solo effects alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from servegate.errors import ConfigError

__all__ = ["ZOO", "ZooRegression", "build_tree", "copy_package", "zoo_regression"]

REGRESSIONS_DIR = Path(__file__).resolve().parent / "regressions"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
APPLY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ZooRegression:
    """One real code regression: its name, the part of the worker it slows, and what the change is."""

    name: str
    kind: str
    change: str

    @property
    def patch(self) -> Path:
        return REGRESSIONS_DIR / f"{self.name}.patch"


ZOO: dict[str, ZooRegression] = {z.name: z for z in (
    ZooRegression("linears-unpacked", "kernel",
                  "the 30 MLP down projections left out of the oneDNN packing (fastpath.speed_up): "
                  "torch's plain bfloat16 linear, which streams its weight slower"),
    ZooRegression("attention-bf16", "attention",
                  "attention computed in bfloat16: the CPU fast path's float32 attention dropped, so PyTorch's "
                  "flash-attention kernel runs its slow bfloat16 path for one query row -- in an aligned, "
                  "mask-free decode batch only; a ragged serving batch takes the masked kernel, where it "
                  "is not slower (docs/paired.md)"),
    ZooRegression("detokenize-full", "scheduler Python",
                  "where each token's text ends found by decoding the output up to every token, at every "
                  "accepted token (a tokenizer call per token so far), instead of decoding a 64-token tail only "
                  "when there are stop strings: Python work in the scheduler's step that grows with the output"),
    ZooRegression("attention-eager", "attention",
                  "attention computed by transformers' eager path (matmul, softmax and matmul as separate "
                  "operators in bfloat16, the mask added as a tensor) instead of the fast path's float32 SDPA "
                  "kernel: the switch a model gets for output_attentions or a debugging session; slower in the "
                  "ragged serving batch as well as the aligned one"),
    ZooRegression("sampler-one-path", "sampler",
                  "one sampling path for every request: the greedy shortcut removed, so every step takes a "
                  "softmax of the whole vocabulary and draws a sample per row before it picks the greedy token"),
)}
"""The members, by name."""


def zoo_regression(name: str) -> ZooRegression:
    """The member called ``name``; ``ConfigError`` listing the valid names otherwise."""
    try:
        return ZOO[name]
    except KeyError:
        raise ConfigError(f"unknown zoo regression {name!r}; valid: {', '.join(ZOO)}") from None


def copy_package(dest: Path) -> Path:
    """This servegate package copied to ``dest/servegate`` (no bytecode caches), ready to be changed into
    another build; returns ``dest`` (resolved), the folder to put first on a worker's ``PYTHONPATH``. An
    existing ``dest`` is replaced."""
    dest = Path(dest).resolve()
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(PACKAGE_DIR, dest / "servegate", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def build_tree(name: str, dest: Path) -> Path:
    """This servegate package copied to ``dest/servegate`` (:func:`copy_package`) with member ``name``'s
    patch applied; returns ``dest``, the folder to put first on the candidate worker's ``PYTHONPATH``. An
    existing ``dest`` is replaced. ``ConfigError`` when the patch no longer applies to this source (it says
    to update it)."""
    member = zoo_regression(name)
    dest = copy_package(dest)
    # git apply in a folder that is inside a repository (a run folder in a checkout) would take the
    # patch's paths as relative to that repository's root: keep it from looking above dest.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest)}
    for args in (["--check"], []):
        try:
            done = subprocess.run(["git", "apply", *args, str(member.patch)], cwd=dest, env=env,
                                  capture_output=True, text=True, timeout=APPLY_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConfigError(f"could not run git to apply the zoo regression {name!r}: {exc}; install git") from exc
        if done.returncode != 0:
            raise ConfigError(f"the zoo regression {name!r} no longer applies to this servegate source "
                              f"({member.patch}): {'; '.join(done.stderr.split(chr(10))).strip('; ')}; update "
                              f"the patch to the current code")
    return dest
