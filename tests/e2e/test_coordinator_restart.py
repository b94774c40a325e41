"""Training goes on through a coordinator restart (issue 11).

A 2-rank job runs under ``horarun --coordinator`` against a standalone
``hora-coordinator``. Mid-training the coordinator is SIGKILLed and, 3 s
later, started again on the same ports, with or without its journal
(``--state-dir``). Both ranks must finish every step with identical
parameters, in the process they started in, in the generation they started
in (no reset). A step that needs the coordinator (a tensor never negotiated
before) comes due during the outage and must wait for it, not fail.

A SIGSTOP of the coordinator for 10 s must not stop training either.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_elastic_training import (
    SAMPLES,
    discovery,
    finish,
    reports,
    start,
    wait_for_progress,
)
from tests.support.coordinator import CoordinatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

HORARUN = [sys.executable, "-m", "hora.runner.launch"]

WORKER = textwrap.dedent("""
    import hashlib, json, os, sys, time
    from pathlib import Path
    import torch
    import hora.torch as hvd
    from hora import _runtime

    out, steps, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    started = {"pid": os.getpid(), "generation": _runtime.current().engine.world.generation}
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if every and step % every == every - 1:
            # A name never negotiated before: it needs the coordinator.
            hvd.allreduce(loss.detach(), name=f"loss.{step}")
        (out / f"{rank}.step").write_text(str(step))
        time.sleep(0.02)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    (out / f"{rank}.json").write_text(json.dumps({
        **started, "end_pid": os.getpid(), "steps": step + 1, "digest": digest,
        "end_generation": _runtime.current().engine.world.generation}))
    hvd.shutdown()
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def step_of(out: Path, rank: int) -> int:
    """The last step ``rank`` finished, -1 before the first."""
    for _ in range(100):  # an empty read falls between the worker's truncate and write
        try:
            return int((out / f"{rank}.step").read_text())
        except FileNotFoundError:
            return -1
        except ValueError:
            time.sleep(0.001)
    return -1


