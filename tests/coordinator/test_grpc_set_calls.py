"""AddProcessSet and RemoveProcessSet as collectives, over real gRPC.

A real coordinator process, fake workers on the stubs. Every rank of the
generation calls; each call waits for the others; the coordinator decides
once and every call gets the same answer. A call that can never complete
(a rank never calls, a rank leaves or is lost) ends on every waiting rank
with an error that names the rank.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import pytest
from coordinator_clients import Client, open_world, tensor, together
from support.coordinator import CoordinatorProcess

from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def shared():
    """One coordinator for the module, checking deadlines often; one job id per test."""
    with CoordinatorProcess(["--lease-s", "30", "--stall-check-interval-s", "0.1"]) as proc:
        yield proc
        proc.stop()
        proc.dump_log()


@pytest.fixture
def client(shared):
    c = Client(shared.grpc_address, shared.token)
    yield c
    c.close()


def add_calls(client, job, workers, calls):
    """AddProcessSet from each worker at once; ``calls`` holds each one's (id, ranks[, invalid])."""
    return together(
        *(
            partial(client.add_process_set, job, w, *call)
            for w, call in zip(workers, calls, strict=True)
        )
    )


def remove_calls(client, job, workers, calls):
    """RemoveProcessSet from each worker at once; ``calls`` holds each one's (id[, invalid])."""
    return together(
        *(
            partial(client.remove_process_set, job, w, *call)
            for w, call in zip(workers, calls, strict=True)
        )
    )


def failures(outcomes) -> set[tuple[grpc.StatusCode, str]]:
    """The distinct (code, details) of the calls; fails the test when one succeeded."""
    assert all(isinstance(o, grpc.RpcError) for o in outcomes), outcomes
    return {(o.code(), o.details()) for o in outcomes}


def succeeded(outcomes) -> bool:
    return not any(isinstance(o, grpc.RpcError) for o in outcomes)


def allreduce_runs_on(streams, ranks, set_id, name) -> None:
    """The set's members submit ``name``; each gets the ALLREDUCE, the others nothing."""
    for rank in ranks:
        streams[rank].send(tensor(name, process_set_id=set_id))
    for rank in ranks:
        (resp,) = streams[rank].responses()
        assert (resp.type, resp.process_set_id) == (npb.RESPONSE_TYPE_ALLREDUCE, set_id), resp
    for rank, stream in enumerate(streams):
        if rank not in ranks:
            stream.assert_silent(0.1)


def unknown_set(stream, set_id, name) -> None:
    stream.send(tensor(name, process_set_id=set_id))
    (resp,) = stream.responses()
    assert f"unknown process set {set_id}" in resp.error_message, resp


# ---- add ----------------------------------------------------------------------------------


def test_a_set_every_rank_adds_alike_is_registered(client):
    job, workers, streams = open_world(client, 3)
    assert succeeded(add_calls(client, job, workers, [(1, [0, 2])] * 3))
    allreduce_runs_on(streams, (0, 2), 1, "x")
    for s in streams:
        s.cancel()


def test_each_call_waits_for_every_rank(client):
    job, workers, streams = open_world(client, 2)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.add_process_set, job, workers[0], 1, [0, 1])
        time.sleep(0.5)
        assert not first.done()  # rank 1 has not called yet
        client.add_process_set(job, workers[1], 1, [0, 1])
        assert isinstance(first.result(timeout=5), npb.AddProcessSetResponse)
    allreduce_runs_on(streams, (0, 1), 1, "x")
    for s in streams:
        s.cancel()


def test_one_ranks_problem_fails_the_call_on_every_rank(client):
    job, workers, streams = open_world(client, 2)
    problem = "ProcessSet(process_set_id=1, ranks=[0, 1]) has already been added"
    out = add_calls(client, job, workers, [(1, [0, 1]), (1, [0, 1], problem)])
    assert failures(out) == {
        (INVALID, f"add_process_set failed on every rank because of rank 1: {problem}")
    }
    unknown_set(streams[0], 1, "x")  # nothing was registered
    for s in streams:
        s.cancel()


def test_every_ranks_problem_is_named(client):
    job, workers, streams = open_world(client, 3)
    out = add_calls(client, job, workers, [(1, [], "bad 0"), (1, [0, 1]), (1, [0], "bad 2")])
    assert failures(out) == {
        (INVALID, "add_process_set failed on every rank because of rank 0: bad 0; rank 2: bad 2")
    }
    for s in streams:
        s.cancel()


def test_ranks_that_pass_different_sets_all_fail(client):
    job, workers, streams = open_world(client, 3)
    out = add_calls(client, job, workers, [(1, [0, 1]), (1, [0, 2]), (1, [0, 1])])
    assert failures(out) == {
        (
            INVALID,
            "ranks called add_process_set with different sets: rank 0: [0, 1]; "
            "rank 1: [0, 2]; rank 2: [0, 1]",
        )
    }
    unknown_set(streams[0], 1, "x")
    for s in streams:
        s.cancel()


