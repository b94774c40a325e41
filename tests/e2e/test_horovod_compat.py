"""Unchanged Horovod scripts: `horovodrun` and the `horovod` import shim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

SCRIPT = """
import os
import torch
import horovod.torch as hvd
hvd.init()
assert hvd.rank() == int(os.environ["HOROVOD_RANK"]) and hvd.size() == 2
x = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum, name="x")
print("ok", hvd.rank(), x.tolist())
"""


def _run(cmd, env=None, timeout=80):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def test_horovodrun_runs_an_import_horovod_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = _run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable,
                 str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:ok {rank} [3.0, 3.0, 3.0]" in proc.stdout


def test_horarun_does_not_offer_horovod_unless_asked(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = _run([str(BIN / "horarun"), "-np", "2", sys.executable, str(script)])
    assert plain.returncode != 0 and "No module named 'horovod'" in plain.stderr
    compat = _run([str(BIN / "horarun"), "--horovod-compat", "-np", "2", sys.executable,
                   str(script)])
    assert compat.returncode == 0, compat.stderr[-3000:]


def test_a_real_horovod_is_never_shadowed(tmp_path):
    fake = tmp_path / "site" / "horovod"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    proc = _run([str(BIN / "horovodrun"), "-np", "2", sys.executable, "-c", "pass"],
                env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 2
    assert "a real Horovod is installed" in proc.stderr and str(fake) in proc.stderr
