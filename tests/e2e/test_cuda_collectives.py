"""Every collective on CUDA tensors (tests/e2e/horovod_cuda.py) under `horarun -np 2`.

On a machine with one GPU the two ranks share it: NCCL refuses that
("Duplicate GPU detected"), so hora runs their CUDA collectives through host
memory and Gloo, and says so once. With a GPU per rank they go through NCCL.
Skipped without CUDA (CI has none); run on a GPU machine with
``pytest -m gpu tests/e2e/test_cuda_collectives.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("horovod_cuda.py")


def test_every_collective_on_cuda_tensors_at_two_ranks():
    proc = subprocess.run(
        [sys.executable, "-m", "hora.runner.launch", "-np", "2", sys.executable, str(SCRIPT)],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if "collectives on CUDA tensors" in line]
    assert len(lines) == 2, proc.stdout[-3000:]
    for line in lines:
        assert "0 failed; empty tensors" in line and line.endswith(" 0 failed"), line
    if torch.cuda.device_count() < 2:
        assert "NCCL cannot run two ranks on one GPU" in proc.stderr, proc.stderr[-3000:]
