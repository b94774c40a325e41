"""Leases over real gRPC when the coordinator itself stalls (SIGSTOP): its own pause
must not count against workers that kept heartbeating; a silent one is still lost."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import httpx
import pytest
from coordinator_clients import Client, new_job_id

from hora_proto.v1 import rendezvous_pb2 as rpb

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

LEASE_S, STOP_S = 2.0, 4.0


@contextmanager
def heartbeating(client: Client, job: str, worker: str) -> Iterator[threading.Event]:
    """Heartbeats every 0.2 s (calls that time out while the coordinator is stopped are
    retried) until the block ends or the yielded event is set."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                client.rendezvous.Heartbeat(
                    rpb.HeartbeatRequest(job_id=job, worker_id=worker, generation=1),
                    metadata=client.metadata,
                    timeout=1,
                )
            except grpc.RpcError:
                pass
            stop.wait(0.2)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=5)


def job_detail(proc, job: str) -> dict:
    return httpx.get(f"{proc.http_url}/api/v1/jobs/{job}", timeout=5).json()


def test_a_stopped_coordinator_does_not_lose_workers_that_kept_heartbeating(
    coordinator_factory,
):
    proc = coordinator_factory("--lease-s", str(LEASE_S), "--stall-check-interval-s", "0.1")
    client = Client(proc.grpc_address, proc.token)
    healthy, quiet = new_job_id(), new_job_id()
    try:
        client.join_all(healthy, 2)
        client.join_all(quiet, 2)
        with (
            heartbeating(client, healthy, "w0"),
            heartbeating(client, healthy, "w1"),
            heartbeating(client, quiet, "w0"),
            heartbeating(client, quiet, "w1") as quiet_w1,
        ):
            time.sleep(0.5)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                quiet_w1.set()  # from now on w1 of the quiet job says nothing
                time.sleep(STOP_S)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            # The silent member is lost a lease after the coordinator resumed ...
            deadline = time.monotonic() + 4 * LEASE_S
            while job_detail(proc, quiet)["state"] != "failed":
                assert time.monotonic() < deadline, job_detail(proc, quiet)
                time.sleep(0.1)
            # ... while the members that kept heartbeating never were.
            detail = job_detail(proc, healthy)
            assert detail["state"] == "running", detail
            assert [m["state"] for m in detail["members"]] == ["active", "active"]
        lost = [m for m in job_detail(proc, quiet)["members"] if m["state"] == "lost"]
        assert [m["worker_id"] for m in lost] == ["w1"]
        assert lost[0]["cause"].startswith("lease expired")
    finally:
        client.close()
