"""A regular (non-editable) install ships every package of the source tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_servegate_package_is_listed_for_installation():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "servegate").rglob("__init__.py")}
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
