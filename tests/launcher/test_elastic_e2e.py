"""End-to-end tests of elastic mode: ``horarun`` with a real discovery script
and real worker processes on simulated hosts (127.0.0.x).

Workers are plain Python scripts that never call ``hvd.init()``. Where the
events the launcher records matter, ``--coordinator`` points at a small gRPC
server in this process that implements only ``ReportEvent``; elsewhere at an
address nobody serves.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from launcher_helpers import HORARUN, NO_COORDINATOR, Discovery, pid_gone

from hora_proto.auth import job_token
from hora_proto.v1 import rendezvous_pb2, rendezvous_pb2_grpc

pytestmark = pytest.mark.e2e

Run = Callable[..., "subprocess.CompletedProcess[str]"]
Script = Callable[[str], str]

# Prints its hora/Horovod environment, fails at once on the host named by
# argv[2], else writes DIR/HOST.pid and waits for DIR/stop.
WORKER = """
    import json, os, pathlib, sys, time
    directory = pathlib.Path(sys.argv[1])
    host = os.environ["HORA_HOSTNAME"]
    print(json.dumps({k: v for k, v in os.environ.items()
                      if k.startswith(("HORA_", "HOROVOD_"))}))
    if len(sys.argv) > 2 and host == sys.argv[2]:
        sys.exit(1)
    tmp = directory / f"{host}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(directory / f"{host}.pid")
    deadline = time.monotonic() + 25
    while not (directory / "stop").exists():
        if time.monotonic() > deadline:
            sys.exit(2)
        time.sleep(0.02)
