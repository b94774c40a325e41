"""End-to-end tests: ``horarun`` as a real process with real worker processes.

Workers are plain Python scripts that never call ``hvd.init()``, so all but
the coordinator test point ``--coordinator`` at an address nobody serves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from launcher_helpers import HORARUN, NO_COORDINATOR, pid_gone

from hora_proto.auth import job_token

pytestmark = pytest.mark.e2e

Run = Callable[..., "subprocess.CompletedProcess[str]"]
Script = Callable[[str], str]

PRINT_ENV = """
    import json, os
    print(json.dumps({k: v for k, v in os.environ.items()
                      if k.startswith(("HORA_", "HOROVOD_"))
                      or k in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")}))
"""

# Each rank writes its pid to DIR/RANK.pid (atomically) and then waits.
PID_FILE = """
    import os, pathlib, sys
    directory = pathlib.Path(sys.argv[1])
    rank = int(os.environ["HORA_RANK"])
    size = int(os.environ["HORA_SIZE"])
    tmp = directory / f"{rank}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(directory / f"{rank}.pid")
"""


def _envs_by_rank(stdout: str) -> dict[int, dict[str, str]]:
    envs = {}
    for line in stdout.splitlines():
        match = re.fullmatch(r"\[(\d+)\]<stdout>:(\{.*\})", line)
        assert match, f"unexpected output line {line!r}"
        envs[int(match.group(1))] = json.loads(match.group(2))
    return envs


def _wait_for_pids(directory: Path, count: int, proc: subprocess.Popen[str],
                   timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(directory.glob("*.pid"))
        if len(files) == count:
            return [int(f.read_text()) for f in files]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"only {len(list(directory.glob('*.pid')))} of {count} workers started")


@pytest.mark.timeout(30)
def test_env_single_host(horarun: Run, worker_script: Script) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "3", "--job-id", "job-env", "--token", "tok",
                      "--fusion-threshold-mb", "1", "--cycle-time-ms", "5",
                      sys.executable, worker_script(PRINT_ENV)])
    assert result.returncode == 0, result.stderr
    envs = _envs_by_rank(result.stdout)
    assert sorted(envs) == [0, 1, 2]
    for rank, env in envs.items():
        assert env == {
            "HORA_COORDINATOR": "127.0.0.1:1",
            "HORA_JOB_ID": "job-env",
            "HORA_TOKEN": job_token("tok", "job-env"),  # never the admin token
            "HORA_SIZE": "3",
            "HORA_RANK": str(rank),
            "HORA_HOSTNAME": "localhost",
            "HORA_DATA_PLANE_ADDRESS": "127.0.0.1",
            "HORA_FUSION_THRESHOLD": str(1024 * 1024),
            "HORA_CYCLE_TIME": "5.0",
            "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": "3",
            "HOROVOD_LOCAL_RANK": str(rank),
            "HOROVOD_LOCAL_SIZE": "3",
            "HOROVOD_CROSS_RANK": "0",
            "HOROVOD_CROSS_SIZE": "1",
            "HOROVOD_HOSTNAME": "localhost",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": env["OMP_NUM_THREADS"],  # inherited if the caller set it
        }
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
def test_env_two_simulated_hosts(horarun: Run, worker_script: Script) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "3", "-H", "127.0.0.2:2,127.0.0.3:1",
                      sys.executable, worker_script(PRINT_ENV)])
    assert result.returncode == 0, result.stderr
    envs = _envs_by_rank(result.stdout)
    seen = {rank: (env["HORA_HOSTNAME"], env["HOROVOD_HOSTNAME"], env["HORA_DATA_PLANE_ADDRESS"],
                   env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"],
                   env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"])
            for rank, env in envs.items()}
    assert seen == {
        0: ("127.0.0.2", "127.0.0.2", "127.0.0.2", "0", "2", "0", "2"),
        1: ("127.0.0.2", "127.0.0.2", "127.0.0.2", "1", "2", "0", "1"),
        2: ("127.0.0.3", "127.0.0.3", "127.0.0.3", "0", "1", "1", "2"),
    }
    assert {env["HORA_SIZE"] for env in envs.values()} == {"3"}


@pytest.mark.timeout(30)
def test_hostfile(horarun: Run, worker_script: Script, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two local names\n{socket.gethostname()} slots=1\n127.0.0.5:1\n")
    result = horarun([*NO_COORDINATOR, "-np", "2", "--hostfile", str(hostfile),
                      sys.executable, worker_script(PRINT_ENV)])
    assert result.returncode == 0, result.stderr
    envs = _envs_by_rank(result.stdout)
    assert envs[0]["HORA_HOSTNAME"] == socket.gethostname()
    assert envs[0]["HORA_DATA_PLANE_ADDRESS"] == "127.0.0.1"
    assert envs[1]["HORA_HOSTNAME"] == "127.0.0.5"
    assert envs[1]["HOROVOD_CROSS_RANK"] == "1"


OUTPUT = """
    import os, sys
    rank = os.environ["HORA_RANK"]
    print(f"out {rank} a")
    print(f"err {rank} \\u00e9", file=sys.stderr)
    sys.stdout.buffer.write(b"bad \\xff bytes\\n")
    sys.stdout.write(f"partial {rank}")
"""


@pytest.mark.timeout(30)
def test_output_prefixes(horarun: Run, worker_script: Script) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "2", sys.executable, worker_script(OUTPUT)])
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        rank_out = [line for line in result.stdout.splitlines()
                    if line.startswith(f"[{rank}]")]
        assert rank_out == [f"[{rank}]<stdout>:out {rank} a",
                            f"[{rank}]<stdout>:bad \ufffd bytes",
                            f"[{rank}]<stdout>:partial {rank}"]
        assert f"[{rank}]<stderr>:err {rank} \u00e9" in result.stderr.splitlines()
    assert "<stderr>" not in result.stdout and "<stdout>" not in result.stderr


@pytest.mark.timeout(30)
def test_disable_prefix_and_output_files(horarun: Run, worker_script: Script,
                                         tmp_path: Path) -> None:
    out_dir = tmp_path / "logs"
    result = horarun([*NO_COORDINATOR, "-np", "2", "--disable-prefix",
                      "--output-filename", str(out_dir), sys.executable, worker_script(OUTPUT)])
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "bad \ufffd bytes", "bad \ufffd bytes", "out 0 a", "out 1 a", "partial 0", "partial 1"]
    assert (out_dir / "rank.1" / "stdout").read_text(encoding="utf-8") == \
        "out 1 a\nbad \ufffd bytes\npartial 1\n"
    assert (out_dir / "rank.0" / "stderr").read_text(encoding="utf-8") == "err 0 \u00e9\n"


@pytest.mark.timeout(30)
def test_failing_rank_sets_exit_code_and_is_named(horarun: Run, worker_script: Script) -> None:
    script = worker_script("""
        import os, sys, time
        if os.environ["HORA_RANK"] == "1":
            sys.exit(3)
        time.sleep(30)
    """)
    started = time.monotonic()
    result = horarun([*NO_COORDINATOR, "-np", "3", sys.executable, script])
    assert result.returncode == 3
    assert time.monotonic() - started < 10
    assert re.search(r"^horarun: rank 1 \(pid \d+, host localhost\) exited with code 3; "
                     r"stopping the other 2 workers$", result.stderr, re.M), result.stderr


@pytest.mark.timeout(30)
def test_all_ranks_succeed(horarun: Run) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "2", sys.executable, "-c", "pass"])
    assert (result.returncode, result.stdout) == (0, "")


@pytest.mark.timeout(30)
def test_sigkilled_rank_stops_the_others(horarun: Run, worker_script: Script,
                                         tmp_path: Path) -> None:
    script = worker_script(PID_FILE + """
    import signal, time
    if rank == 1:
        # Die only once every rank is up, so that there are others to stop.
        deadline = time.monotonic() + 20
        while len(list(directory.glob("*.pid"))) < size and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    """)
    started = time.monotonic()
    result = horarun([*NO_COORDINATOR, "-np", "3", sys.executable, script, str(tmp_path)])
    elapsed = time.monotonic() - started
    assert result.returncode == 137, result.stderr
    assert elapsed < 10
    assert re.search(r"^horarun: rank 1 \(pid \d+, host localhost\) was killed by SIGKILL; "
                     r"stopping the other 2 workers$", result.stderr, re.M), result.stderr
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 3
    assert all(pid_gone(pid) for pid in pids)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_horarun_is_forwarded_once(worker_script: Script, tmp_path: Path,
                                             signum: signal.Signals, code: int) -> None:
    handlers = textwrap.dedent("""
        import signal, sys, time

        def stop(signum, frame):
            print(f"got {signal.Signals(signum).name}", flush=True)
            sys.exit(0)

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
    """)
    script = worker_script(handlers + textwrap.dedent(PID_FILE) + "time.sleep(60)\n")
    proc = subprocess.Popen([*HORARUN, *NO_COORDINATOR, "-np", "2", sys.executable, script,
                             str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        # The pid files are written after the handlers are in place.
        pids = _wait_for_pids(tmp_path, 2, proc)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=15)
    finally:
        proc.kill()
        proc.wait(5)
    assert proc.returncode == code, stderr
    assert f"horarun: received {signum.name}; forwarding it to 2 workers" in stderr
    got = sorted(line for line in stdout.splitlines() if "got" in line)
    assert got == [f"[0]<stdout>:got {signum.name}", f"[1]<stdout>:got {signum.name}"]
    assert all(pid_gone(pid) for pid in pids)


@pytest.mark.timeout(30)
def test_second_sigint_kills_without_grace(worker_script: Script, tmp_path: Path) -> None:
    script = worker_script(textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    """) + textwrap.dedent(PID_FILE) + "time.sleep(60)\n")
    proc = subprocess.Popen([*HORARUN, *NO_COORDINATOR, "-np", "2", sys.executable, script,
                             str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=15)
        elapsed = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait(5)
    assert proc.returncode == 130, stderr
    assert elapsed < 3  # well inside the 5 s grace period the first SIGINT started
    assert "horarun: received SIGINT again; not waiting any longer" in stderr
    assert re.search(r"^horarun: 2 workers still running; killing rank 0 \(pid \d+\), "
                     r"1 \(pid \d+\)$", stderr, re.M), stderr
    assert all(pid_gone(pid) for pid in pids)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "--bogus-flag", sys.executable, "-c", "pass"],
     "unrecognized arguments: --bogus-flag"),
    ([sys.executable, "-c", "pass"], "the following arguments are required: -np/--num-proc"),
    (["-np", "2"], "no command given"),
    (["-np", "2", "--coordinator", "localhost", "true"], "expected HOST:PORT"),
])
def test_usage_errors(horarun: Run, argv: list[str], message: str) -> None:
    result = horarun(argv)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: horarun -np N [options] COMMAND [ARGS...]")
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.timeout(30)
def test_help(horarun: Run) -> None:
    result = horarun(["--help"])
    assert result.returncode == 0
    for flag in ("-np", "--hostfile", "--coordinator", "--fusion-threshold-mb",
                 "--stall-check-warning-time-seconds", "--disable-prefix", "--min-np",
                 "--max-np", "--host-discovery-script", "--slots-per-host", "--reset-limit",
                 "--blacklist-cooldown-range", "--elastic-timeout"):
        assert flag in result.stdout


