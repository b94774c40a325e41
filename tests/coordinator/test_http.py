"""The coordinator's HTTP API over a real coordinator process."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from coordinator_clients import Client, new_job_id, tensor

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


@pytest.fixture
def http(coordinator):
    with httpx.Client(base_url=coordinator.http_url, timeout=5) as client:
        yield client


def test_health_and_readiness(http):
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200


def test_unknown_job_is_404_naming_it(http):
    answer = http.get("/api/v1/jobs/nope")
    assert answer.status_code == 404
    assert "nope" in answer.json()["detail"]


def test_jobs_list_and_detail_follow_the_job(coordinator, http):
    assert http.get("/api/v1/jobs").json() == []
    client = Client(coordinator.grpc_address, coordinator.token)
    try:
        job = new_job_id()
        before = time.time()
        views = client.join_all(job, 2, hosts=["a", "b"], fusion_threshold_bytes=1024)
        workers = [m.worker_id for m in views[0].members]
        (summary,) = http.get("/api/v1/jobs").json()
        assert summary["job_id"] == job and summary["state"] == "running"
        assert summary["size"] == 2 and summary["generation"] == 1
        streams = [client.stream(job, w, 1) for w in workers]
        for s in streams:
            s.send(tensor("x"), tensor("y"))
        assert [list(r.tensor_names) for r in streams[0].responses()] == [["x", "y"]]
        detail = http.get(f"/api/v1/jobs/{job}").json()
        assert detail["negotiated_tensors"] == 2
        assert detail["negotiation_messages"] == 2
        assert detail["errors"] == 0
        assert detail["failure"] == ""
        assert detail["created_at"] >= before - 1
        members = detail["members"]
        assert [
            (m["rank"], m["worker_id"], m["host"], m["state"], m["local_rank"]) for m in members
        ] == [(0, workers[0], "a", "active", 0), (1, workers[1], "b", "active", 0)]
        assert all(m["last_heartbeat"] >= before - 1 for m in members)
        for i, w in enumerate(workers):
            client.leave(job, w)
            streams[i].close()
        detail = http.get(f"/api/v1/jobs/{job}").json()
        assert detail["state"] == "finished"
        assert {m["state"] for m in detail["members"]} == {"left"}
    finally:
        client.close()


def test_lost_member_shows_as_lost(coordinator, http):
    client = Client(coordinator.grpc_address, coordinator.token)
    try:
        job = new_job_id()
        views = client.join_all(job, 2)
        workers = [m.worker_id for m in views[0].members]
        streams = [client.stream(job, w, 1) for w in workers]
        streams[0].send()  # make sure both streams are open before one breaks
        streams[1].send()
        time.sleep(0.2)
        streams[0].cancel()
        assert streams[1].event().message == "stream closed"
        detail = http.get(f"/api/v1/jobs/{job}").json()
        assert detail["state"] == "failed"
        assert "rank 0" in detail["failure"] and "stream closed" in detail["failure"]
        assert [m["state"] for m in detail["members"]] == ["lost", "active"]
        streams[1].cancel()
    finally:
        client.close()


def test_gathering_job_shows_its_joiners(coordinator, http):
    client = Client(coordinator.grpc_address, coordinator.token)
    try:
        job = new_job_id()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.join, job, "early", 3, host="a", hint=2, timeout=1.5)
            deadline = time.monotonic() + 5
            while http.get(f"/api/v1/jobs/{job}").status_code == 404:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            detail = http.get(f"/api/v1/jobs/{job}").json()
            assert (detail["state"], detail["generation"], detail["size"]) == ("gathering", 0, 3)
            assert [(m["worker_id"], m["state"], m["rank"]) for m in detail["members"]] == [
                ("early", "joining", 2)
            ]
            with pytest.raises(grpc.RpcError):
                waiting.result(timeout=5)
        time.sleep(0.2)
        # The joiner is forgotten, and with it the job that only it was waiting for
        # (issue 11: a gathering job whose joiners all went away is dropped).
        assert http.get(f"/api/v1/jobs/{job}").status_code == 404
    finally:
        client.close()


@pytest.mark.unit
def test_readyz_is_503_until_grpc_serves():
    import asyncio

    from hora_coordinator import Coordinator, CoordinatorSettings
    from hora_coordinator.http import create_app

    coordinator = Coordinator(CoordinatorSettings(token="t"))

    async def probe() -> list[int]:
        transport = httpx.ASGITransport(app=create_app(coordinator))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            codes = [(await client.get("/readyz")).status_code]
            coordinator.serving = True
            codes.append((await client.get("/readyz")).status_code)
            return codes

    assert asyncio.run(probe()) == [503, 200]


@pytest.mark.unit
def test_events_and_elastic_fields_in_process():
    import asyncio

    from coordinator_transitions import form, jreq

    from hora_coordinator import Coordinator, CoordinatorSettings
    from hora_coordinator import state as st
    from hora_coordinator.http import create_app

    coordinator = Coordinator(CoordinatorSettings(token="t"))
    elastic = coordinator.jobs["e"] = form(2, min_size=1, max_size=4, elastic_timeout_ms=5000)
    st.stream_closed(elastic, "w1", 1, 1.5)
    st.join(elastic, jreq("w0", 2, min_size=1, max_size=4), 2.0)
    plain = coordinator.jobs["p"] = form(1)

    async def read() -> dict[str, object]:
        transport = httpx.ASGITransport(app=create_app(coordinator))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return {
                "events": (await client.get("/api/v1/jobs/e/events")).json(),
                "elastic": (await client.get("/api/v1/jobs/e")).json(),
                "plain": (await client.get("/api/v1/jobs/p")).json(),
                "plain_events": (await client.get("/api/v1/jobs/p/events")).json(),
                "missing": (await client.get("/api/v1/jobs/nope/events")).status_code,
            }

    got = asyncio.run(read())
    assert [e["kind"] for e in got["events"]] == [
        "join",
        "join",
        "generation",
        "lost",
        "join",
        "generation",
    ]
    lost = got["events"][3]
    assert (lost["unix_ms"], lost["rank"], lost["generation"], lost["message"]) == (
        1500,
        1,
        1,
        "stream closed",
    )
    detail = got["elastic"]
    assert (detail["elastic"], detail["min_size"], detail["max_size"]) == (True, 1, 4)
    assert (detail["reset_count"], detail["host_update_epoch"], detail["generation"]) == (1, 0, 2)
    assert (got["plain"]["elastic"], got["plain"]["reset_count"]) == (False, 0)
    assert [e["kind"] for e in got["plain_events"]] == ["join", "generation"]
    assert got["missing"] == 404
    assert plain.reset_count == 0


def test_an_ended_job_is_forgotten_after_the_retention_time(coordinator_factory):
    coordinator = coordinator_factory("--lease-s", "2", "--stall-check-interval-s", "0.2",
                                      "--job-retention-s", "1")
    client = Client(coordinator.grpc_address, coordinator.token)
    try:
        with httpx.Client(base_url=coordinator.http_url, timeout=5) as http:
            job = new_job_id()
            views = client.join_all(job, 2, hosts=["a", "b"])
            workers = [m.worker_id for m in views[0].members]
            for w in workers:
                client.leave(job, w)
            assert http.get(f"/api/v1/jobs/{job}").json()["state"] == "finished"
            assert f'job_id="{job}"' in http.get("/metrics").text
            deadline = time.monotonic() + 15
            while http.get(f"/api/v1/jobs/{job}").status_code != 404:
                assert time.monotonic() < deadline, "the ended job was never forgotten"
                time.sleep(0.1)
            assert http.get("/api/v1/jobs").json() == []
            assert f'job_id="{job}"' not in http.get("/metrics").text
            # The same id later is a new job.
            views = client.join_all(job, 1, hosts=["a"])
            assert views[0].generation == 1
            assert http.get(f"/api/v1/jobs/{job}").json()["state"] == "running"
    finally:
        client.close()
