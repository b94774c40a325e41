"""Leases over real gRPC: renewed by calls or on the negotiation stream, sized to the
load, and never lost to the coordinator's own pause (SIGSTOP) while a silent member
still is."""

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

from hora_proto.v1 import negotiation_pb2 as npb
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


def metric(proc, name: str, **labels: str) -> float | None:
    """One sample of ``/metrics``, or None when the series is absent."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(f"{proc.http_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name}{{") and line.split("}")[0].split("{")[1] == wanted:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_heartbeats_on_the_stream_renew_the_lease_and_are_answered_in_order(
    coordinator_factory,
):
    proc = coordinator_factory("--lease-s", "1", "--stall-check-interval-s", "0.1")
    client = Client(proc.grpc_address, proc.token)
    try:
        job = new_job_id()
        views = client.join_all(job, 2)
        silent = next(v.rank for v in views if v.members[v.rank].worker_id == "w1")
        beating = client.stream(job, "w0", 1)  # renews only with stream heartbeats
        quiet = client.stream(job, "w1", 1)  # opens its stream, then says nothing
        answers = []
        for sequence in range(1, 40):
            beating.heartbeat(sequence)
            message = beating.recv()
            if message.WhichOneof("kind") == "event":
                lost = message.event
                break
            answers.append(message.heartbeat)
            time.sleep(0.1)
        else:
            raise AssertionError("the silent member was never lost")
        assert [a.sequence for a in answers] == list(range(1, len(answers) + 1))
        assert answers[0].state.job_state == rpb.JOB_STATE_RUNNING
        assert (answers[0].state.lease_ms, answers[0].state.interval_ms) == (1000, 250)
        assert lost.type == npb.EVENT_TYPE_MEMBER_LOST and lost.rank == silent
        assert lost.message.startswith("lease expired")
        detail = job_detail(proc, job)
        assert [m["state"] for m in detail["members"]][1 - silent] == "active"
        stream_beats = metric(proc, "hora_heartbeats_total", job_id=job, transport="stream")
        assert stream_beats is not None and stream_beats >= len(answers)
        assert metric(proc, "hora_heartbeats_total", job_id=job, transport="unary") == 0
        # Heartbeats are not negotiation: the counter that must stay 0 in steady state does.
        assert metric(proc, "hora_negotiation_messages_total", job_id=job) == 0
        beating.cancel()
        quiet.cancel()
    finally:
        client.close()


def test_past_its_heartbeat_budget_the_coordinator_stretches_the_big_jobs_leases_only(
    coordinator_factory,
):
    # A budget of 20 heartbeats/s: 30 members at 2/s would ask 60. The small job
    # (2 members, 4/s) keeps the shortest lease; the big one gets the other 16/s.
    proc = coordinator_factory(
        "--lease-s", "2", "--heartbeat-budget", "20", "--stall-check-interval-s", "0.1"
    )
    client = Client(proc.grpc_address, proc.token)
    try:
        big, small = new_job_id(), new_job_id()
        client.join_all(big, 30)
        client.join_all(small, 2)
        time.sleep(0.5)  # a few periodic checks: the plan is made there
        small_reply, big_reply = client.heartbeat(small, "w0", 1), client.heartbeat(big, "w0", 1)
        assert (small_reply.interval_ms, small_reply.lease_ms) == (500, 2000)
        assert big_reply.interval_ms == 30 * 1000 // 16
        assert big_reply.lease_ms == 4 * big_reply.interval_ms
        assert metric(proc, "hora_lease_seconds", job_id=small) == 2.0
        assert metric(proc, "hora_heartbeat_interval_seconds", job_id=big) == pytest.approx(
            30 / 16
        )
    finally:
        client.close()