@pytest.mark.timeout(30)
def test_a_remote_host_ssh_cannot_reach_is_a_clear_error(horarun: Run, tmp_path: Path) -> None:
    fake_ssh = Path(__file__).with_name("fake_ssh.py")
    env = {**os.environ, "HORA_SSH_COMMAND": f"{sys.executable} {fake_ssh}"}
    result = horarun(["--coordinator", "192.0.2.1:9", "-np", "2", "-H",
                      "localhost:1,unreachable-7:1", "--network-interface", "lo", "true"], env=env)
    assert result.returncode == 1
    assert "cannot run commands over ssh on unreachable-7" in result.stderr
    assert "password-less ssh" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
def test_a_loopback_coordinator_with_remote_hosts_is_a_clear_error(horarun: Run) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "2", "-H", "localhost:1,node-a:1",
                      "--network-interface", "lo", "true"])
    assert result.returncode == 2
    assert "--coordinator 127.0.0.1:1 is a loopback address" in result.stderr
    assert "node-a cannot reach" in result.stderr


@pytest.mark.timeout(30)
def test_an_unknown_network_interface_is_a_clear_error(horarun: Run) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "1", "--network-interface", "nosuch9", "true"])
    assert result.returncode == 2
    assert "--network-interface nosuch9" in result.stderr and "lo" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
