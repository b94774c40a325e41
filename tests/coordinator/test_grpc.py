"""The coordinator over real gRPC: a real coordinator process, fake workers on the stubs."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import httpx
import pytest
from coordinator_clients import Client, code_of, new_job_id, open_world, tensor, together
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hora_proto.error_kinds import UNKNOWN_JOB, error_kind
from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb
from hora_proto.v1 import store_pb2

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]



# ---- auth ------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_missing_or_wrong_token_is_unauthenticated(shared, token):
    bad = Client(shared.grpc_address, token)
    try:
        err = code_of(bad.join, new_job_id(), "w", 1, timeout=5)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert ("missing job token" if token is None else "wrong job token") in err.details()
        stream = bad.stream(new_job_id(), "w", 1)
        with pytest.raises(grpc.RpcError) as info:
            stream.recv()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        bad.close()
    deadline = time.monotonic() + 5
    while "refused /hora.v1.Rendezvous/Join from" not in shared.log():
        assert time.monotonic() < deadline, shared.log()
        time.sleep(0.05)
    assert "WARNING" in shared.log()


def test_health_service_needs_no_token(shared):
    with grpc.insecure_channel(shared.grpc_address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="hora.v1.Rendezvous"), timeout=5
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


# ---- rendezvous ------------------------------------------------------------------------


def test_three_workers_join_concurrently_and_agree(client):
    job = new_job_id()
    views = client.join_all(job, 3, hosts=["b", "a", "b"])
    assert [v.rank for v in views] == [0, 1, 2]
    assert {v.generation for v in views} == {1}
    assert all(v.members == views[0].members for v in views)
    assert [m.host for m in views[0].members] == ["a", "b", "b"]  # unhinted: host, then arrival
    assert [(v.local_rank, v.local_size, v.cross_rank, v.cross_size) for v in views] == [
        (0, 1, 0, 2),
        (0, 2, 1, 2),
        (1, 2, 0, 1),
    ]
    assert not views[0].is_homogeneous
    assert views[0].store_prefix == f"{job}/gen-1/"
    again = client.rendezvous.GetWorld(
        rpb.GetWorldRequest(job_id=job, worker_id="w1"), metadata=client.metadata, timeout=5
    ).world
    assert again.rank == 0 and again.members == views[0].members  # w1 is the only one on "a"


def test_join_deadline_forgets_the_joiner(client):
    job = new_job_id()
    err = code_of(client.join, job, "stale", 2, timeout=0.5)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.2)
    views = client.join_all(job, 2)
    assert {m.worker_id for m in views[0].members} == {"w0", "w1"}


def test_size_disagreement_and_bad_hint_are_invalid(client):
    job = new_job_id()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.join, job, "a", 2, timeout=10)
        time.sleep(0.2)
        err = code_of(client.join, job, "b", 3)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "size 2" in err.details()
        err = code_of(client.join, job, "c", 2, hint=2)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank hint 2" in err.details()
        client.join(job, "d", 2)
        assert first.result(timeout=5).size == 2


def test_shutdown_then_init_forms_the_next_generation(client):
    job = new_job_id()
    client.join_all(job, 2)
    with ThreadPoolExecutor(1) as pool:
        client.leave(job, "w0")  # hvd.shutdown() then hvd.init() in one process
        early = pool.submit(client.join, job, "w0", 2, timeout=10)  # waits for gen 1 to end
        time.sleep(0.3)
        assert not early.done()
        client.leave(job, "w1")
        late = client.join(job, "w1", 2)
        assert early.result(timeout=5).generation == late.generation == 2
        assert late.store_prefix == f"{job}/gen-2/"


# ---- store -----------------------------------------------------------------------------


def test_an_unknown_job_is_told_apart_from_an_unknown_key_by_its_kind(client):
    """Both are NOT_FOUND; only the unknown job carries its kind in the trailers, which
    the client reads (never the message) to tell a restarted coordinator."""
    job = new_job_id()
    md, s = client.metadata, client.store
    err = code_of(s.Get, store_pb2.StoreGetRequest(job_id=job, key="k"), metadata=md, timeout=5)
    assert err.code() == grpc.StatusCode.NOT_FOUND and error_kind(err) == UNKNOWN_JOB
    client.join(job, "w0", 1)
    err = code_of(s.Get, store_pb2.StoreGetRequest(job_id=job, key="k"), metadata=md, timeout=5)
    assert err.code() == grpc.StatusCode.NOT_FOUND and error_kind(err) == ""


def test_store_operations(client):
    job = new_job_id()
    client.join(job, "w0", 1)
    md, s = client.metadata, client.store
    s.Set(store_pb2.StoreSetRequest(job_id=job, key="k", value=b"v"), metadata=md, timeout=5)
    assert (
        s.Get(store_pb2.StoreGetRequest(job_id=job, key="k"), metadata=md, timeout=5).value == b"v"
    )
    err = code_of(
        s.Get, store_pb2.StoreGetRequest(job_id=job, key="absent"), metadata=md, timeout=5
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'absent'" in err.details()
    err = code_of(
        s.Get,
        store_pb2.StoreGetRequest(job_id=job, key="late", timeout_ms=200),
        metadata=md,
        timeout=5,
    )
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "'late'" in err.details()
    assert [
        s.Add(
            store_pb2.StoreAddRequest(job_id=job, key="n", amount=a), metadata=md, timeout=5
        ).value
        for a in (1, 5, -2)
    ] == [1, 6, 4]
    assert (
        s.Get(store_pb2.StoreGetRequest(job_id=job, key="n"), metadata=md, timeout=5).value == b"4"
    )
    err = code_of(
        s.Add, store_pb2.StoreAddRequest(job_id=job, key="k", amount=1), metadata=md, timeout=5
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = code_of(
        s.Wait,
        store_pb2.StoreWaitRequest(job_id=job, keys=["k", "x", "y"], timeout_ms=200),
        metadata=md,
        timeout=5,
    )
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "'x', 'y'" in err.details() and "'k'" not in err.details()
    cas = s.CompareSet
    assert (
        cas(
            store_pb2.StoreCompareSetRequest(job_id=job, key="c", expected=b"", desired=b"1"),
            metadata=md,
            timeout=5,
        ).value
        == b"1"
    )
    assert (
        cas(
            store_pb2.StoreCompareSetRequest(job_id=job, key="c", expected=b"0", desired=b"2"),
            metadata=md,
            timeout=5,
        ).value
        == b"1"
    )
    assert (
        cas(
            store_pb2.StoreCompareSetRequest(job_id=job, key="c", expected=b"1", desired=b"2"),
            metadata=md,
            timeout=5,
        ).value
        == b"2"
    )
    assert s.Delete(
        store_pb2.StoreDeleteRequest(job_id=job, key="c"), metadata=md, timeout=5
    ).existed
    assert not s.Delete(
        store_pb2.StoreDeleteRequest(job_id=job, key="c"), metadata=md, timeout=5
    ).existed
    err = code_of(
        s.Set, store_pb2.StoreSetRequest(job_id="no-such-job", key="k"), metadata=md, timeout=5
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_store_waiters_wake_on_set_without_polling_delay(client):
    job = new_job_id()
    client.join(job, "w0", 1)
    md, s = client.metadata, client.store
    with ThreadPoolExecutor(2) as pool:
        get = pool.submit(
            s.Get,
            store_pb2.StoreGetRequest(job_id=job, key="addr", timeout_ms=5000),
            metadata=md,
            timeout=10,
        )
        wait = pool.submit(
            s.Wait,
            store_pb2.StoreWaitRequest(job_id=job, keys=["addr", "b"], timeout_ms=5000),
            metadata=md,
            timeout=10,
        )
        time.sleep(0.3)
        started = time.monotonic()
        s.Set(store_pb2.StoreSetRequest(job_id=job, key="addr", value=b"x"), metadata=md, timeout=5)
        s.Set(store_pb2.StoreSetRequest(job_id=job, key="b", value=b"y"), metadata=md, timeout=5)
        assert get.result(timeout=5).value == b"x"
        wait.result(timeout=5)
        assert time.monotonic() - started < 0.5


def test_two_jobs_side_by_side(client):
    a, b = new_job_id(), new_job_id()
    views_a = client.join_all(a, 2)
    views_b = client.join_all(b, 3)  # same worker ids, other job
    assert (views_a[0].size, views_b[0].size) == (2, 3)
    md, s = client.metadata, client.store
    s.Set(store_pb2.StoreSetRequest(job_id=a, key="k", value=b"a"), metadata=md, timeout=5)
    err = code_of(s.Get, store_pb2.StoreGetRequest(job_id=b, key="k"), metadata=md, timeout=5)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    sa = [client.stream(a, f"w{i}", 1) for i in range(2)]
    sb = [client.stream(b, f"w{i}", 1) for i in range(3)]
    for st in sa:
        st.send(tensor("x"))
    assert [list(r.tensor_names) for r in sa[0].responses()] == [["x"]]
    sb[0].send(tensor("x"))
    sb[0].assert_silent()  # job b still waits on its ranks 1 and 2
    for st in sa + sb:
        st.cancel()


# ---- negotiation -----------------------------------------------------------------------


def test_every_rank_gets_the_same_ordered_responses(client):
    job, workers, streams = open_world(client, 3, fusion_threshold_bytes=64)
    rng = random.Random(7)
    names = [f"t{i}" for i in range(30)]

    def request(name: str, rank: int) -> npb.TensorRequest:
        if name.endswith("7"):  # a few ragged allgathers among the allreduces
            return tensor(name, op=npb.OP_TYPE_ALLGATHER, shape=(rank + 1, 2))
        return tensor(name, shape=(int(name[1:]) % 5 + 1,))

    # Each rank submits every name, shuffled, in small messages, all ranks at once.
    def feed(rank: int) -> None:
        order = names[:]
        rng_rank = random.Random(rank)
        rng_rank.shuffle(order)
        for i in range(0, len(order), 4):
            streams[rank].send(*(request(n, rank) for n in order[i : i + 4]))
            time.sleep(rng.random() * 0.01)

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(feed, range(3)))
    seen: list[list[npb.Response]] = [[], [], []]
    for rank, stream in enumerate(streams):
        while sum(len(r.tensor_names) for r in seen[rank]) < len(names):
            seen[rank].extend(stream.responses())
    assert seen[0] == seen[1] == seen[2]
    assert sorted(n for r in seen[0] for n in r.tensor_names) == sorted(names)
    assert all(r.type != npb.RESPONSE_TYPE_ERROR for r in seen[0])
    gathers = [r for r in seen[0] if r.type == npb.RESPONSE_TYPE_ALLGATHER]
    assert [list(r.first_dims) for r in gathers] == [[1, 2, 3]] * 3
    assert any(len(r.tensor_names) > 1 for r in seen[0])  # some fused
    for response in seen[0]:
        if response.type == npb.RESPONSE_TYPE_ALLREDUCE:  # fused up to 64 bytes
            assert sum((int(n[1:]) % 5 + 1) * 4 for n in response.tensor_names) <= 64
    for s in streams:
        s.cancel()


def test_fusion_over_a_real_stream(client):
    job, workers, streams = open_world(client, 2, fusion_threshold_bytes=64)
    batch = [
        tensor("a", shape=(4,)),
        tensor("b", shape=(8,)),
        tensor("c", shape=(8,)),
        tensor("h", dtype="float16", shape=(4,)),
    ]
    streams[0].send(*batch)
    streams[1].send(*batch)
    names = [list(r.tensor_names) for r in streams[1].responses()]
    assert names == [["a", "b"], ["c"], ["h"]]
    assert [list(r.tensor_names) for r in streams[0].responses()] == names
    for s in streams:
        s.cancel()


def test_mismatch_and_duplicate_errors(client):
    job, workers, streams = open_world(client, 2)
    streams[0].send(tensor("grad.w", dtype="float32"))
    streams[1].send(tensor("grad.w", dtype="float64"))
    for s in streams:
        (resp,) = s.responses()
        assert resp.type == npb.RESPONSE_TYPE_ERROR
        assert resp.error_message == (
            "tensor 'grad.w': mismatched dtype: rank 0 float32, rank 1 float64"
        )
    streams[0].send(tensor("dup"))
    streams[0].send(tensor("dup"))
    for s in streams:
        (resp,) = s.responses()
        assert resp.error_message == "tensor 'dup': rank 0 submitted it twice"
    for s in streams:
        s.cancel()


def test_stream_protocol_errors(client):
    job, workers, streams = open_world(client, 1)
    stale = client.stream(job, workers[0], 5)
    with pytest.raises(grpc.RpcError) as info:
        stale.recv()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    twice = client.stream(job, workers[0], 1)
    with pytest.raises(grpc.RpcError) as info:
        twice.recv()
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call = client.negotiation.Negotiate(
        iter([npb.WorkerMessage(requests=npb.RequestList())]), metadata=client.metadata, timeout=5
    )
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    streams[0].cancel()


def test_closed_stream_loses_the_member_and_fails_the_job(client, shared):
    job, workers, streams = open_world(client, 3)
    streams[0].send(tensor("pending"))
    time.sleep(0.2)
    streams[1].cancel()
    for s in (streams[0], streams[2]):
        lost = s.event()
        assert lost.type == npb.EVENT_TYPE_MEMBER_LOST
        assert (lost.rank, lost.message) == (1, "stream closed")
        failed = s.event()
        assert failed.type == npb.EVENT_TYPE_JOB_FAILED and "rank 1" in failed.message
    err = code_of(client.join, job, "new", 3)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rank 1" in err.details() and "stream closed" in err.details()
    detail = httpx.get(f"{shared.http_url}/api/v1/jobs/{job}", timeout=5).json()
    assert detail["state"] == "failed"
    assert [m["state"] for m in detail["members"]] == ["active", "lost", "active"]
    assert "ERROR" in shared.log()
    for s in streams:
        s.cancel()


def test_leave_errors_pending_tensors_and_tells_the_others(client):
    job, workers, streams = open_world(client, 2)
    streams[0].send(tensor("never"))
    time.sleep(0.2)
    client.leave(job, workers[1])
    streams[1].close()
    (resp,) = streams[0].responses()
    assert resp.type == npb.RESPONSE_TYPE_ERROR
    assert resp.error_message.startswith("tensor 'never' cannot complete: rank 1 (host ")
    assert resp.error_message.endswith(") has shut down")
    assert streams[0].event().type == npb.EVENT_TYPE_MEMBER_LEFT
    streams[0].send(tensor("later"))
    assert "cannot complete" in streams[0].responses()[0].error_message
    client.leave(job, workers[0])
    streams[0].close()


def add_set(client, job, worker, set_id, ranks, generation=1):
    return client.negotiation.AddProcessSet(
        npb.AddProcessSetRequest(
            job_id=job,
            worker_id=worker,
            generation=generation,
            process_set_id=set_id,
            ranks=ranks,
        ),
        metadata=client.metadata,
        timeout=5,
    )


def remove_set(client, job, worker, set_id, generation=1):
    return client.negotiation.RemoveProcessSet(
        npb.RemoveProcessSetRequest(
            job_id=job, worker_id=worker, generation=generation, process_set_id=set_id
        ),
        metadata=client.metadata,
        timeout=5,
    )


def add_everywhere(client, job, workers, set_id, ranks, generation=1):
    """Every rank calls AddProcessSet at once (a collective); each call's answer or error."""
    return together(*(partial(add_set, client, job, w, set_id, ranks, generation) for w in workers))


