"""Workers on other machines, started over ssh (``-H h1:2,h2:2``).

No machine here runs sshd, so ``HORA_SSH_COMMAND`` points at
``fake_ssh.py``, which runs the remote command on this machine as sshd
would elsewhere: its own session, a fresh environment, a stdin that closes
with the connection. Everything else is real: horarun, the remote command
line and its guard, the coordinator, Gloo and the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher_helpers import HORARUN, pid_gone

pytestmark = pytest.mark.multiprocess

FAKE_SSH = Path(__file__).with_name("fake_ssh.py")
# For workers that never call hvd.init(): a coordinator nobody listens on,
# at an address that is not loopback (which remote workers could not reach).
NO_COORDINATOR = ["--coordinator", "192.0.2.1:9"]

TRAIN = """
import json, os, torch
import horovod.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
print(json.dumps({
    "rank": hvd.rank(), "local_rank": hvd.local_rank(), "size": hvd.size(),
    "ssh_host": os.environ.get("FAKE_SSH_HOST"), "hostname": os.environ["HOROVOD_HOSTNAME"],
    "cwd": os.getcwd(), "flag": os.environ.get("MY_FLAG"), "home": os.environ.get("HOME"),
    "sum": total.item(),
}))
hvd.shutdown()
"""

# Writes its pid, then rank 3 fails once every rank has written one.
FAIL_ONE = """
import os, sys, time
from pathlib import Path

run_dir, rank = Path(sys.argv[1]), os.environ["HOROVOD_RANK"]
(run_dir / f"{rank}.pid.tmp").write_text(str(os.getpid()))
(run_dir / f"{rank}.pid.tmp").rename(run_dir / f"{rank}.pid")
if rank == "3":
    while len(list(run_dir.glob("*.pid"))) < 4:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(60)
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HORA_SSH_COMMAND": f"{sys.executable} {FAKE_SSH}",
            "FAKE_SSH_LOG": str(tmp_path / "ssh.log"), **extra}


def _ssh_log(tmp_path: Path) -> list[tuple[str, str, str]]:
    lines = (tmp_path / "ssh.log").read_text().splitlines()
    return [tuple(json.loads(line)) for line in lines]  # type: ignore[misc]


def _pids(run_dir: Path, count: int, proc: subprocess.Popen[str]) -> list[int]:
    deadline = time.monotonic() + 20
    while len(list(run_dir.glob("*.pid"))) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    return [int(p.read_text()) for p in sorted(run_dir.glob("*.pid"))]