def test_too_few_slots_is_a_clear_error(horarun: Run) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "4", "-H", "127.0.0.2:1,127.0.0.3:2", "true"])
    assert result.returncode == 2
    assert "-np 4 needs 4 slots but the hosts have only 3" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
def test_missing_hostfile_is_a_clear_error(horarun: Run, tmp_path: Path) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "1", "--hostfile", str(tmp_path / "nope"), "true"])
    assert result.returncode == 2
    assert "--hostfile: cannot read" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
def test_command_not_found(horarun: Run) -> None:
    result = horarun([*NO_COORDINATOR, "-np", "2", "no-such-command-hora-test"])
    assert result.returncode == 127
    assert "horarun: cannot start rank 0 on localhost" in result.stderr
    assert "Traceback" not in result.stderr


def _coordinator_importable() -> bool:
    try:
        import hora_coordinator.server  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _coordinator_importable(),
                    reason="hora_coordinator.server is not importable yet (written concurrently)")
def test_embedded_coordinator(horarun: Run, worker_script: Script) -> None:
    with socket.socket() as sock:  # a free port for --coordinator-http-port
        sock.bind(("127.0.0.1", 0))
        http_port = sock.getsockname()[1]
    # Rank 0 checks that the REST API is up while the job runs.
    script = worker_script(PRINT_ENV + f"""
    import urllib.request
    if os.environ["HORA_RANK"] == "0":
        with urllib.request.urlopen("http://127.0.0.1:{http_port}/healthz", timeout=10) as r:
            print(json.dumps({{"healthz": r.status}}))
    """)
    result = horarun(["-np", "2", "--job-id", "job-embedded", "--coordinator-http-port",
                      str(http_port), sys.executable, script])
    assert result.returncode == 0, result.stderr
    match = re.search(r"^horarun: coordinator gRPC (127\.0\.0\.1:\d+), "
                      rf"HTTP http://127\.0\.0\.1:{http_port}, job job-embedded$",
                      result.stderr, re.M)
    assert match, result.stderr
    lines = [line for line in result.stdout.splitlines() if "healthz" not in line]
    envs = _envs_by_rank("\n".join(lines))
    assert {env["HORA_COORDINATOR"] for env in envs.values()} == {match.group(1)}
    assert '[0]<stdout>:{"healthz": 200}' in result.stdout