def remove_everywhere(client, job, workers, set_id, generation=1):
    """Every rank calls RemoveProcessSet at once (a collective); each call's answer or error."""
    return together(*(partial(remove_set, client, job, w, set_id, generation) for w in workers))


def test_process_set_registration_errors(client):
    job, workers, streams = open_world(client, 3)
    assert all(isinstance(r, npb.AddProcessSetResponse)
               for r in add_everywhere(client, job, workers, 1, [0, 2]))  # every rank calls it
    for set_id, ranks, text in [
        (0, [0, 1], "at least 1"),
        (2, [1, 0], "ascending and distinct"),
        (2, [0, 3], "must lie in [0, 3)"),
        (1, [0, 1], "registered with ranks [0, 2], not [0, 1]"),
    ]:
        for err in add_everywhere(client, job, workers, set_id, ranks):  # fails on every rank
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.details()
    err = code_of(add_set, client, job, workers[0], 2, [0, 1], generation=7)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    err = code_of(add_set, client, job, "stranger", 2, [0, 1])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    err = code_of(add_set, client, "no-such-job", workers[0], 2, [0, 1])
    assert err.code() == grpc.StatusCode.NOT_FOUND
    for err in remove_everywhere(client, job, workers, 0):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(isinstance(r, npb.RemoveProcessSetResponse)
               for r in remove_everywhere(client, job, workers, 9))  # unknown: idempotent
    for s in streams:
        s.cancel()


