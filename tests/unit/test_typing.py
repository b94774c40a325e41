"""The four packages type-check clean under mypy, as ``make lint`` promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hora_proto", "hora_native", "hora", "hora_coordinator")


@pytest.mark.timeout(600)
def test_mypy_is_clean_over_the_four_packages(tmp_path):
    args = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")]
    for package in PACKAGES:
        args += ["-p", package]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=590)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout
