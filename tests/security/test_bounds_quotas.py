"""Quotas and the smaller bounds of issue 25 (findings 5 and 6), on real coordinators."""

from __future__ import annotations

import asyncio
import http.client
import os
import stat
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.flood import rss_bytes

from hora_proto.v1 import (
    negotiation_pb2,
    negotiation_pb2_grpc,
    rendezvous_pb2,
    store_pb2,
)

# The coordinator tests' fake workers (tests/coordinator/coordinator_clients.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))
from coordinator_clients import Client, code_of, new_job_id  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _set(client: Client, job: str, key: str, value: bytes) -> None:
    client.store.Set(store_pb2.StoreSetRequest(job_id=job, key=key, value=value),
                     metadata=client.metadata, timeout=10)


def test_store_quota_refuses_keys_and_bytes_past_it(coordinator_factory):
    coord = coordinator_factory("--max-store-keys-per-job", "4",
                                "--max-store-bytes-per-job", "3000")
    client = Client(coord.grpc_address, coord.token)
    try:
        job = new_job_id()
        client.join(job, "w0", 1)
        for i in range(4):
            _set(client, job, f"k{i}", b"x" * 100)
        error = code_of(_set, client, job, "k4", b"x")
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_store_keys_per_job" in error.details()
        _set(client, job, "k0", b"y" * 500)  # overwriting an existing key is no new key
        error = code_of(_set, client, job, "k1", b"z" * 2600)
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_store_bytes_per_job" in error.details()
        client.store.Delete(store_pb2.StoreDeleteRequest(job_id=job, key="k3"),
                            metadata=client.metadata, timeout=10)
        _set(client, job, "k4", b"x" * 100)  # room again after a delete
    finally:
        client.close()


def test_full_job_table_forgets_the_first_ended_job(coordinator_factory):
    coord = coordinator_factory("--max-jobs", "2", "--job-retention-s", "3600")
    client = Client(coord.grpc_address, coord.token)
    try:
        first, second, third = new_job_id(), new_job_id(), new_job_id()
        client.join(first, "w0", 1)
        client.join(second, "w0", 1)
        error = code_of(client.join, third, "w0", 1)
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        client.leave(first, "w0")
        deadline = time.monotonic() + 10
        while True:  # the periodic check notices the end within a few ticks
            try:
                client.join(third, "w0", 1)
                break
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the ended job never made room"
                time.sleep(0.2)
        # Running jobs are never pushed out.
        assert code_of(client.join, new_job_id(), "w0", 1).code() is (
            grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        client.close()


async def _flood_unread_stream(address: str, token: str, job: str, generation: int,
                               heartbeats: int) -> grpc.StatusCode:
    metadata = (("hora-token", token),)
    # A fixed 64 KiB receive window: with BDP probing the client's window grows to
    # megabytes and takes every answer in, and the coordinator never sees it lag.
    async with grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]
                                         ) as channel:
        stub = negotiation_pb2_grpc.NegotiationStub(channel)
        call = stub.Negotiate(metadata=metadata, timeout=60)
        await call.write(negotiation_pb2.WorkerMessage(open=negotiation_pb2.StreamOpen(
            job_id=job, worker_id="w0", generation=generation)))
        try:
            for i in range(heartbeats):
                await call.write(negotiation_pb2.WorkerMessage(
                    heartbeat=negotiation_pb2.StreamHeartbeat(sequence=i)))
            await call.done_writing()  # a stream the coordinator kept then ends with OK
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # dropped while still sending
        # Only now read: what was delivered, then the end the coordinator gave it.
        try:
            while await asyncio.wait_for(call.read(), 30) is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return await call.code()


def test_stream_that_never_reads_is_dropped(coordinator_factory):
    coord = coordinator_factory("--max-stream-queue", "50", "--lease-s", "30")
    client = Client(coord.grpc_address, coord.token)
    try:
        job = new_job_id()
        view = client.join(job, "w0", 1)
        before = rss_bytes(coord.pid)
        code = asyncio.run(_flood_unread_stream(coord.grpc_address, coord.token, job,
                                                view.generation, 40_000))
        # Ended by the coordinator (RESOURCE_EXHAUSTED, or INTERNAL when gRPC core
        # cancels the write the client never took), long before the call's deadline.
        assert code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "reads nothing of its negotiation stream" in coord.log()
        grown = rss_bytes(coord.pid) - before
        print(f"RSS grew {grown / 2**20:.1f} MiB under 40k unread heartbeat answers")
        assert grown < 30 * 2**20
    finally:
        client.close()


def _get(port: int, path: str, host: str | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {} if host is None else {"Host": host}
    conn.request("GET", path, headers=headers)
    return conn.getresponse()


def test_live_streams_are_capped(coordinator_factory):
    coord = coordinator_factory("--max-live-streams", "2")
    conns = [http.client.HTTPConnection("127.0.0.1", coord.http_port, timeout=10)
             for _ in range(2)]
    try:
        for conn in conns:
            conn.request("GET", "/api/v1/live")
            response = conn.getresponse()
            assert response.status == 200
            assert response.readline().startswith(b"event: jobs")
        assert _get(coord.http_port, "/api/v1/live").status == 503
        conns.pop().close()
        deadline = time.monotonic() + 10
        while (status := _get(coord.http_port, "/api/v1/live").status) != 200:
            assert status == 503 and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        for conn in conns:
            conn.close()


def test_state_dir_and_journal_are_private(coordinator_factory, tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    fresh = tmp_path / "fresh" / "state"
    for state_dir in (loose, fresh):
        coordinator_factory("--state-dir", str(state_dir))
        assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
        for path in state_dir.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_ids_must_be_printable(coordinator_factory):
    coord = coordinator_factory()
    client = Client(coord.grpc_address, coord.token)
    forged = "x\n2026-11-25 23:00:00 WARNING hora_coordinator: forged"
    try:
        assert code_of(client.join, forged, "w0", 1).code() is grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(client.join, new_job_id(), forged, 1).code() is (
            grpc.StatusCode.INVALID_ARGUMENT)
        for call, request in (
            (client.store.Get, store_pb2.StoreGetRequest(job_id=forged, key="k")),
            (client.rendezvous.Leave, rendezvous_pb2.LeaveRequest(job_id="j", worker_id=forged)),
        ):
            error = code_of(call, request, metadata=client.metadata, timeout=10)
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "\n" not in error.details()
        assert "forged" not in coord.log()
    finally:
        client.close()


def test_loopback_api_checks_host_and_serves_no_cdn_docs(coordinator_factory):
    coord = coordinator_factory()
    port = coord.http_port
    assert _get(port, "/healthz").status == 200
    assert _get(port, "/api/v1/jobs", host=f"localhost:{port}").status == 200
    assert _get(port, "/api/v1/jobs", host=f"[::1]:{port}").status == 200
    for host in (f"attacker.example:{port}", "attacker.example", f"10.0.0.1:{port}"):
        assert _get(port, "/api/v1/jobs", host=host).status == 421, host
    assert _get(port, "/docs").status == 404
    assert _get(port, "/redoc").status == 404
    assert _get(port, "/openapi.json").status == 200


def test_idle_grpc_connections_are_closed(coordinator_factory):
    coord = coordinator_factory("--grpc-idle-timeout-s", "1")
    with grpc.insecure_channel(coord.grpc_address) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        ready = grpc.ChannelConnectivity.READY.value[0]
        assert channel._channel.check_connectivity_state(False) == ready
        deadline = time.monotonic() + 15
        # The coordinator's GOAWAY takes the connection down; the channel goes idle.
        while channel._channel.check_connectivity_state(False) == ready:
            assert time.monotonic() < deadline, "the idle connection stayed open"
            time.sleep(0.2)
        # and reconnects by itself on the next call
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
