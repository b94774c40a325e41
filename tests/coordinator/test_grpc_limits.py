"""The request limits over real gRPC: each breach is refused before anything
changes, names its limit, and a valid call afterwards works.

(Ids, sizes, jobs and store keys and values: ``test_grpc_hardening.py``.)
"""

from __future__ import annotations

import grpc
import httpx
import pytest
from coordinator_clients import Client, open_world, tensor

from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2, store_pb2

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


def job_json(proc, job: str) -> dict:
    return httpx.get(f"{proc.http_url}/api/v1/jobs/{job}", timeout=5).json()


def test_an_overlong_tensor_name_fails_that_request_only(coordinator_factory):
    proc = coordinator_factory("--lease-s", "30", "--max-tensor-name-length", "32")
    client = Client(proc.grpc_address, proc.token)
    try:
        job, workers, streams = open_world(client, 2)
        long = "n" * 33
        for s in streams:
            s.send(tensor(long), tensor("a" * 32))
        for s in streams:
            refused, done = s.responses(), s.responses()
            (error,) = refused
            assert error.type == npb.RESPONSE_TYPE_ERROR
            assert error.error_kind == npb.ERROR_KIND_INVALID
            assert list(error.tensor_names) == [long]
            assert "33 characters" in error.error_message
            assert "limit of 32 (max_tensor_name_length)" in error.error_message
            assert [list(r.tensor_names) for r in done] == [["a" * 32]]
        detail = job_json(proc, job)
        assert detail["state"] == "running" and detail["errors"] == 2
        assert detail["negotiated_tensors"] == 1
        for s in streams:  # the streams and the job stay up: the same name, shorter, works
            s.send(tensor(long[:32]))
        for s in streams:
            (resp,) = s.responses()
            assert resp.type == npb.RESPONSE_TYPE_ALLREDUCE
        for worker, s in zip(workers, streams, strict=True):
            client.leave(job, worker)
            s.close()
    finally:
        client.close()
    assert "Traceback" not in proc.log()


