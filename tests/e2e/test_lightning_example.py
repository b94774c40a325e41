"""examples/lightning_digits.py under horovodrun -np 2: Trainer(strategy="horovod") end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed "
                    "(pip install 'hora[lightning]'): the Lightning example test is skipped")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_lightning_digits_reaches_090_with_equal_weights_on_both_ranks(tmp_path):
    proc = subprocess.run(
        [str(BIN / "horovodrun"), "-np", "2", sys.executable, "examples/lightning_digits.py",
         "--epochs", "6", "--root-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=230, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    accuracy = re.search(r"\[0\]<stdout>:Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)",
                         proc.stdout)
    assert accuracy, proc.stdout
    assert float(accuracy.group(1)) >= 0.90, proc.stdout
    assert "[1]<stdout>:Test set" not in proc.stdout  # printed by rank 0 only
    sums = dict(re.findall(r"\[(\d)\]<stdout>:rank \1 of 2: weight checksum (.+)", proc.stdout))
    assert set(sums) == {"0", "1"}, proc.stdout
    assert sums["0"] == sums["1"], sums
    # Rank 0 alone logs and checkpoints: one logger version, the last epoch's checkpoint.
    versions = sorted(p.name for p in (tmp_path / "lightning_logs").iterdir())
    assert versions == ["version_0"], versions
    checkpoints = [p.name for p in (tmp_path / "lightning_logs" / "version_0" / "checkpoints")
                   .iterdir()]
    assert checkpoints == ["epoch=5-step=138.ckpt"], checkpoints
