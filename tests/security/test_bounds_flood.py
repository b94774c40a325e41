"""A real coordinator under a 1,024-file limit, flooded by a stranger (issue 25, findings 2, 3).

The coordinator runs under ``prlimit --nofile=1024:1024`` (hard limit too, so
its start-up raise buys nothing) on 127.0.0.1; the stranger connects from
127.0.0.2, the probes from 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.coordinator import CoordinatorProcess
from support.flood import (
    HALF_GRPC,
    HALF_HTTP,
    half_header_flood,
    healthz_within,
    rss_bytes,
    send_garbage,
)

from hora.runner.tls import make_job_certificates
from hora_proto.v1 import store_pb2, store_pb2_grpc

pytestmark = pytest.mark.multiprocess

_LIMIT = ["prlimit", "--nofile=1024:1024", "--"]
# Stated bounds.
LOG_BOUND_BYTES = 200_000
# Before the fix 5 x 10k refused calls grew it by 29 MiB (72 -> 101), after by 6.
RSS_GROWTH_BOUND = 16 * 1024 * 1024
_FLOOD = 1_100
_HEALTHZ_DEADLINE_S = 5.0


@pytest.fixture
def limited():
    # --guess-burst 0: every wrong token is checked and refused as such (no slow-down), the
    # path whose garbage piled up (finding 3), and the most work a refused call can cost.
    with CoordinatorProcess(["--header-timeout-s", "3", "--refusal-log-interval-s", "10",
                             "--guess-burst", "0"],
                            command_prefix=_LIMIT) as proc:
        yield proc


def test_half_header_flood_leaves_healthz_answering_and_the_log_small(limited):
    healthz_within(limited.http_url, _HEALTHZ_DEADLINE_S)
    log_before = os.path.getsize(limited.log_file)
    send_garbage(("127.0.0.1", limited.http_port), 200)  # uvicorn's line per bad request
    targets = [("127.0.0.1", limited.http_port, HALF_HTTP),
               ("127.0.0.1", limited.grpc_port, HALF_GRPC)]
    with half_header_flood(targets, _FLOOD):
        healthz_within(limited.http_url, _HEALTHZ_DEADLINE_S)
        # One more plain connect while the flood holds what it can.
        healthz_within(limited.http_url, _HEALTHZ_DEADLINE_S)
        time.sleep(4)  # past the header timeout: the late heads are closed
        healthz_within(limited.http_url, _HEALTHZ_DEADLINE_S)
    healthz_within(limited.http_url, _HEALTHZ_DEADLINE_S)
    # gRPC serves again once the stranger is gone.
    with grpc.insecure_channel(limited.grpc_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=15, wait_for_ready=True)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert limited.running()
    grown = os.path.getsize(limited.log_file) - log_before
    print(f"log grew {grown} bytes during the flood")
    assert grown < LOG_BOUND_BYTES, limited.log()[-5000:]


async def _refused_calls(address: str, count: int, token: str | None) -> None:
    metadata = None if token is None else (("hora-token", token),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        request = store_pb2.StoreGetRequest(job_id="victim", key="k", timeout_ms=1)
        window = 200
        for start in range(0, count, window):
            calls = [stub.Get(request, metadata=metadata, timeout=20)
                     for _ in range(min(window, count - start))]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_refused_call_flood_leaves_rss_within_bound(limited):
    address = limited.grpc_address
    asyncio.run(_refused_calls(address, 2_000, None))  # warm-up: caches, arenas
    time.sleep(1)
    baseline = rss_bytes(limited.pid)
    rounds = []
    for i in range(5):
        started = time.monotonic()
        asyncio.run(_refused_calls(address, 10_000, None if i % 2 else "wrong-" + "x" * 16))
        rounds.append((time.monotonic() - started, rss_bytes(limited.pid)))
    time.sleep(1)
    after = rss_bytes(limited.pid)
    print(f"RSS baseline {baseline / 2**20:.1f} MiB, after each round "
          f"{[f'{r / 2**20:.1f}' for _, r in rounds]} MiB, at the end {after / 2**20:.1f} MiB; "
          f"rounds took {[f'{t:.1f}' for t, _ in rounds]} s")
    assert after - baseline < RSS_GROWTH_BOUND
    healthz_within(limited.http_url, _HEALTHZ_DEADLINE_S)


def test_garbage_on_the_tls_ports_logs_a_few_lines(coordinator_factory, tmp_path):
    certs = make_job_certificates(["127.0.0.1"], directory=tmp_path / "tls")
    coord = coordinator_factory("--tls-cert", str(certs.cert_file),
                                "--tls-key", str(certs.key_file))
    before = os.path.getsize(coord.log_file)
    for port in (coord.grpc_port, coord.http_port):
        send_garbage(("127.0.0.1", port), 200)
    time.sleep(1)
    grown = os.path.getsize(coord.log_file) - before
    print(f"log grew {grown} bytes for 400 garbage connections")
    assert grown < 2_000, coord.log()[-3000:]


def test_out_of_descriptors_pauses_accepting_without_flooding_the_log(coordinator_factory):
    # Caps above the file limit on purpose: the listener itself meets EMFILE.
    coord = coordinator_factory("--max-http-connections", "5000",
                                "--max-http-connections-per-address", "5000",
                                "--header-timeout-s", "30", command_prefix=_LIMIT)
    before = os.path.getsize(coord.log_file)
    with half_header_flood([("127.0.0.1", coord.http_port, HALF_HTTP)], _FLOOD):
        time.sleep(3)  # the listener at EMFILE: paused, not spinning or logging
        assert coord.running()
    healthz_within(coord.http_url, 15.0)
    grown = os.path.getsize(coord.log_file) - before
    print(f"log grew {grown} bytes while out of descriptors")
    assert "HTTP accept failed" in coord.log()
    assert grown < 20_000, coord.log()[-5000:]