def test_a_message_over_the_limit_is_resource_exhausted_and_changes_nothing(
    coordinator_factory,
):
    proc = coordinator_factory("--lease-s", "30", "--max-message-bytes", "300000",
                               "--max-store-value-bytes", "100000")
    client = Client(proc.grpc_address, proc.token)
    md = client.metadata
    try:
        job, workers, streams = open_world(client, 1)

        def set_(value: bytes) -> None:
            request = store_pb2.StoreSetRequest(job_id=job, key="k", value=value)
            client.store.Set(request, metadata=md, timeout=5)

        with pytest.raises(grpc.RpcError) as info:
            set_(b"v" * 300_001)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "300000" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # a Join: no job is made
            client.join("huge", "w", 1, host="h" * 300_001)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        listed = [j["job_id"] for j in httpx.get(f"{proc.http_url}/api/v1/jobs").json()]
        assert listed == [job]
        request = store_pb2.StoreGetRequest(job_id=job, key="k")
        with pytest.raises(grpc.RpcError) as info:
            client.store.Get(request, metadata=md, timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # The job and its stream live on; calls within the limit work.
        assert client.heartbeat(job, workers[0], 1).job_state == rendezvous_pb2.JOB_STATE_RUNNING
        set_(b"v" * 100_000)
        assert client.store.Get(request, metadata=md, timeout=5).value == b"v" * 100_000
        streams[0].send(tensor("x"))
        (resp,) = streams[0].responses()
        assert resp.type == npb.RESPONSE_TYPE_ALLREDUCE
        assert job_json(proc, job)["state"] == "running"
        client.leave(job, workers[0])
        streams[0].close()
    finally:
        client.close()
    assert "Traceback" not in proc.log()


def test_the_event_log_keeps_the_newest_and_the_api_counts_the_dropped(coordinator_factory):
    proc = coordinator_factory("--lease-s", "30", "--max-events-per-job", "5")
    client = Client(proc.grpc_address, proc.token)
    try:
        job = "events"
        client.join_all(job, 1)  # "join", "generation"
        for i in range(6):
            client.report_event(job, "tick", message=str(i))
        assert [e.message for e in client.list_events(job)][-3:] == ["3", "4", "5"]
        assert len(client.list_events(job)) == 5
        assert job_json(proc, job)["events_dropped"] == 3
        events = httpx.get(f"{proc.http_url}/api/v1/jobs/{job}/events", timeout=5).json()
        assert [e["message"] for e in events] == ["1", "2", "3", "4", "5"]
        (summary,) = httpx.get(f"{proc.http_url}/api/v1/jobs", timeout=5).json()
        assert summary["events_dropped"] == 3
        text = httpx.get(f"{proc.http_url}/metrics", timeout=5).text
        assert f'hora_job_events_dropped_total{{job_id="{job}"}} 3.0' in text
        # A kind longer than an id is refused before the log changes; a long
        # message is kept cut.
        with pytest.raises(grpc.RpcError) as info:
            client.report_event(job, "k" * 257)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_id_length" in info.value.details()
        assert [e.message for e in client.list_events(job)] == ["1", "2", "3", "4", "5"]
        client.report_event(job, "tick", message="m" * 100_000)
        assert client.list_events(job)[-1].message == "m" * 1024 + "…"
    finally:
        client.close()


def test_a_refusal_quoting_long_input_keeps_its_status_and_fits_a_trailer(coordinator_factory):
    # Status details travel in a trailer; one past the caller's metadata limit
    # arrived as RESOURCE_EXHAUSTED "received metadata size exceeds hard limit"
    # instead of the refusal (found by tests/fuzz).
    proc = coordinator_factory("--lease-s", "30")
    client = Client(proc.grpc_address, proc.token)
    md, rdv = client.metadata, client.rendezvous
    try:
        client.join_all("j", 1)
        calls = {
            "unknown job": (grpc.StatusCode.NOT_FOUND, lambda: rdv.Heartbeat(
                rendezvous_pb2.HeartbeatRequest(job_id="x" * 50_000, worker_id="w"),
                metadata=md, timeout=5)),
            "unknown job (4-byte characters)": (grpc.StatusCode.NOT_FOUND, lambda: rdv.ListEvents(
                rendezvous_pb2.ListEventsRequest(job_id="🙂" * 5_000), metadata=md, timeout=5)),
            "not a member": (grpc.StatusCode.NOT_FOUND, lambda: rdv.GetWorld(
                rendezvous_pb2.GetWorldRequest(job_id="j", worker_id="w" * 50_000),
                metadata=md, timeout=5)),
            "missing keys": (grpc.StatusCode.DEADLINE_EXCEEDED, lambda: client.store.Wait(
                store_pb2.StoreWaitRequest(job_id="j", keys=[f"{i:04}" + "k" * 96
                                                             for i in range(500)],
                                           timeout_ms=1),
                metadata=md, timeout=5)),
        }
        for what, (code, call) in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            details = info.value.details()
            assert info.value.code() == code, (what, info.value.code(), details[:200])
            assert len(details.encode()) <= 4096, (what, len(details))
            assert "…" in details, (what, details[-100:])
        assert client.heartbeat("j", "w0", 1).job_state == rendezvous_pb2.JOB_STATE_RUNNING
    finally:
        client.close()
    assert "Traceback" not in proc.log()


def test_a_stream_message_over_the_limit_ends_that_stream_only(coordinator_factory):
    # gRPC refuses the message before any handler sees it, so the stream
    # cannot go on; the SDK never sends one (it splits a burst into messages
    # of about 1 MiB, tests/unit/test_negotiation_batches.py).
    proc = coordinator_factory("--lease-s", "30", "--max-message-bytes", "300000",
                               "--max-store-value-bytes", "100000")
    client = Client(proc.grpc_address, proc.token)
    try:
        job, workers, streams = open_world(client, 2)
        other, other_workers, other_streams = open_world(client, 1)
        streams[0].send(*[tensor(f"t{i:05}" + "x" * 200) for i in range(1500)])
        with pytest.raises(grpc.RpcError) as info:
            while True:
                streams[0].recv()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        other_streams[0].send(tensor("x"))  # the coordinator and its other jobs go on
        (resp,) = other_streams[0].responses()
        assert resp.type == npb.RESPONSE_TYPE_ALLREDUCE
        client.leave(other, other_workers[0])
        for s in (*streams, *other_streams):
            s.close()
    finally:
        client.close()
    assert "Traceback" not in proc.log()
