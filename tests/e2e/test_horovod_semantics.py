"""A Horovod-style script under `horovodrun -np 2`: every collective x every dtype x dims 1-3
x process sets, with and without gradients, every invalid call caught as a RuntimeError, and
then a model trains. The script is tests/e2e/horovod_semantics.py, unchanged from what a
Horovod user would run (it imports horovod.torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).with_name("horovod_semantics.py")


def test_horovodrun_semantics_script_passes_every_section():
    proc = subprocess.run(
        [str(BIN / "horovodrun"), "-np", "2", sys.executable, str(SCRIPT)],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = [line for line in proc.stdout.splitlines() if "dtype matrix:" in line]
    assert summary and summary[0].startswith("[0]<stdout>:"), proc.stdout[-3000:]
    # e.g. "dtype matrix: 1380 checks; gradients: 174 checks; invalid calls: 37 caught; ..."
    words = summary[0].split()
    assert int(words[words.index("matrix:") + 1]) > 1000
    assert int(words[words.index("gradients:") + 1]) > 100
