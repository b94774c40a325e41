"""``horarun`` prints where the job's page of the dashboard is, and the URL works."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from subprocess import CompletedProcess

import pytest
from launcher_helpers import NO_COORDINATOR

from hora.runner.args import parse_args
from hora.runner.launch import _dashboard_line
from tests.support.coordinator import CoordinatorProcess

Run = Callable[..., CompletedProcess[str]]
Script = Callable[[str], str]

# Rank 0 opens the page horarun printed while the job runs, as a browser would.
FETCH = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=10) as answer:
    kind = answer.headers["content-type"]
    print("page", answer.status, kind.split(";")[0], "job.js" in answer.read().decode())
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_embedded_coordinator_prints_the_page_url_and_serves_it(horarun: Run,
                                                                worker_script: Script) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/jobs/my%20job.1"
    result = horarun(["-np", "1", "--job-id", "my job.1", "--coordinator-http-port", str(port),
                      sys.executable, worker_script(FETCH), url])
    assert result.returncode == 0, result.stderr
    assert f"horarun: dashboard {url}\n" in result.stderr, result.stderr
    assert "page 200 text/html True" in result.stdout, result.stdout


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_running_coordinator_s_page_url_when_its_http_port_is_given(
        horarun: Run, worker_script: Script) -> None:
    with CoordinatorProcess() as coordinator:
        url = f"{coordinator.http_url}/jobs/given"
        result = horarun(["-np", "1", "--coordinator", coordinator.grpc_address,
                          "--coordinator-http-port", str(coordinator.http_port),
                          "--token", coordinator.token, "--job-id", "given",
                          sys.executable, worker_script(FETCH), url])
    assert result.returncode == 0, result.stderr
    assert f"horarun: dashboard {url}\n" in result.stderr, result.stderr
    assert "page 200 text/html True" in result.stdout, result.stdout


@pytest.mark.timeout(30)
def test_without_its_http_port_horarun_says_where_to_look(horarun: Run) -> None:
    result = horarun(["-np", "1", *NO_COORDINATOR, "--job-id", "j1", "true"])
    assert ("horarun: dashboard: page /jobs/j1 on the coordinator's HTTP address "
            "(hora-coordinator prints it at start; pass --coordinator-http-port PORT and "
            "horarun prints the whole URL)") in result.stderr, result.stderr


@pytest.mark.unit
def test_off_loopback_the_line_carries_a_made_up_token_only() -> None:
    made_up = parse_args(["-np", "1", "--job-id", "j", "true"], environ={})
    given = parse_args(["-np", "1", "--job-id", "j", "--token", "secret", "true"], environ={})
    line = _dashboard_line(made_up, "10.0.0.5", 8080, tls=True, embedded=True)
    assert line == f"dashboard https://10.0.0.5:8080/jobs/j?token={made_up.token}"
    line = _dashboard_line(given, "10.0.0.5", 8080, tls=False, embedded=True)
    assert line == "dashboard http://10.0.0.5:8080/jobs/j (it asks for the job token once)"
    assert "secret" not in line
    assert _dashboard_line(made_up, "::1", 80, tls=False, embedded=True) == \
        "dashboard http://[::1]:80/jobs/j"
    # A running coordinator never learns a token horarun made up.
    assert "token=" not in _dashboard_line(made_up, "10.0.0.5", 8080, False, embedded=False)
