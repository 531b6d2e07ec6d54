"""The regression zoo: each member is a real patch of servegate's source that still applies, and the
tree it builds is another build (another source digest) that runs its change and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servegate.errors import ConfigError
from servegate.paired.zoo import ZOO, build_tree, zoo_regression
from servegate.provenance import source_identity


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_member_applies_to_this_source_and_is_another_build(name: str, tmp_path: Path) -> None:
    tree = build_tree(name, tmp_path / name)
    here = Path(source_identity()["path"])
    changed = [p.relative_to(tree / "servegate") for p in sorted((tree / "servegate").rglob("*.py"))
               if (here / p.relative_to(tree / "servegate")).read_bytes() != p.read_bytes()]
    # The change is the worker's, and only the patch's files differ from this package.
    patched = {line.split(" b/servegate/")[1] for line in ZOO[name].patch.read_text().splitlines()
               if line.startswith("diff --git ")}
    assert {str(p) for p in changed} == patched and all(p.parts[0] == "worker" for p in changed)
    # Imported from its tree (python -P: the working directory, a checkout, does not shadow it), it is
    # another build by the digest the embedded worker reports.
    out = subprocess.run([sys.executable, "-P", "-c", "from servegate.provenance import source_identity as s; "
                          "print(s()['path'], s()['digest'])"], env={"PYTHONPATH": str(tree), "PATH": "/usr/bin"},
                         cwd=here.parent, capture_output=True, text=True, timeout=60, check=True)
    path, digest = out.stdout.split()
    assert path == str(tree / "servegate") and digest != source_identity()["digest"]
    assert digest == source_identity(tree / "servegate")["digest"]  # the same digest, read from outside


def test_building_again_replaces_the_tree_and_unknown_members_list_the_valid_ones(tmp_path: Path) -> None:
    first = build_tree("linears-unpacked", tmp_path / "t")
    (first / "stray.txt").write_text("left from before")
    assert not (build_tree("linears-unpacked", tmp_path / "t") / "stray.txt").exists()
    with pytest.raises(ConfigError, match="unknown zoo regression 'nope'; valid: linears-unpacked, attention-bf16"):
        zoo_regression("nope")


def test_a_patch_that_no_longer_applies_says_which_and_to_update_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from servegate.paired import zoo

    stale = tmp_path / "regressions"
    stale.mkdir()
    (stale / "linears-unpacked.patch").write_text(
        ZOO["linears-unpacked"].patch.read_text().replace("torch.bfloat16:\n", "torch.float16:\n", 1))
    monkeypatch.setattr(zoo, "REGRESSIONS_DIR", stale)
    with pytest.raises(ConfigError, match=r"'linears-unpacked' no longer applies .*update the patch"):
        build_tree("linears-unpacked", tmp_path / "t")
