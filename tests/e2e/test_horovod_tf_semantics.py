"""A Horovod-style TensorFlow script under `horovodrun -np 2`: every TF collective x every
dtype x dims 1-3 x empty tensors x process sets, eager, in tf.function and in a TF1 Session
graph of independent collectives; Horovod's gradients; every invalid call caught as the TF
class Horovod raises. The script is tests/e2e/horovod_tf_semantics.py, unchanged from what
a Horovod user would run (it imports horovod.tensorflow)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.coordinator import CoordinatorProcess

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed", allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).with_name("horovod_tf_semantics.py")


def test_horovodrun_tf_semantics_script_passes_every_section():
    # A 10 s lease, as tests/multiprocess/test_tensorflow.py's: TensorFlow's tracing can hold
    # a worker's GIL (and its heartbeat) for seconds on a loaded machine.
    with CoordinatorProcess(["--lease-s", "10"]) as coordinator:
        proc = subprocess.run(
            [str(BIN / "horovodrun"), "-np", "2", "--coordinator", coordinator.grpc_address,
             sys.executable, str(SCRIPT)],
            capture_output=True, text=True, timeout=380, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
                 "HORA_TOKEN": coordinator.token})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = [line for line in proc.stdout.splitlines() if "tf dtype matrix:" in line]
    assert summary and summary[0].startswith("[0]<stdout>:"), proc.stdout[-3000:]
    words = summary[0].split()
    assert int(words[words.index("matrix:") + 1]) > 1000
    assert int(words[words.index("gradients:") + 1]) >= 10
    assert int(words[words.index("calls:") + 1]) >= 12
