"""The TensorFlow and Keras examples under ``horovodrun -np 2``: each ends above 0.90
accuracy on held-out digits, with the same weights on both ranks (a checksum per rank).

Skipped, saying so, when TensorFlow (or tf-keras for the legacy walk-through) is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

if importlib.util.find_spec("tensorflow") is None:
    print("\nSKIPPED: tests/e2e/test_tensorflow_examples.py: TensorFlow is not installed "
          "(pip install 'hora[tensorflow]')")
    pytest.skip("TensorFlow is not installed", allow_module_level=True)


def horovodrun(script: str, *args: str, cwd: Path, np_: int = 2, timeout: float = 220,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "horovodrun"), "-np", str(np_), sys.executable, str(ROOT / "examples" / script),
         *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
             "OMP_NUM_THREADS": "1", **(env or {})})


def check_ranks(proc: subprocess.CompletedProcess, ranks: int = 2) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    accuracies = [float(a) for a in re.findall(r"rank \d+ test accuracy: ([\d.]+)", proc.stdout)]
    sums = re.findall(r"rank \d+ weights checksum: (\w+)", proc.stdout)
    assert len(accuracies) == ranks and len(sums) == ranks, proc.stdout[-3000:]
    assert min(accuracies) >= 0.90, accuracies
    assert len(set(sums)) == 1, sums


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                    reason="tf-keras (the legacy Keras 2) is not installed")
def test_seeds_keras_walk_through_on_legacy_keras(tmp_path):
    proc = horovodrun("tensorflow2_keras_digits.py", "--epochs", "2", "--steps", "160",
                      cwd=tmp_path)
    check_ranks(proc)
    # Rank 0 alone writes the seed's checkpoints.
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.h5")) == \
        ["checkpoint-1.h5", "checkpoint-2.h5"]


def test_keras3_walk_through(tmp_path):
    proc = horovodrun("tensorflow2_keras3_digits.py", "--epochs", "2", "--steps", "160",
                      cwd=tmp_path)
    check_ranks(proc)
    assert "[0]<stdout>:restored optimizer: Adam" in proc.stdout
    assert "lr: 0.0020" in proc.stdout  # warmed up to 0.001 * size
    assert (tmp_path / "checkpoint-2.keras").exists()


def test_gradient_tape_loop(tmp_path):
    proc = horovodrun("tensorflow2_digits_gradient_tape.py", "--steps", "400", cwd=tmp_path)
    check_ranks(proc)
