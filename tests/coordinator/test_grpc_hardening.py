"""Hostile or odd input over real gRPC: each is refused alone, the job and the coordinator stay up.

A real coordinator process; fake workers on the stubs (``coordinator_clients``).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import httpx
import pytest
from coordinator_clients import Client, code_of, open_world, tensor, together
from support.coordinator import CoordinatorProcess

from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2, store_pb2

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def shared():
    """One coordinator for the module; every test uses its own job id."""
    with CoordinatorProcess(["--lease-s", "30"]) as proc:
        yield proc
        proc.stop()
        proc.dump_log()


@pytest.fixture
def client(shared):
    c = Client(shared.grpc_address, shared.token)
    yield c
    c.close()



def job_state(shared, job: str) -> str:
    return httpx.get(f"{shared.http_url}/api/v1/jobs/{job}", timeout=5).json()["state"]


# ---- enum values the coordinator does not know -----------------------------------------

UNKNOWN_OP, UNKNOWN_REDUCE = 99, 77


@pytest.mark.parametrize(
    ("first", "second", "says"),
    [
        ({"op": UNKNOWN_OP}, {"op": UNKNOWN_OP}, "op_type 99"),
        ({"op": UNKNOWN_OP}, {}, "op_type"),
        ({"reduce_op": UNKNOWN_REDUCE}, {"reduce_op": UNKNOWN_REDUCE}, "reduce_op 77"),
        ({}, {"reduce_op": UNKNOWN_REDUCE}, "reduce_op"),
    ],
    ids=["op-both", "op-one", "reduce-both", "reduce-one"],
)
def test_unknown_enum_value_fails_that_tensor_only(client, shared, first, second, says):
    job, workers, streams = open_world(client, 2)
    streams[0].send(tensor("odd", **first))
    streams[1].send(tensor("odd", **second))
    for s in streams:
        (resp,) = s.responses()
        assert resp.type == npb.RESPONSE_TYPE_ERROR
        assert list(resp.tensor_names) == ["odd"]
        assert says in resp.error_message and "'odd'" in resp.error_message
    assert job_state(shared, job) == "running"
    for s in streams:  # the streams and the job stay up: the next request works
        s.send(tensor("next"))
    for s in streams:
        (resp,) = s.responses()
        assert resp.type == npb.RESPONSE_TYPE_ALLREDUCE and list(resp.tensor_names) == ["next"]
    assert "Traceback" not in shared.log()
    for worker, s in zip(workers, streams, strict=True):
        client.leave(job, worker)
        s.close()


# ---- store -----------------------------------------------------------------------------

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)


def test_store_add_past_int64_is_out_of_range_and_keeps_the_value(client):
    job = open_world(client, 1)[0]
    md, s = client.metadata, client.store

    def add(key: str, amount: int) -> int:
        request = store_pb2.StoreAddRequest(job_id=job, key=key, amount=amount)
        return s.Add(request, metadata=md, timeout=5).value

    def get(key: str) -> bytes:
        request = store_pb2.StoreGetRequest(job_id=job, key=key)
        return s.Get(request, metadata=md, timeout=5).value

    assert add("n", INT64_MAX) == INT64_MAX
    err = code_of(add, "n", 1)
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE and "'n'" in err.details()
    assert get("n") == str(INT64_MAX).encode()
    assert add("neg", INT64_MIN) == INT64_MIN
    assert code_of(add, "neg", -1).code() == grpc.StatusCode.OUT_OF_RANGE
    assert get("neg") == str(INT64_MIN).encode()
    # A value Set by hand that no int64 holds: Add refuses it before writing too.
    s.Set(store_pb2.StoreSetRequest(job_id=job, key="big", value=b"9" * 30), metadata=md, timeout=5)
    assert code_of(add, "big", 0).code() == grpc.StatusCode.OUT_OF_RANGE
    assert get("big") == b"9" * 30
    assert add("n", -1) == INT64_MAX - 1  # the key still works


# ---- refused calls ---------------------------------------------------------------------

GARBAGE = b"\xff\xff\xff\xff"  # no hora.v1 message decodes from it
METHODS = [
    (f"/{service.full_name}/{method.name}", method.client_streaming)
    for module in (rendezvous_pb2, store_pb2, npb)
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]


def raw_call(channel: grpc.Channel, method: str, streaming: bool, metadata) -> grpc.StatusCode:
    """Sends GARBAGE as the request of ``method`` (undecoded bytes); the status code."""
    if streaming:
        call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)
        responses = call(iter([GARBAGE]), metadata=metadata, timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            list(responses)
    else:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(GARBAGE, metadata=metadata, timeout=5)
    return info.value.code()


def refusal_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " refused /hora.v1." in line]


def test_garbage_requests_are_refused_without_tracebacks(coordinator_factory):
    proc = coordinator_factory("--lease-s", "30")
    rounds = 5
    with grpc.insecure_channel(proc.grpc_address) as channel:
        for _ in range(rounds):
            for method, streaming in METHODS:
                for metadata in ((), (("hora-token", "wrong"),)):
                    code = raw_call(channel, method, streaming, metadata)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, method
                code = raw_call(channel, method, streaming, proc.metadata)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, method
        # The coordinator still serves a well-formed call.
        client = Client(proc.grpc_address, proc.token)
        try:
            assert client.join_all("after-garbage", 1)[0].size == 1
        finally:
            client.close()
    log = proc.log()
    assert "Traceback" not in log
    assert "Unexpected" not in log
    lines = refusal_lines(log)
    # 3 kinds (missing token, wrong token, undecodable bytes) of 3 * rounds * 15 refusals:
    # about one line per kind (two if a run straddles the 10 s default interval).
    assert 3 <= len(lines) <= 6, lines
    assert any("missing job token" in line for line in lines)
    assert any("wrong job token" in line for line in lines)
    assert any("do not decode" in line for line in lines)


def test_refusal_log_lines_count_the_refusals_they_left_out(coordinator_factory):
    proc = coordinator_factory("--lease-s", "30", "--refusal-log-interval-s", "1")
    join = "/hora.v1.Rendezvous/Join"
    with grpc.insecure_channel(proc.grpc_address) as channel:
        for _ in range(5):
            assert raw_call(channel, join, False, ()) == grpc.StatusCode.UNAUTHENTICATED
        time.sleep(1.2)  # past the interval: the next refusal gets a line of its own
        assert raw_call(channel, join, False, ()) == grpc.StatusCode.UNAUTHENTICATED
    deadline = time.monotonic() + 5
    while len(refusal_lines(proc.log())) < 2:
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.05)
    lines = refusal_lines(proc.log())
    # Every refusal is either a line or counted in a later line.
    counted = [int(m.group(1)) for line in lines for m in [re.search(r"(\d+) more", line)] if m]
    assert len(lines) + sum(counted) == 6, lines
    assert counted, lines


# ---- jobs that never formed ------------------------------------------------------------


def job_ids(shared) -> list[str]:
    return [j["job_id"] for j in httpx.get(f"{shared.http_url}/api/v1/jobs", timeout=5).json()]


def jobs_metric(shared) -> float:
    text = httpx.get(f"{shared.http_url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hora_jobs{"))


def test_refused_joins_create_no_job(client, shared):
    before, counted = job_ids(shared), jobs_metric(shared)
    refusals = [
        {"size": 0},  # expected_size below 1
        {"size": -3},
        {"size": 2, "hint": 5},  # rank hint out of range
        {"size": 2, "hint": -2},
    ]
    for i in range(1000):
        bad = refusals[i % len(refusals)]
        err = code_of(client.join, f"refused-{i}", "w", bad["size"], hint=bad.get("hint", -1))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = code_of(client.join, "refused-no-worker", "", 1)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert job_ids(shared) == before
    assert jobs_metric(shared) == counted  # the coordinator's own table, as it exports it


def test_a_join_that_times_out_leaves_no_job(client, shared):
    job, kept = "timed-out-join", "half-gathered"
    assert code_of(client.join, job, "w0", 2, timeout=0.5).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # A job someone still waits for stays, though other joiners of it went away.
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.join, kept, "w0", 3, timeout=20)
        time.sleep(0.2)
        err = code_of(client.join, kept, "w1", 4, timeout=5)  # refused: size 3 is set
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = code_of(client.join, kept, "w2", 3, timeout=0.5)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while job in job_ids(shared):
            assert time.monotonic() < deadline, "the abandoned job was never dropped"
            time.sleep(0.05)
        assert kept in job_ids(shared)
        views = together(*(partial(client.join, kept, w, 3) for w in ("w1", "w2")))
        assert [v.size for v in views] == [3, 3]
        assert waiting.result(timeout=10).size == 3  # the waiting joiner was not forgotten
    for worker in ("w0", "w1", "w2"):
        client.leave(kept, worker)


# ---- limits ----------------------------------------------------------------------------


def test_each_limit_refuses_its_breach_and_changes_nothing(coordinator_factory):
    proc = coordinator_factory(
        "--lease-s", "30", "--max-jobs", "2", "--max-members-per-job", "3",
        "--max-id-length", "16", "--max-store-key-bytes", "8", "--max-store-value-bytes", "16",
    )
    client = Client(proc.grpc_address, proc.token)
    try:
        def listed() -> list[str]:
            return job_ids(proc)

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(client.join, "j" * 17, "w", 1).code() == invalid  # job id length
        assert code_of(client.join, "a", "w" * 17, 1).code() == invalid  # worker id length
        assert code_of(client.join, "a", "w", 4).code() == invalid  # members per job
        assert code_of(client.join, "a", "w", 1, min_size=1, max_size=4).code() == invalid
        assert listed() == []
        client.join("a", "w", 1)
        client.join("b", "w", 1)
        err = code_of(client.join, "c", "w", 1)  # jobs per coordinator
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 jobs" in err.details()
        assert sorted(listed()) == ["a", "b"]
        md, s = client.metadata, client.store

        def set_(key: str, value: bytes) -> None:
            s.Set(store_pb2.StoreSetRequest(job_id="a", key=key, value=value), metadata=md,
                  timeout=5)

        def get(key: str) -> grpc.StatusCode | bytes:
            try:
                request = store_pb2.StoreGetRequest(job_id="a", key=key)
                return s.Get(request, metadata=md, timeout=5).value
            except grpc.RpcError as exc:
                return exc.code()

        assert code_of(set_, "k" * 9, b"v").code() == invalid  # store key size
        assert code_of(set_, "k", b"v" * 17).code() == invalid  # store value size
        assert get("k" * 9) == invalid and get("k") == grpc.StatusCode.NOT_FOUND
        swap = store_pb2.StoreCompareSetRequest(job_id="a", key="k", expected=b"",
                                                desired=b"v" * 17)
        assert code_of(s.CompareSet, swap, metadata=md, timeout=5).code() == invalid
        assert get("k") == grpc.StatusCode.NOT_FOUND
        set_("k", b"v" * 16)  # at the limits: accepted
        assert get("k") == b"v" * 16
    finally:
        client.close()