FAKE_COORDINATOR = str(Path(__file__).parent / "fake_coordinator")


def _with_fake_coordinator(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [FAKE_COORDINATOR, os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


@pytest.mark.timeout(30)
def test_embeds_coordinator_and_stops_it(horarun: Run, worker_script: Script,
                                         tmp_path: Path) -> None:
    # The launcher's side of embedding, against a stand-in coordinator.
    stopped = tmp_path / "stopped"
    result = horarun(["-np", "2", "--job-id", "job-fake", "--token", "tok-fake",
                      "--coordinator-http-port", "0", sys.executable, worker_script(PRINT_ENV)],
                     env=_with_fake_coordinator(FAKE_COORDINATOR_STOPPED=str(stopped)))
    assert result.returncode == 0, result.stderr
    match = re.search(r"^horarun: coordinator gRPC (127\.0\.0\.1:\d+), "
                      r"HTTP http://127\.0\.0\.1:\d+, job job-fake$", result.stderr, re.M)
    assert match, result.stderr
    envs = _envs_by_rank(result.stdout)
    assert {env["HORA_COORDINATOR"] for env in envs.values()} == {match.group(1)}
    assert stopped.read_text() == f"{match.group(1)} tok-fake"


@pytest.mark.timeout(30)
def test_coordinator_that_cannot_start(horarun: Run) -> None:
    result = horarun(["-np", "1", "true"], env=_with_fake_coordinator(FAKE_COORDINATOR_FAIL="1"))
    assert result.returncode == 1
    assert ("horarun: error: cannot start the embedded coordinator: OSError: address already "
            "in use (simulated); start one with hora-coordinator and pass --coordinator "
            "HOST:PORT") in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(150)
def test_version_and_check_build_as_horovodrun_prints_them(horarun: Run, tmp_path: Path) -> None:
    version = horarun(["--version"])
    assert version.returncode == 0 and version.stdout.startswith("hora "), version
    # Frameworks are probed by importing them: a broken TensorFlow and a Keras that kills
    # the interpreter on import (shadowing any real ones) are reported missing, not fatal.
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(
        "raise ImportError('a broken TensorFlow install (simulated)')\n")
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text("import os\nos._exit(3)\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    report = horarun(["-cb"], timeout=140, env={**os.environ, "PYTHONPATH": path})
    assert report.returncode == 0, report.stderr
    lightning = importlib.util.find_spec("lightning") is not None
    for line in ("[X] PyTorch\n", "[ ] TensorFlow", "[ ] Keras", "[ ] MXNet", "[X] Gloo",
                 "[ ] MPI", "NCCL", f"[{'X' if lightning else ' '}] PyTorch Lightning"):
        assert line in report.stdout, report.stdout