def test_a_set_the_coordinator_refuses_fails_on_every_rank(client):
    job, workers, streams = open_world(client, 2)
    out = add_calls(client, job, workers, [(1, [0, 2])] * 2)
    assert failures(out) == {
        (
            INVALID,
            "add_process_set failed on every rank: process set 1 ranks [0, 2] must lie in [0, 2)",
        )
    }
    for s in streams:
        s.cancel()


def test_a_valid_call_after_an_invalid_one_works(client):
    job, workers, streams = open_world(client, 2)
    assert failures(add_calls(client, job, workers, [(1, [0]), (1, [1])]))
    assert succeeded(add_calls(client, job, workers, [(1, [0, 1])] * 2))
    allreduce_runs_on(streams, (0, 1), 1, "x")
    assert succeeded(add_calls(client, job, workers, [(2, [1])] * 2))
    allreduce_runs_on(streams, (1,), 2, "y")
    for s in streams:
        s.cancel()


# ---- calls that can never complete --------------------------------------------------------


def test_a_rank_that_never_calls_fails_the_others_at_the_deadline_naming_it(client):
    job, workers, streams = open_world(client, 3, stall_shutdown_ms=1000)
    start = time.monotonic()
    out = add_calls(client, job, workers[:2], [(1, [0, 1])] * 2)
    waited = time.monotonic() - start
    ((code, details),) = failures(out)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert details == (
        "add_process_set did not complete: rank(s) 2 did not call it within 1 s "
        "(the job's stall shutdown time)"
    )
    assert 0.9 < waited < 5, waited
    # The job goes on: the next call, made by every rank, works.
    assert succeeded(add_calls(client, job, workers, [(1, [0, 1])] * 3))
    allreduce_runs_on(streams, (0, 1), 1, "x")
    for s in streams:
        s.cancel()


def test_a_rank_that_leaves_while_others_wait_fails_them_at_once(client):
    job, workers, streams = open_world(client, 3)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(client.add_process_set, job, w, 1, [0, 1]) for w in workers[:2]]
        time.sleep(0.5)
        assert not any(f.done() for f in waiting)
        client.leave(job, workers[2])
        start = time.monotonic()
        out = [f.exception(timeout=5) for f in waiting]
        assert time.monotonic() - start < 2
    ((code, details),) = failures(out)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.startswith("add_process_set cannot complete: rank 2 (host ")
    assert details.endswith(") has shut down")
    # A later call cannot complete either: it fails at once.
    with pytest.raises(grpc.RpcError) as info:
        client.remove_process_set(job, workers[0], 1, timeout=3)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().endswith(") has shut down")
    for s in streams:
        s.cancel()


def test_a_lost_rank_fails_the_waiting_calls_at_once(client):
    job, workers, streams = open_world(client, 2)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.add_process_set, job, workers[0], 1, [0, 1])
        time.sleep(0.5)
        streams[1].cancel()  # rank 1 crashes
        error = waiting.exception(timeout=5)
    assert isinstance(error, grpc.RpcError), error
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("add_process_set cannot complete: rank 1 (host ")
    assert "was lost: stream closed" in error.details()
    streams[0].cancel()


def test_an_elastic_reset_fails_the_waiting_calls_at_once(client):
    job, workers, streams = open_world(client, 2, min_size=1)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.remove_process_set, job, workers[0], -1)
        time.sleep(0.5)
        client.leave(job, workers[1], "reset", rejoin=True)
        error = waiting.exception(timeout=5)
    assert isinstance(error, grpc.RpcError), error
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("remove_process_set cannot complete: rank 1 (host ")
    for s in streams:
        s.cancel()


def test_a_cancelled_call_stops_waiting(client):
    job, workers, streams = open_world(client, 2)
    with pytest.raises(grpc.RpcError) as info:
        client.add_process_set(job, workers[0], 1, [0], timeout=0.3)  # gives up
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.2)
    # Its call no longer counts: the next call waits for both ranks again.
    assert succeeded(add_calls(client, job, workers, [(1, [0, 1])] * 2))
    allreduce_runs_on(streams, (0, 1), 1, "x")
    for s in streams:
        s.cancel()


# ---- remove -------------------------------------------------------------------------------


def test_remove_is_a_collective_with_the_same_rules(client):
    job, workers, streams = open_world(client, 2)
    assert succeeded(add_calls(client, job, workers, [(1, [0, 1])] * 2))
    problem = "the global process set cannot be removed"
    out = remove_calls(client, job, workers, [(1,), (0, problem)])
    assert failures(out) == {
        (INVALID, f"remove_process_set failed on every rank because of rank 1: {problem}")
    }
    out = remove_calls(client, job, workers, [(1,), (-1,)])
    assert failures(out) == {
        (
            INVALID,
            "ranks called remove_process_set with different sets: rank 0: process set 1; "
            "rank 1: a set it never added",
        )
    }
    allreduce_runs_on(streams, (0, 1), 1, "x")  # still registered after both failures
    assert succeeded(remove_calls(client, job, workers, [(1,)] * 2))
    unknown_set(streams[1], 1, "y")
    assert succeeded(remove_calls(client, job, workers, [(-1,)] * 2))  # nobody added it
    assert succeeded(remove_calls(client, job, workers, [(1,)] * 2))  # gone already: idempotent
    for s in streams:
        s.cancel()
