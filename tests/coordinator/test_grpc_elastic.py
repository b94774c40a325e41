"""Elastic jobs over the coordinator's gRPC API: losses, growth, events and the elastic timeout."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from coordinator_clients import Client, code_of, new_job_id

from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


# ---- elastic ---------------------------------------------------------------------------

ELASTIC = {"min_size": 2, "max_size": 3, "elastic_timeout_ms": 10_000}


def reset_and_join(client, job, workers, streams, size):
    """Each worker's elastic reset, the worker side's call order: Leave(rejoin=True), close
    the stream, Join again with the same worker id. The new views, by rank."""
    for worker, stream in zip(workers, streams, strict=True):
        client.leave(job, worker, "reset", rejoin=True)
        stream.close()
    with ThreadPoolExecutor(len(workers)) as pool:
        futures = [pool.submit(client.join, job, w, size, **ELASTIC) for w in workers]
        return sorted((f.result(timeout=15) for f in futures), key=lambda v: v.rank)


def test_elastic_job_survives_a_loss_and_grows_back(client, shared):
    job = new_job_id()
    views = client.join_all(job, 3, **ELASTIC)
    workers = [m.worker_id for m in views[0].members]  # by rank
    streams = [client.stream(job, w, 1) for w in workers]
    for s in streams:
        s.send()  # every stream open before one breaks
    time.sleep(0.2)
    streams[1].cancel()
    for s in (streams[0], streams[2]):
        lost = s.event()
        assert (lost.type, lost.rank, lost.message) == (
            npb.EVENT_TYPE_MEMBER_LOST,
            1,
            "stream closed",
        )
        s.assert_silent()  # no JOB_FAILED: the job goes on
    survivors = [workers[0], workers[2]]
    views = reset_and_join(client, job, survivors, [streams[0], streams[2]], 3)
    assert [(v.generation, v.size, v.rank) for v in views] == [(2, 2, 0), (2, 2, 1)]
    assert [m.worker_id for m in views[0].members] == survivors  # old rank order kept
    assert views[0].store_prefix == f"{job}/gen-2/"

    streams = [client.stream(job, w, 2) for w in survivors]
    with ThreadPoolExecutor(1) as pool:
        newcomer = pool.submit(client.join, job, "fresh", 3, timeout=20, **ELASTIC)
        deadline = time.monotonic() + 5
        while client.heartbeat(job, survivors[0], 2).host_update_epoch == 0:
            assert time.monotonic() < deadline and not newcomer.done()
            time.sleep(0.05)
        beat = client.heartbeat(job, survivors[1], 2)
        assert (beat.host_update_epoch, beat.removals_only) == (1, False)
        assert beat.job_state == rpb.JOB_STATE_RUNNING
        views = reset_and_join(client, job, survivors, streams, 3)
        fresh = newcomer.result(timeout=5)
    assert [(v.generation, v.size) for v in views] == [(3, 3), (3, 3)]
    assert [m.worker_id for m in views[0].members] == [*survivors, "fresh"]
    assert fresh.rank == 2 and fresh.members == views[0].members

    client.report_event(job, "blacklist", "badhost", "3 failures in a row")
    events = client.list_events(job)
    kinds = [e.kind for e in events]
    for kind in ("join", "lost", "generation", "reset", "join_waiting", "blacklist"):
        assert kind in kinds, kinds
    assert kinds.count("generation") == 3 and kinds[-1] == "blacklist"
    assert [e.unix_ms for e in events] == sorted(e.unix_ms for e in events)
    (lost,) = [e for e in events if e.kind == "lost"]
    assert (lost.rank, lost.generation, lost.message) == (1, 1, "stream closed")

    served = httpx.get(f"{shared.http_url}/api/v1/jobs/{job}/events", timeout=5).json()
    assert [e["kind"] for e in served] == kinds
    assert all(e["unix_ms"] > 0 for e in served)
    detail = httpx.get(f"{shared.http_url}/api/v1/jobs/{job}", timeout=5).json()
    assert (detail["state"], detail["generation"], detail["size"]) == ("running", 3, 3)
    assert (detail["elastic"], detail["min_size"], detail["max_size"]) == (True, 2, 3)
    assert (detail["reset_count"], detail["host_update_epoch"]) == (2, 1)


def test_events_of_an_unknown_job(client, shared):
    err = code_of(client.report_event, "no-such-job", "blacklist")
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = code_of(client.list_events, "no-such-job")
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert httpx.get(f"{shared.http_url}/api/v1/jobs/nope/events", timeout=5).status_code == 404
    job = new_job_id()
    client.join(job, "solo", 1)
    err = code_of(client.report_event, job, "")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_elastic_timeout_fails_waiting_joins(coordinator_factory):
    proc = coordinator_factory("--lease-s", "5", "--stall-check-interval-s", "0.1")
    client = Client(proc.grpc_address, proc.token)
    try:
        job = new_job_id()
        bounds = {"min_size": 2, "max_size": 3, "elastic_timeout_ms": 500}
        err = code_of(client.join, job, "alone", 3, timeout=10, **bounds)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            f"elastic job '{job}': only 1 worker(s) joined within 0.5 s; "
            "at least 2 required (min_size)"
        ) in err.details()
        assert client.list_events(job)[-1].kind == "failed"
    finally:
        client.close()
