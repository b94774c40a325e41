"""The TensorFlow and Keras examples under ``horovodrun -np 2``: each ends above 0.90
accuracy on held-out digits, with the same weights on both ranks (a checksum per rank).

Skipped, saying so, when TensorFlow (or tf-keras for the legacy walk-through) is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
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


def _workers_of(script: str) -> dict[int, list[bytes]]:
    """The example's workers still running: pid -> its environment's entries."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if script.encode() in cmdline and b"horovodrun" not in cmdline:
                found[int(entry.name)] = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
    return found


def _worker_on(host: str, script: str) -> int | None:
    """The pid of the example's worker on ``host`` (its HOROVOD_HOSTNAME), if running."""
    for pid, environ in _workers_of(script).items():
        if f"HOROVOD_HOSTNAME={host}".encode() in environ:
            return pid
    return None


def _wait_or_dump_stacks(proc: subprocess.Popen, timeout: float, script: str, log: Path) -> None:
    """Waits for ``proc``; past ``timeout``, every worker still running prints its
    threads' Python stacks (PYTHONFAULTHANDLER, on SIGABRT) into ``log``, and the
    test fails with that log's end."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in _workers_of(script):
            with contextlib.suppress(ProcessLookupError):  # (it ended meanwhile)
                os.kill(pid, signal.SIGABRT)
        time.sleep(3)
        pytest.fail(f"horovodrun still running after {timeout} s; its workers' stacks:\n"
                    + log.read_text()[-12000:])


def test_elastic_keras_survives_kill_9_of_one_of_three_workers(tmp_path):
    script = "tensorflow2_keras_digits_elastic.py"
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("127.0.0.2:1\n127.0.0.3:1\n127.0.0.4:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "horovodrun"), "-np", "3", "--min-np", "2", "--max-np", "3",
             "--host-discovery-script", str(discover), sys.executable,
             str(ROOT / "examples" / script), "--epochs", "8", "--steps", "120"],
            stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
                 "OMP_NUM_THREADS": "1", "HORA_START_TIMEOUT": "90", "PYTHONFAULTHANDLER": "1"})
    try:
        deadline = time.monotonic() + 150
        while "<stdout>:Epoch 3/" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        victim = _worker_on("127.0.0.4", script)
        assert victim is not None, log.read_text()[-3000:]
        os.kill(victim, signal.SIGKILL)
        _wait_or_dump_stacks(proc, 170, script, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-5000:]
    assert "in a world of 2" in text.split("Epoch 3/", 1)[1], text[-5000:]
    finals = re.findall(r"rank (\d+) of (\d+) test accuracy: ([\d.]+)", text)
    assert sorted((r, s) for r, s, _ in finals) == [("0", "2"), ("1", "2")], text[-3000:]
    assert min(float(a) for _, _, a in finals) >= 0.90, finals
    sums = re.findall(r"rank \d+ weights checksum: (\w+)", text)
    assert len(sums) == 2 and len(set(sums)) == 1, sums
