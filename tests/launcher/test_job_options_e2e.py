"""A job-level option given to ``horarun`` as a flag reaches the coordinator's REST view."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from subprocess import CompletedProcess

import pytest

from tests.support.coordinator import CoordinatorProcess

Run = Callable[..., CompletedProcess[str]]
Script = Callable[[str], str]

# The worker joins, then reads its job as the REST API shows it.
FETCH_JOB = """
import sys, urllib.request
import hora.torch as hvd
hvd.init()
with urllib.request.urlopen(sys.argv[1], timeout=10) as answer:
    print("JOB", answer.read().decode())
hvd.shutdown()
"""


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_a_job_level_flag_reaches_the_rest_view_of_the_job(horarun: Run,
                                                           worker_script: Script) -> None:
    with CoordinatorProcess() as coordinator:
        url = f"{coordinator.http_url}/api/v1/jobs/opts"
        result = horarun(["-np", "1", "--coordinator", coordinator.grpc_address,
                          "--token", coordinator.token, "--job-id", "opts",
                          "--fusion-threshold-mb", "3", "--stall-check-time", "7",
                          sys.executable, worker_script(FETCH_JOB), url], timeout=80)
    assert result.returncode == 0, result.stderr
    line = next(li for li in result.stdout.splitlines() if "JOB " in li)
    job = json.loads(line.split("JOB ", 1)[1])
    assert job["job_options"]["fusion_threshold"] == str(3 * 1024 * 1024)
    assert float(job["job_options"]["stall_warning_time"]) == 7.0
    assert float(job["job_options"]["elastic_timeout"]) == 600.0