"""


class _EventRecorder(rendezvous_pb2_grpc.RendezvousServicer):
    """The coordinator's ReportEvent, recording what it was sent, and a
    ListEvents that shows one generation formed at ``generation_ms`` (none
    while that is None)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str, str | None]] = []
        self.generation_ms: int | None = None
        self._lock = threading.Lock()

    def ListEvents(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        events = []
        if self.generation_ms is not None:
            events.append(rendezvous_pb2.JobEvent(unix_ms=self.generation_ms,
                                                  kind="generation", generation=1))
        return rendezvous_pb2.ListEventsResponse(events=events)

    def ReportEvent(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        token = dict(context.invocation_metadata()).get("hora-token")
        with self._lock:
            self.events.append((request.job_id, request.kind, request.host, request.message,
                                token))
        return rendezvous_pb2.ReportEventResponse()


@pytest.fixture
def events() -> Iterator[tuple[_EventRecorder, str]]:
    """A gRPC server recording ReportEvent calls, and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    recorder = _EventRecorder()
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield recorder, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "run"
    directory.mkdir()
    return directory


def _popen(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*HORARUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 15.0) -> int:
    """Waits for a worker's pid file; returns the pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return int(path.read_text())
        if proc.poll() is not None:
            raise AssertionError(f"horarun ended early: {proc.communicate()}")
        time.sleep(0.02)
    raise AssertionError(f"{path.name} did not appear within {timeout} s")


def _finish(proc: subprocess.Popen[str], timeout: float = 15.0) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        proc.wait(5)


def _envs_by_label(stdout: str) -> dict[str, dict[str, str]]:
    envs = {}
    for line in stdout.splitlines():
        match = re.fullmatch(r"\[([^\]]+)\]<stdout>:(\{.*\})", line)
        assert match, f"unexpected output line {line!r}"
        envs[match.group(1)] = json.loads(match.group(2))
    return envs


@pytest.mark.timeout(40)
def test_new_host_gets_a_worker(worker_script: Script, discovery: Discovery, run_dir: Path,
                                events: tuple[_EventRecorder, str]) -> None:
    recorder, address = events
    discovery.set_hosts("127.0.0.2:1")
    proc = _popen(["--coordinator", address, "--job-id", "job-grow", "--token", "tok",
                   "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                   discovery.script, "--reset-limit", "3", "--elastic-timeout", "20",
                   sys.executable, worker_script(WORKER), str(run_dir)])
    _wait_for(run_dir / "127.0.0.2.pid", proc)
    discovery.set_hosts("127.0.0.2:1", "127.0.0.3:1")
    _wait_for(run_dir / "127.0.0.3.pid", proc)
    (run_dir / "stop").touch()
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr
    envs = _envs_by_label(stdout)
    assert sorted(envs) == ["127.0.0.2:0", "127.0.0.3:0"]
    assert envs["127.0.0.3:0"] == {
        "HORA_COORDINATOR": address,
        "HORA_JOB_ID": "job-grow",
        "HORA_TOKEN": job_token("tok", "job-grow"),  # the job's token, never the admin's
        # Horovod's placement of the slot it started in: rank 1 of 2 (the
        # rank is also its hint to the coordinator, the size the world it
        # was started for).
        "HORA_SIZE": "2",
        "HORA_RANK": "1",
        "HORA_HOSTNAME": "127.0.0.3",
        "HORA_DATA_PLANE_ADDRESS": "127.0.0.3",
        "HORA_MIN_SIZE": "1",
        "HORA_MAX_SIZE": "2",
        "HORA_ELASTIC_TIMEOUT": "20.0",
        "HORA_RESET_LIMIT": "3",
        "HOROVOD_HOSTNAME": "127.0.0.3",
        "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
    }
    match = re.search(r"^horarun: started worker 127\.0\.0\.3:0 \(pid \d+\)$", stderr, re.M)
    assert match, stderr
    assert ("job-grow", "worker_started", "127.0.0.3", match.group(0)[len("horarun: "):],
            "tok") in recorder.events
    assert "Traceback" not in stderr


@pytest.mark.timeout(40)
def test_failed_worker_blacklists_its_host_and_is_replaced(
        worker_script: Script, discovery: Discovery, run_dir: Path,
        events: tuple[_EventRecorder, str]) -> None:
    recorder, address = events
    discovery.set_hosts("127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1")
    proc = _popen(["--coordinator", address, "--job-id", "job-bl", "--token", "tok",
                   "-np", "2", "--min-np", "2", "--max-np", "2",
                   "--host-discovery-script", discovery.script,
                   sys.executable, worker_script(WORKER), str(run_dir), "127.0.0.3"])
    _wait_for(run_dir / "127.0.0.2.pid", proc)
    _wait_for(run_dir / "127.0.0.4.pid", proc)
    (run_dir / "stop").touch()
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr
    match = re.search(r"^horarun: (worker on 127\.0\.0\.3 \(pid \d+\) exited with code 1; "
                      r"blacklisting 127\.0\.0\.3)$", stderr, re.M)
    assert match, stderr
    assert re.search(r"^horarun: started worker 127\.0\.0\.4:0 \(pid \d+\)$", stderr, re.M)
    assert sorted(_envs_by_label(stdout)) == ["127.0.0.2:0", "127.0.0.3:0", "127.0.0.4:0"]
    assert ("job-bl", "blacklist", "127.0.0.3", match.group(1), "tok") in recorder.events
    # The blacklisted host got no second worker.
    assert stdout.count("[127.0.0.3:0]") == 1


@pytest.mark.timeout(30)
def test_too_few_slots_fail_after_the_elastic_timeout(horarun: Run, worker_script: Script,
                                                      discovery: Discovery) -> None:
    discovery.set_hosts("127.0.0.2:1")
    started = time.monotonic()
    result = horarun([*NO_COORDINATOR, "--min-np", "2", "--host-discovery-script",
                      discovery.script, "--elastic-timeout", "1", sys.executable, "-c", "pass"])
    assert result.returncode == 1, result.stderr
    assert ("horarun: elastic job needs at least 2 workers; discovery offered 1 usable "
            "slot(s) within 1 s") in result.stderr.splitlines()
    assert result.stdout == ""
    assert time.monotonic() - started < 10


@pytest.mark.timeout(30)
def test_below_min_np_after_a_failure_fails_and_stops_the_rest(
        worker_script: Script, discovery: Discovery, run_dir: Path) -> None:
    discovery.set_hosts("127.0.0.2:1", "127.0.0.3:1")
    proc = _popen([*NO_COORDINATOR, "--min-np", "2", "--host-discovery-script",
                   discovery.script, "--elastic-timeout", "1",
                   sys.executable, worker_script(WORKER), str(run_dir), "127.0.0.3"])
    survivor = _wait_for(run_dir / "127.0.0.2.pid", proc)
    _, stderr = _finish(proc)
    assert proc.returncode == 1, stderr
    assert re.search(r"^horarun: worker on 127\.0\.0\.3 \(pid \d+\) exited with code 1; "
                     r"blacklisting 127\.0\.0\.3$", stderr, re.M), stderr
    assert ("horarun: elastic job needs at least 2 workers; only 1 running/available "
            "for 1 s") in stderr.splitlines()
    assert pid_gone(survivor)


@pytest.mark.timeout(30)
def test_removed_host_has_its_worker_stopped(worker_script: Script, discovery: Discovery,
                                             run_dir: Path) -> None:
    discovery.set_hosts("127.0.0.2:1", "127.0.0.3:1")
    proc = _popen([*NO_COORDINATOR, "--min-np", "1", "--host-discovery-script",
                   discovery.script, "-np", "2",
                   sys.executable, worker_script(WORKER), str(run_dir)])
    _wait_for(run_dir / "127.0.0.2.pid", proc)
    leaving = _wait_for(run_dir / "127.0.0.3.pid", proc)
    discovery.set_hosts("127.0.0.2:1")
    deadline = time.monotonic() + 10
    while not pid_gone(leaving) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid_gone(leaving)
    (run_dir / "stop").touch()
    _, stderr = _finish(proc)
    assert proc.returncode == 0, stderr
    assert ("horarun: host 127.0.0.3 is no longer offered by host discovery; stopping "
            "1 worker there") in stderr.splitlines()
    assert "blacklisting" not in stderr


@pytest.mark.timeout(30)
def test_all_workers_succeed_on_a_fixed_host_list(horarun: Run, worker_script: Script,
                                                  tmp_path: Path) -> None:
    script = worker_script("""
        import os
        print("host", os.environ["HORA_HOSTNAME"], "rank", os.environ["HORA_RANK"])
    """)
    logs = tmp_path / "logs"
    result = horarun([*NO_COORDINATOR, "--min-np", "2", "--max-np", "3", "-H",
                      "127.0.0.2:1,127.0.0.3:1", "--output-filename", str(logs),
                      sys.executable, script])
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[127.0.0.2:0]<stdout>:host 127.0.0.2 rank 0",
        "[127.0.0.3:0]<stdout>:host 127.0.0.3 rank 1"]
    assert (logs / "127.0.0.3:0" / "stdout").read_text() == "host 127.0.0.3 rank 1\n"


@pytest.mark.timeout(30)
def test_sigint_is_forwarded_to_elastic_workers(worker_script: Script, discovery: Discovery,
                                                run_dir: Path) -> None:
    discovery.set_hosts("127.0.0.2:1")
    proc = _popen([*NO_COORDINATOR, "--min-np", "1", "-np", "1", "--host-discovery-script",
                   discovery.script, sys.executable, worker_script(WORKER), str(run_dir)])
    pid = _wait_for(run_dir / "127.0.0.2.pid", proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = _finish(proc)
    assert proc.returncode == 130, stderr
    assert "horarun: received SIGINT; forwarding it to 1 worker" in stderr
    assert pid_gone(pid)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, message", [
    (["--min-np", "3", "--max-np", "2", "--host-discovery-script", "d.sh", "true"],
     "--min-np 3 is larger than --max-np 2"),
    (["--min-np", "3", "-H", "127.0.0.2:1,127.0.0.3:1", "true"],
     "--min-np 3 needs 3 slots but the hosts have only 2"),
])
def test_elastic_usage_errors(horarun: Run, argv: list[str], message: str) -> None:
    result = horarun([*NO_COORDINATOR, *argv])
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("generation_ms, code", [(None, 5), (1, 0)])
def test_failure_after_success_counts_unless_outside_the_final_world(
        horarun: Run, worker_script: Script, events: tuple[_EventRecorder, str],
        generation_ms: int | None, code: int) -> None:
    recorder, address = events
    # With a generation formed at 1 ms after the epoch, every worker started
    # after it, so none took part in "the finished world".
    recorder.generation_ms = generation_ms
    script = worker_script("""
        import os, sys, time
        if os.environ["HORA_HOSTNAME"] == "127.0.0.2":
            sys.exit(0)
        time.sleep(1)
        sys.exit(5)
    """)
    result = horarun(["--coordinator", address, "--min-np", "1", "-np", "2", "-H",
                      "127.0.0.2:1,127.0.0.3:1", sys.executable, script])
    assert result.returncode == code, result.stderr
    assert re.search(r"^horarun: worker on 127\.0\.0\.3 \(pid \d+\) exited with code 5 "
                     r"after training finished", result.stderr, re.M), result.stderr
    assert ("does not decide the exit code" in result.stderr) == (code == 0)


