"""pyproject.toml lists every package, so that a wheel (the container image) has them all.

An editable install finds subpackages through ``package-dir`` alone; a built
wheel holds only what ``packages`` names, so a missing entry shows up only in a
non-editable install, as a ModuleNotFoundError at start.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit]

tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and later")

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_under_package_dir_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for top, folder in setuptools["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base)
            found.add(".".join((top, *relative.parts)))
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "packages listed in pyproject.toml that do not exist"
