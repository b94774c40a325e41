"""The coordinator as a process over gRPC: leases and stalls on short timings, flags, signals,
tokens, and the embedded coordinator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from coordinator_clients import Client, new_job_id, open_world, tensor

from hora_coordinator import CoordinatorSettings, EmbeddedCoordinator
from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


# ---- timing: own coordinators with short leases and checks ------------------------------


def test_lease_expiry_loses_a_silent_member(coordinator_factory):
    proc = coordinator_factory("--lease-s", "1", "--stall-check-interval-s", "0.1")
    client = Client(proc.grpc_address, proc.token)
    try:
        job = new_job_id()
        views = client.join_all(job, 2)
        silent = next(v.rank for v in views if v.members[v.rank].worker_id == "w1")
        stream = client.stream(job, "w0", 1)  # w0 renews through its stream; w1 is silent
        for _ in range(15):
            stream.send()
            time.sleep(0.1)
            if (
                client.rendezvous.Heartbeat(
                    rpb.HeartbeatRequest(job_id=job, worker_id="w0", generation=1),
                    metadata=client.metadata,
                    timeout=5,
                ).job_state
                == rpb.JOB_STATE_FAILED
            ):
                break
        lost = stream.event()
        assert lost.type == npb.EVENT_TYPE_MEMBER_LOST and lost.rank == silent
        assert lost.message.startswith("lease expired (no heartbeat for 1.")
        beat = client.rendezvous.Heartbeat(
            rpb.HeartbeatRequest(job_id=job, worker_id="w0", generation=1),
            metadata=client.metadata,
            timeout=5,
        )
        assert beat.job_state == rpb.JOB_STATE_FAILED and "lease expired" in beat.failure
        assert beat.lease_ms == 1000
        stream.cancel()
    finally:
        client.close()


def test_stall_warning_then_stall_shutdown(coordinator_factory):
    proc = coordinator_factory("--lease-s", "10", "--stall-check-interval-s", "0.05")
    client = Client(proc.grpc_address, proc.token)
    try:
        job, workers, streams = open_world(client, 2, stall_warning_ms=200, stall_shutdown_ms=900)
        streams[0].send(tensor("slow"))
        warning = streams[0].event(timeout=3)
        assert warning.type == npb.EVENT_TYPE_STALL_WARNING
        assert list(warning.tensor_names) == ["slow"] and list(warning.missing_ranks) == [1]
        streams[1].assert_silent(0.1)
        events = [streams[0].event(timeout=3)]
        while events[-1].type == npb.EVENT_TYPE_STALL_WARNING:
            events.append(streams[0].event(timeout=3))
        assert 2 <= len(events) <= 5  # once per warning interval, not once per check
        assert events[-1].type == npb.EVENT_TYPE_JOB_FAILED
        assert "tensor 'slow'" in events[-1].message and "missing ranks: 1" in events[-1].message
        assert "WARNING" in proc.log() and "'slow'" in proc.log()
        for s in streams:
            s.cancel()
    finally:
        client.close()


# ---- the process ---------------------------------------------------------------------


def test_bogus_flag_is_a_usage_error():
    done = subprocess.run(
        [sys.executable, "-m", "hora_coordinator", "--bogus"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "usage: hora-coordinator" in done.stderr
    assert "unrecognized arguments: --bogus" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_sigterm_stops_cleanly_after_announcing_itself(coordinator_factory):
    proc = coordinator_factory()
    assert (
        f"hora-coordinator: gRPC on 127.0.0.1:{proc.grpc_port}, "
        f"HTTP on http://127.0.0.1:{proc.http_port}"
    ) in proc.log()
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


@pytest.mark.parametrize("env_token", ["from-env", None])
def test_token_from_environment_or_generated(tmp_path, env_token):
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if k != "HORA_TOKEN"}
    if env_token:
        env["HORA_TOKEN"] = env_token
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hora_coordinator",
            "--ready-file",
            str(ready),
            "--log-level",
            "warning",
        ],
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid
        if env_token:
            assert info["token"] == env_token
        else:
            assert len(info["token"]) >= 16
        client = Client(f"127.0.0.1:{info['grpc_port']}", info["token"])
        assert client.join(new_job_id(), "solo", 1).size == 1
        client.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        assert b"Traceback" not in proc.stderr.read()


def test_embedded_coordinator_serves_and_stops():
    embedded = EmbeddedCoordinator(CoordinatorSettings())
    assert embedded.token  # generated before start, so a launcher can pass it on
    embedded.start()
    try:
        assert embedded.grpc_address == f"127.0.0.1:{embedded.grpc_port}"
        client = Client(embedded.grpc_address, embedded.token)
        assert client.join(new_job_id(), "solo", 1).size == 1
        client.close()
        assert (
            httpx.get(f"http://127.0.0.1:{embedded.http_port}/readyz", timeout=5).status_code == 200
        )
    finally:
        embedded.stop()