FAILING_WORKER = """
    import os
    raise RuntimeError("boom on " + os.environ["HORA_HOSTNAME"])
"""


@pytest.mark.timeout(120)
def test_every_worker_failing_ends_the_job_at_once_with_the_error(
        horarun: Run, worker_script: Script, discovery: Discovery) -> None:
    discovery.set_hosts("127.0.0.2:2", "127.0.0.3:1")
    # The subprocess deadline (90 s) is well inside the elastic timeout
    # (300 s): only failing fast can pass.
    result = horarun([*NO_COORDINATOR, "-np", "3", "--min-np", "2", "--host-discovery-script",
                      discovery.script, "--elastic-timeout", "300",
                      sys.executable, worker_script(FAILING_WORKER)], timeout=90)
    assert result.returncode != 0, result.stderr
    assert re.search(r"^horarun: no worker is left and none can start: every discovered host "
                     r"\(127\.0\.0\.2, 127\.0\.0\.3\) is blacklisted for good .*; the last "
                     r"failure: worker 127\.0\.0\.[23]:\d \(pid \d+\) exited with code 1: "
                     r"RuntimeError: boom on 127\.0\.0\.[23]$", result.stderr, re.M), result.stderr


@pytest.mark.timeout(60)
def test_with_a_cooldown_failing_workers_wait_for_their_hosts(
        horarun: Run, worker_script: Script, discovery: Discovery) -> None:
    discovery.set_hosts("127.0.0.2:1")
    started = time.monotonic()
    result = horarun([*NO_COORDINATOR, "--min-np", "1", "--host-discovery-script",
                      discovery.script, "--elastic-timeout", "3",
                      "--blacklist-cooldown-range", "30", "30",
                      sys.executable, worker_script(FAILING_WORKER)], timeout=40)
    assert result.returncode == 1, result.stderr
    # The host could come back, so the job waited for it up to the elastic timeout.
    assert "blacklisting 127.0.0.2 for 30.0 s" in result.stderr
    assert ("horarun: elastic job needs at least 1 workers; only 0 running/available "
            "for 3 s") in result.stderr.splitlines()
    assert "no worker is left" not in result.stderr
    assert time.monotonic() - started >= 3
