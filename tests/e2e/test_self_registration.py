"""Workers that join a standalone coordinator by themselves, as trainer containers do.

No launcher: each worker gets the coordinator's address, a job id, the token
and the world size (or elastic bounds) in its environment, and the
coordinator assigns the ranks. In an elastic job a worker that starts while
the job runs is a member at the next commit: no discovery script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e]

WORKER = Path(__file__).with_name("elastic_worker.py")


def spawn(coordinator, out: Path, host: str, size: int, *worker_args: str) -> subprocess.Popen:
    env = {**os.environ, "HORA_COORDINATOR": coordinator.grpc_address, "HORA_JOB_ID": "self",
           "HORA_TOKEN": coordinator.token, "HORA_SIZE": str(size), "HORA_MIN_SIZE": "1",
           "HORA_MAX_SIZE": "3", "HORA_HOSTNAME": host, "PYTHONUNBUFFERED": "1"}
    log = open(out / f"{host}.log", "w")  # noqa: SIM115 (closed with the test's tmp_path)
    return subprocess.Popen([sys.executable, str(WORKER), str(out), *worker_args], env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def wait_for_progress(out: Path, steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (out / "progress").read_text().split() if (out / "progress").exists() else []
        if text and int(text[0]) >= steps:
            return
        time.sleep(0.1)
    raise AssertionError(f"training did not reach step {steps} within {timeout} s")


@pytest.mark.timeout(240)
def test_a_worker_started_alone_joins_the_running_elastic_job_and_the_world_grows(
        coordinator, tmp_path):
    args = ["--step-sleep", "0.02", "--epochs", "1", "--hold-at-step", "10",
            "--hold-until-size", "3"]
    procs = [spawn(coordinator, tmp_path, host, 2, *args) for host in ("a", "b")]
    try:
        wait_for_progress(tmp_path, 5, 90)
        procs.append(spawn(coordinator, tmp_path, "c", 1, *args))
        for proc in procs:
            proc.wait(timeout=180)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    logs = {p.stem: p.read_text()[-3000:] for p in tmp_path.glob("*.log")}
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    done = {r["host"]: r for r in (json.loads(p.read_text())
                                   for p in tmp_path.glob("report.*.json"))}
    assert sorted(done) == ["a", "b", "c"], logs
    assert all(r["size"] == 3 and r["params_identical"] for r in done.values())
    assert done["a"]["sizes"][0] == 2 and 3 in done["a"]["sizes"], done["a"]["sizes"]
    assert sorted(r["rank"] for r in done.values()) == [0, 1, 2]
