"""Big HTTP reads do not hold up gRPC: heartbeats stay fast while /metrics renders.

A real coordinator process holding thousands of jobs; a scrape of /metrics
and /api/v1/jobs used to be computed on the event loop that also serves gRPC,
so a heartbeat sent meanwhile waited for the whole scrape (at 10k jobs on a
busy host, long enough for healthy workers to be declared lost).
"""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from hora_proto.v1 import rendezvous_pb2, rendezvous_pb2_grpc

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

JOBS = 4000


def fill(proc, jobs: int) -> None:
    """``jobs`` running one-member jobs, joined in pipelined batches."""
    with grpc.insecure_channel(proc.grpc_address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        for start in range(0, jobs, 500):
            futures = [
                stub.Join.future(
                    rendezvous_pb2.JoinRequest(job_id=f"bulk-{i}", worker_id="w", host="h",
                                               pid=1, expected_size=1, rank_hint=-1),
                    metadata=proc.metadata, timeout=60)
                for i in range(start, min(start + 500, jobs))
            ]
            for future in futures:
                future.result()


def test_heartbeats_are_answered_while_big_reads_render(coordinator_factory):
    proc = coordinator_factory("--lease-s", "600")
    fill(proc, JOBS)
    scrapes: list[tuple[float, float]] = []  # (start, end) of each /metrics read
    done = threading.Event()

    def scrape() -> None:
        try:
            with httpx.Client(base_url=proc.http_url, timeout=60) as http:
                for path in ("/metrics", "/api/v1/jobs") * 3:
                    began = time.monotonic()
                    answer = http.get(path)
                    assert answer.status_code == 200
                    if path == "/metrics":
                        scrapes.append((began, time.monotonic()))
        finally:
            done.set()

    beats: list[tuple[float, float]] = []
    with grpc.insecure_channel(proc.grpc_address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        beat = rendezvous_pb2.HeartbeatRequest(job_id="bulk-0", worker_id="w", generation=1)
        stub.Heartbeat(beat, metadata=proc.metadata, timeout=30)  # the channel is up
        reader = threading.Thread(target=scrape)
        reader.start()
        while not done.is_set():
            began = time.monotonic()
            stub.Heartbeat(beat, metadata=proc.metadata, timeout=30)
            beats.append((began, time.monotonic()))
        reader.join()
    assert len(scrapes) == 3
    # Heartbeats sent and answered while a scrape was in flight. A scrape that
    # held the loop let through only the few sent before it was read or after
    # it was rendered; one that renders off the loop lets through dozens.
    inside = [
        sum(1 for b0, b1 in beats if s0 <= b0 and b1 <= s1) for s0, s1 in scrapes
    ]
    assert sum(inside) >= 20, (inside, [s1 - s0 for s0, s1 in scrapes])
    assert "Traceback" not in proc.log()


@pytest.mark.unit
def test_the_jobs_list_pages_and_counts_every_job():
    import asyncio

    from hora_coordinator import Coordinator, CoordinatorSettings
    from hora_coordinator import state as st
    from hora_coordinator.http import create_app

    coordinator = Coordinator(CoordinatorSettings(token="t"))
    for i in range(600):  # more than one slice
        coordinator.jobs[f"j{i}"] = st.new_job(f"j{i}", float(i))

    async def read() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(coordinator))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            paths = ("/api/v1/jobs", "/api/v1/jobs?limit=2", "/api/v1/jobs?offset=599&limit=5",
                     "/api/v1/jobs?offset=1000", "/api/v1/jobs?limit=0", "/api/v1/jobs?offset=-1")
            return [await client.get(path) for path in paths]

    every, first, last, past, zero, negative = asyncio.run(read())
    assert [j["job_id"] for j in every.json()] == [f"j{i}" for i in range(600)]
    assert [j["job_id"] for j in first.json()] == ["j0", "j1"]
    assert [j["job_id"] for j in last.json()] == ["j599"]
    assert past.json() == []
    assert {a.headers["x-total-count"] for a in (every, first, last, past)} == {"600"}
    assert (zero.status_code, negative.status_code) == (422, 422)