def _all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not all(pid_gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.timeout(120)
def test_horovodrun_on_two_hosts_runs_the_script_unchanged(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    done = subprocess.run(
        [*HORARUN, "--horovod-compat", "-np", "4", "-H", "node-a:2,node-b:2",
         "--network-interface", "lo", sys.executable, str(script)],
        capture_output=True, text=True, timeout=100, cwd=tmp_path, stdin=subprocess.DEVNULL,
        env=_env(tmp_path, MY_FLAG="on"))
    assert done.returncode == 0, done.stderr
    results = {}
    for line in done.stdout.splitlines():
        label, _, payload = line.partition("<stdout>:")
        results[int(label.strip("[]"))] = json.loads(payload)
    assert sorted(results) == [0, 1, 2, 3], done.stdout
    for rank, out in results.items():
        host = "node-a" if rank < 2 else "node-b"
        assert (out["ssh_host"], out["hostname"]) == (host, host)
        assert (out["rank"], out["local_rank"], out["size"]) == (rank, rank % 2, 4)
        assert out["sum"] == 6.0
        # The launcher's directory and variables travel; its HOME does not.
        assert out["cwd"] == str(tmp_path)
        assert out["flag"] == "on"
        assert out["home"] == "/nonexistent-fake-home"
    log = _ssh_log(tmp_path)
    checks = sorted(host for host, _options, command in log if command == "true")
    assert checks == ["node-a", "node-b"]  # each host checked once before the start
    started = sorted(host for host, _options, command in log if command != "true")
    assert started == ["node-a", "node-a", "node-b", "node-b"]
    assert all("BatchMode=yes" in options for _host, options, _command in log)


@pytest.mark.timeout(60)
def test_a_failed_remote_worker_stops_the_others_on_their_hosts(tmp_path: Path) -> None:
    script = tmp_path / "fail_one.py"
    script.write_text(FAIL_ONE)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen(
        [*HORARUN, *NO_COORDINATOR, "-np", "4", "-H", "node-a:2,node-b:2",
         "--network-interface", "lo", sys.executable, str(script), str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        env=_env(tmp_path))
    try:
        pids = _pids(run_dir, 4, proc)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait(5)
    assert proc.returncode == 3, stderr
    assert "rank 3" in stderr and "host node-b" in stderr and "exited with code 3" in stderr
    # Signals to the ssh processes cannot reach the remote sessions: the
    # guard on each host stopped its worker when the connection closed.
    assert _all_gone(pids), [pid for pid in pids if not pid_gone(pid)]


@pytest.mark.timeout(60)
def test_remote_workers_end_when_horarun_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(FAIL_ONE.replace('if rank == "3":', "if False:"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen(
        [*HORARUN, *NO_COORDINATOR, "-np", "4", "-H", "node-a:2,node-b:2",
         "--network-interface", "lo", sys.executable, str(script), str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        env=_env(tmp_path), start_new_session=True)
    try:
        pids = _pids(run_dir, 4, proc)
        proc.send_signal(signal.SIGKILL)  # no cleanup of its own can run
        proc.wait(5)
        # The ssh processes lose their stdin with horarun and end their sessions.
        assert _all_gone(pids), [pid for pid in pids if not pid_gone(pid)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_an_unreachable_host_fails_before_any_worker_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [*HORARUN, *NO_COORDINATOR, "-np", "2", "-H", "node-a:1,unreachable-b:1",
         "--network-interface", "lo", sys.executable, "-c", "print('started')"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        env=_env(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "cannot run commands over ssh on unreachable-b: exit code 255" in done.stderr
    assert "Could not resolve hostname unreachable-b" in done.stderr
    assert "started" not in done.stdout
    assert all(command == "true" for _host, _options, command in _ssh_log(tmp_path))


# Elastic: writes DIR/HOST.pid, then waits for DIR/stop.
WAIT_FOR_STOP = """
import os, sys, time
from pathlib import Path

run_dir, host = Path(sys.argv[1]), os.environ["HORA_HOSTNAME"]
(run_dir / f"{host}.tmp").write_text(str(os.getpid()))
(run_dir / f"{host}.tmp").rename(run_dir / f"{host}.pid")
deadline = time.monotonic() + 25
while not (run_dir / "stop").exists():
    if time.monotonic() > deadline:
        sys.exit(2)
    time.sleep(0.02)
"""


def _elastic(tmp_path: Path, hosts: str, workers: int, *flags: str
             ) -> tuple[int, str, Path]:
    """Runs an elastic job on ``hosts`` until ``workers`` started, then lets them
    finish; returns horarun's exit code, its stderr and the run directory."""
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOR_STOP)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\nprintf '{hosts}'\n")
    discover.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen(
        [*HORARUN, *NO_COORDINATOR, "--host-discovery-script", str(discover),
         "--min-np", str(workers), "-np", str(workers), *flags,
         sys.executable, str(script), str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        env=_env(tmp_path))
    try:
        _pids(run_dir, workers, proc)
        (run_dir / "stop").touch()
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait(5)
    return proc.returncode, stderr, run_dir


@pytest.mark.timeout(60)
def test_an_elastic_job_starts_discovered_hosts_over_ssh(tmp_path: Path) -> None:
    code, stderr, run_dir = _elastic(tmp_path, "node-a:1\\nnode-b:1\\n", 2,
                                     "--network-interface", "lo")
    assert code == 0, stderr
    assert sorted(p.name for p in run_dir.glob("*.pid")) == ["node-a.pid", "node-b.pid"]
    started = sorted(host for host, _options, command in _ssh_log(tmp_path)
                     if command != "true")
    assert started == ["node-a", "node-b"]


@pytest.mark.timeout(60)
def test_an_elastic_job_on_loopback_ignores_other_machines_and_says_why(tmp_path: Path) -> None:
    code, stderr, _run_dir = _elastic(tmp_path, "127.0.0.2:1\\nnode-z:1\\n", 1)
    assert code == 0, stderr
    assert "discovered host node-z is not this machine" in stderr
    assert "pass --network-interface" in stderr
    assert not (tmp_path / "ssh.log").exists()


TLS_TRAIN = """
import json, os, torch
import hora.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
print(json.dumps({"rank": hvd.rank(), "sum": total.item(),
                  "ca": os.environ["HORA_TLS_CA"].startswith("-----BEGIN CERTIFICATE-----")}))
hvd.shutdown()
"""


@pytest.mark.timeout(120)
def test_a_tls_job_across_machines_needs_no_setup(tmp_path: Path, netns) -> None:
    # In a namespace of the test's own, the job listens on a non-loopback address
    # (netns.address on its interface hora0), as a job across machines does.
    script = tmp_path / "train.py"
    script.write_text(TLS_TRAIN)
    done = subprocess.run(
        [*netns.prefix, *HORARUN, "--tls", "-np", "2", "-H", "node-a:1,node-b:1",
         "--network-interface", "hora0", sys.executable, str(script)],
        capture_output=True, text=True, timeout=100, cwd=tmp_path, stdin=subprocess.DEVNULL,
        env=_env(tmp_path))
    assert done.returncode == 0, done.stderr
    results = [json.loads(line.partition("<stdout>:")[2]) for line in done.stdout.splitlines()]
    assert sorted((r["rank"], r["sum"], r["ca"]) for r in results) == [(0, 2.0, True),
                                                                       (1, 2.0, True)]
    # The CA travelled in the ssh connection's environment line; the coordinator
    # serves TLS on the job's address, and its API wants the token horarun made up.
    address = re.escape(netns.address)
    assert re.search(rf"coordinator gRPC {address}:\d+ \(TLS\), HTTP https://{address}:\d+, "
                     rf"job \S+; the HTTP API wants the job token: "
                     rf"https://{address}:\d+/api/v1/jobs\?token=[0-9a-f]{{32}}",
                     done.stderr), done.stderr
