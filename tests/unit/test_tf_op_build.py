"""hora's TensorFlow graph op library: built on first use, with a clear error without a
compiler, and its source shipped in the package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import tomllib

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def test_the_op_source_ships_in_the_package():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "hora_tf_ops.cc" in pyproject["tool"]["setuptools"]["package-data"]["hora.tensorflow"]
    assert (ROOT / "client_sdk/hora/tensorflow/hora_tf_ops.cc").exists()


def test_without_a_compiler_the_build_says_so(monkeypatch, tmp_path):
    from hora.tensorflow import _build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(_build.BuildError, match="no C\\+\\+ compiler"):
        _build.library_path()
