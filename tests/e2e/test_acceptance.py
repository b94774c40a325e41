"""The foundation's promises, end to end: horarun, an embedded coordinator, real workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HORARUN = [sys.executable, "-m", "hora.runner.launch"]
STARTUP = re.compile(r"HTTP (http://127\.0\.0\.1:\d+), job (\S+)")


def run(args, timeout, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(HORARUN + args, capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=kwargs.pop("cwd", ROOT), **kwargs)


@pytest.mark.timeout(180)
def test_demo_trains_digits_to_ninety_percent(tmp_path):
    proc = run(["-np", "2", sys.executable, str(ROOT / "examples" / "pytorch_digits.py"),
                "--checkpoint-dir", str(tmp_path / "ckpt")], timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"\[0\]<stdout>:Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)",
                      proc.stdout)
    assert match, proc.stdout[-3000:]
    assert float(match.group(1)) >= 0.90
    # Only rank 0 prints progress and writes checkpoints.
    assert "[1]<stdout>:Train Epoch" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[0] == "checkpoint-1.pth.tar"


@pytest.mark.timeout(90)
def test_three_ranks_allreduce_prints_on_every_rank():
    code = ("import torch, hora.torch as hvd; hvd.init(); "
            "print(hvd.rank(), hvd.allreduce(torch.ones(4)*hvd.rank(), op=hvd.Sum))")
    proc = run(["-np", "3", sys.executable, "-c", code], timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(3):
        assert f"[{rank}]<stdout>:{rank} tensor([3., 3., 3., 3.])" in proc.stdout, proc.stdout


KILLER = """
import os, torch, hora.torch as hvd
hvd.init()
for step in range(1000000):
    if hvd.rank() == 1 and step == 30:
        os.kill(os.getpid(), 9)
    hvd.allreduce(torch.ones(100), name=f"step.{step}")
"""


@pytest.mark.timeout(90)
def test_worker_that_kills_itself_fails_the_job_naming_the_rank(tmp_path):
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    start = time.monotonic()
    proc = run(["-np", "3", sys.executable, str(script)], timeout=80)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60
    assert "rank 1" in proc.stderr and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    # The survivors raised RankLostError naming the lost rank, not a hang or a Gloo timeout.
    assert "RankLostError: rank 1" in proc.stderr, proc.stderr[-3000:]


WAITER = """
import os, sys, time, torch, hora.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1), name="warmup")
flag = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(flag) and time.monotonic() < deadline:
    time.sleep(0.05)
hvd.barrier()
print("done", hvd.rank())
"""


@pytest.mark.timeout(120)
def test_rest_api_shows_the_running_job(tmp_path):
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    flag = tmp_path / "go"
    proc = subprocess.Popen(HORARUN + ["-np", "3", sys.executable, str(script), str(flag)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    try:
        line = proc.stderr.readline()
        match = STARTUP.search(line)
        assert match, line
        url, job_id = match.groups()
        deadline = time.monotonic() + 60
        job = None
        while time.monotonic() < deadline:
            job = httpx.get(f"{url}/api/v1/jobs/{job_id}", timeout=5).json()
            if job.get("state") == "running" and len(job.get("members", [])) == 3:
                break
            time.sleep(0.2)
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        assert job["state"] == "running", job
        assert sorted(m["rank"] for m in job["members"]) == [0, 1, 2]
        assert all(m["state"] == "active" and m["pid"] > 0 for m in job["members"])
        assert job["generation"] >= 1
        jobs = httpx.get(f"{url}/api/v1/jobs", timeout=5).json()
        assert job_id in str(jobs)
    finally:
        flag.touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert all(f"[{r}]<stdout>:done {r}" in out for r in range(3))