def wait_steps(out: Path, at_least: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while min(step_of(out, 0), step_of(out, 1)) < at_least:
        if proc.poll() is not None:
            raise AssertionError(f"horarun exited ({proc.returncode}) early:\n"
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"training did not reach step {at_least}"
        time.sleep(0.05)


def start_job(tmp_path: Path, coord: CoordinatorProcess, steps: int,
              new_name_every: int = 40, env: dict[str, str] | None = None) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HORA_TOKEN": coord.token, **(env or {})}
    return subprocess.Popen(
        [*HORARUN, "-np", "2", "--coordinator", coord.grpc_address, "--job-id", "restart-job",
         sys.executable, str(script), str(out), str(steps), str(new_name_every)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def check_finished(tmp_path: Path, proc: subprocess.Popen, steps: int) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the job did not finish:\n{stderr[-6000:]}") from None
    assert proc.returncode == 0, f"horarun failed ({proc.returncode}):\n{stderr[-6000:]}"
    out = tmp_path / "out"
    results = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["steps"] == steps
        assert result["pid"] == result["end_pid"]
        assert result["generation"] == result["end_generation"] == 1, result
    assert results[0]["digest"] == results[1]["digest"], "the ranks' parameters differ"
    return stderr


def restarted(first: CoordinatorProcess, extra: list[str]) -> CoordinatorProcess:
    return CoordinatorProcess(
        ["--grpc-port", str(first.grpc_port), "--http-port", str(first.http_port), *extra],
        token=first.token)


@pytest.mark.parametrize("journal, how", [
    (True, signal.SIGKILL), (False, signal.SIGKILL),
    # A Kubernetes pod being replaced: SIGTERM, the streams end cleanly.
    (True, signal.SIGTERM),
], ids=["state-dir", "no-state-dir", "sigterm-state-dir"])
def test_training_goes_on_through_a_coordinator_kill_and_restart(tmp_path, journal, how):
    extra = ["--state-dir", str(tmp_path / "state")] if journal else []
    steps = 400
    first = CoordinatorProcess(extra).start()
    second = None
    try:
        # A new name (which needs the coordinator) at steps 99, 199, ...: the
        # outage begins well before the first of them.
        proc = start_job(tmp_path, first, steps, new_name_every=100)
        wait_steps(tmp_path / "out", 20, proc)
        first.proc.send_signal(how)
        first.proc.wait(10)
        killed_at = min(step_of(tmp_path / "out", r) for r in (0, 1))
        time.sleep(3)
        # Training went on peer to peer while the coordinator was away.
        assert min(step_of(tmp_path / "out", r) for r in (0, 1)) > killed_at
        second = restarted(first, extra).start()
        stderr = check_finished(tmp_path, proc, steps)
        assert "re-attached to the coordinator" in stderr
        # horarun itself says when the coordinator went and came back.
        assert "horarun: lost the coordinator" in stderr, stderr[-3000:]
        assert "answers again after" in stderr, stderr[-3000:]
        assert ("rebuilt the job from the members' reports" in stderr) is (not journal)
        job = httpx.get(f"{second.http_url}/api/v1/jobs/restart-job").json()
        kinds = [e["kind"] for e in
                 httpx.get(f"{second.http_url}/api/v1/jobs/restart-job/events").json()]
        assert kinds.count("reattach") == 2, kinds
        assert job["generation"] == 1 and job["reset_count"] == 0, job
        # With the journal the history goes on; without, it says it starts again.
        assert job["history_restarted"] is (not journal)
        assert ("generation" in kinds and "join" in kinds) is journal, kinds
        assert ("restored" in kinds) is (not journal), kinds
        assert "Traceback" not in second.log(), second.log()
    except BaseException:
        first.dump_log()
        if second is not None:
            second.dump_log()
        raise
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_coordinator_that_never_comes_back_fails_the_job_after_the_outage_timeout(tmp_path):
    with CoordinatorProcess() as coord:
        proc = start_job(tmp_path, coord, 2000, env={"HORA_COORDINATOR_OUTAGE_TIMEOUT": "3"})
        wait_steps(tmp_path / "out", 30, proc)
        coord.proc.send_signal(signal.SIGKILL)
        coord.proc.wait(10)
        killed = time.monotonic()
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("the workers waited for the coordinator for ever") from None
        waited = time.monotonic() - killed
    assert proc.returncode != 0
    assert "HorovodInternalError" in stderr, stderr[-4000:]
    # Whichever thread notices first (heartbeats, or the re-attach loop) names the setting.
    assert re.search(r"\b3 s\b.*HORA_COORDINATOR_OUTAGE_TIMEOUT", stderr), stderr[-4000:]
    assert waited < 45, waited  # 3 s, plus a slow machine's start and stop


def test_a_stopped_coordinator_never_stops_training(tmp_path):
    steps = 800
    with CoordinatorProcess() as coord:
        # Steady state: every step is cached and agreed peer to peer.
        proc = start_job(tmp_path, coord, steps, new_name_every=0)
        wait_steps(tmp_path / "out", 30, proc)
        os.kill(coord.pid, signal.SIGSTOP)
        try:
            stopped_at = min(step_of(tmp_path / "out", r) for r in (0, 1))
            time.sleep(10)
            moved = min(step_of(tmp_path / "out", r) for r in (0, 1))
        finally:
            os.kill(coord.pid, signal.SIGCONT)
        assert moved > stopped_at + 50, (stopped_at, moved)
        check_finished(tmp_path, proc, steps)
        assert "Traceback" not in coord.log(), coord.log()


def worker_pid_on(host: str) -> int:
    """The pid of the elastic worker started for ``host`` (its HORA_HOSTNAME)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"elastic_worker.py" in cmdline and f"HORA_HOSTNAME={host}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no elastic worker runs for {host}")


@pytest.mark.parametrize("journal", [True, False], ids=["state-dir", "no-state-dir"])
def test_an_elastic_job_loses_a_worker_while_the_coordinator_is_away(tmp_path, journal):
    extra = ["--state-dir", str(tmp_path / "state")] if journal else []
    first = CoordinatorProcess(extra).start()
    second = None
    try:
        script, _ = discovery(tmp_path, ["127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"])
        os.environ["HORA_TOKEN"] = first.token
        try:
            proc = start(tmp_path, script, 3, 2, 3,
                         ["--step-sleep", "0.1", "--epochs", "4"],
                         extra=["--coordinator", first.grpc_address])
        finally:
            del os.environ["HORA_TOKEN"]
        wait_for_progress(tmp_path, 5, 90)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        time.sleep(1)
        os.kill(worker_pid_on("127.0.0.4"), signal.SIGKILL)
        time.sleep(2)
        second = restarted(first, extra).start()
        out, err = finish(proc, 200)
        assert proc.returncode == 0, err[-6000:]
        # The dead worker is found once the coordinator is back (its lease).
        assert "rank 2 (host 127.0.0.4" in err and "was lost" in err, err[-4000:]
        done = reports(tmp_path)
        assert len(done) == 2, (out[-2000:], err[-4000:])
        for report in done:
            assert report["pid"] == report["start_pid"]  # the survivors never restarted
            assert report["size"] == 2 and report["params_identical"]
            assert report["sizes"][0] == 3 and report["sizes"][-1] == 2, report["sizes"]
            for epoch, applied in enumerate(report["applied"]):
                assert sorted(set(applied)) == list(range(SAMPLES)), f"epoch {epoch} lost samples"
        assert done[0]["params"] == done[1]["params"]
        assert "Traceback" not in second.log(), second.log()
    except BaseException:
        first.dump_log()
        if second is not None:
            second.dump_log()
        raise
    finally:
        first.stop()
        if second is not None:
            second.stop()
