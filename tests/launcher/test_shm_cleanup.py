"""horarun removes the shared-memory files of its job that killed workers left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from hora._shm import SHM_DIR, job_tag

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

Run = Callable[..., subprocess.CompletedProcess[str]]


def test_job_tag_is_file_name_safe():
    assert job_tag("job-1_a.b") == "job-1_a.b"
    assert job_tag("my job/../x") == "my_job_.._x"


def test_the_jobs_leftovers_go_and_other_jobs_files_stay(horarun: Run) -> None:
    job_id = f"shm test/{uuid.uuid4().hex[:8]}"
    mine = Path(SHM_DIR) / f"hora-{job_tag(job_id)}-{uuid.uuid4().hex}-1-0"
    other = Path(SHM_DIR) / f"hora-other-{uuid.uuid4().hex}-1-0"
    mine.write_bytes(b"left by a killed worker")
    other.write_bytes(b"another job's")
    try:
        # Payloads of 1.2 MB per round: each worker makes a shared segment.
        code = ("import torch, hora.torch as hvd; hvd.init(); "
                "[hvd.allreduce(torch.ones(300000), name='x') for _ in range(3)]; "
                "hvd.shutdown()")
        result = horarun(["-np", "2", "--job-id", job_id, sys.executable, "-c", code],
                         timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        assert not mine.exists()
        assert other.exists()
        left = [n for n in os.listdir(SHM_DIR) if n.startswith(f"hora-{job_tag(job_id)}-")]
        assert left == []
    finally:
        for path in (mine, other):
            path.unlink(missing_ok=True)