def test_collectives_on_a_process_set_and_its_removal(client):
    job, workers, streams = open_world(client, 3)
    assert all(isinstance(r, npb.AddProcessSetResponse)
               for r in add_everywhere(client, job, workers, 1, [0, 2]))
    streams[2].send(tensor("g", op=npb.OP_TYPE_ALLGATHER, shape=(5, 2), process_set_id=1))
    streams[0].send(tensor("g", op=npb.OP_TYPE_ALLGATHER, shape=(1, 2), process_set_id=1))
    for rank in (0, 2):
        (resp,) = streams[rank].responses()
        assert resp.type == npb.RESPONSE_TYPE_ALLGATHER and resp.process_set_id == 1
        assert list(resp.first_dims) == [1, 5]
    streams[1].assert_silent()
    streams[0].send(tensor("p", process_set_id=1))
    time.sleep(0.2)
    assert all(isinstance(r, npb.RemoveProcessSetResponse)
               for r in remove_everywhere(client, job, workers, 1))
    (resp,) = streams[0].responses()
    assert resp.type == npb.RESPONSE_TYPE_ERROR
    assert resp.error_message == "tensor 'p': process set 1 was removed"
    streams[2].send(tensor("q", process_set_id=1))
    assert "unknown process set 1" in streams[2].responses()[0].error_message
    streams[1].assert_silent(0.1)
    for s in streams:
        s.cancel()


def test_join_over_real_streams(client):
    job, workers, streams = open_world(client, 2)
    streams[1].send(npb.TensorRequest(name="join.0", op_type=npb.OP_TYPE_JOIN))
    streams[0].send(tensor("x", shape=(3,)))
    for s in streams:
        (resp,) = s.responses()
        assert resp.type == npb.RESPONSE_TYPE_ALLREDUCE and list(resp.tensor_names) == ["x"]
        assert [(f.name, list(f.shape)) for f in resp.join_fill] == [("x", [3])]
    streams[0].send(tensor("b", op=npb.OP_TYPE_BROADCAST))
    (resp,) = streams[0].responses()
    assert resp.error_message.startswith("tensor 'b' (broadcast) cannot run while rank(s) 1")
    streams[0].send(npb.TensorRequest(name="join.0", op_type=npb.OP_TYPE_JOIN))
    for s in streams:
        (resp,) = s.responses()
        assert resp.type == npb.RESPONSE_TYPE_JOIN and resp.last_joined_rank == 0
    streams[1].assert_silent(0.1)
    for s in streams:  # joined state cleared: training goes on with both ranks
        s.send(tensor("y"))
    for s in streams:
        (resp,) = s.responses()
        assert list(resp.tensor_names) == ["y"] and len(resp.join_fill) == 0
    for s in streams:
        s.cancel()
