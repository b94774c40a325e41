"""Reattach and the journal over real gRPC, against real coordinator processes.

A coordinator restarted on the same ``--state-dir`` after a kill -9 keeps
every acknowledged write (jobs, generations, events, store keys, process
sets); one restarted without it rebuilds a running job from the first
member's report. Either way a member that does not re-attach within a lease
is lost, and reports that do not fit are refused without harming the job.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from coordinator_clients import Client, new_job_id

from hora_proto.v1 import rendezvous_pb2, store_pb2
from tests.support.coordinator import CoordinatorProcess

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def reattach(client: Client, view: rendezvous_pb2.WorldView, *, worker_id: str | None = None,
             generation: int | None = None, sets: dict[int, list[int]] | None = None,
             members=None) -> rendezvous_pb2.ReattachResponse:
    world = rendezvous_pb2.WorldView()
    world.CopyFrom(view)
    if generation is not None:
        world.generation = generation
    if members is not None:
        del world.members[:]
        world.members.extend(members)
    me = worker_id or view.members[view.rank].worker_id
    join = rendezvous_pb2.JoinRequest(job_id=view.job_id, worker_id=me, host="localhost",
                                      pid=1, expected_size=view.size, rank_hint=-1)
    request = rendezvous_pb2.ReattachRequest(
        join=join, world=world,
        process_sets=[rendezvous_pb2.ProcessSetSpec(process_set_id=i, ranks=r)
                      for i, r in (sets or {}).items()])
    return client.rendezvous.Reattach(request, metadata=client.metadata, timeout=5)


def restart(first: CoordinatorProcess, *extra: str) -> CoordinatorProcess:
    """SIGKILLs ``first`` and starts a coordinator on its ports with ``extra`` flags."""
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    return CoordinatorProcess(["--grpc-port", str(first.grpc_port), "--http-port",
                               str(first.http_port), *extra], token=first.token).start()


def job_state(client: Client, job: str) -> int:
    return client.heartbeat(job, "nobody").job_state


def test_a_killed_coordinator_loses_no_acknowledged_write(tmp_path):
    flags = ("--lease-s", "5", "--state-dir", str(tmp_path / "state"))
    first = CoordinatorProcess(flags).start()
    second = None
    client = Client(first.grpc_address, first.token)
    try:
        job = new_job_id()
        views = client.join_all(job, 2)
        for i in range(50):  # each acknowledged before the next
            client.store.Set(store_pb2.StoreSetRequest(job_id=job, key=f"k{i}", value=b"v%d" % i),
                             metadata=client.metadata, timeout=5)
        added = client.store.Add(store_pb2.StoreAddRequest(job_id=job, key="n", amount=7),
                                 metadata=client.metadata, timeout=5).value
        client.report_event(job, "blacklist", "host-x", "seen before the kill")
        second = restart(first, *flags)
        client.close()
        client = Client(second.grpc_address, second.token)
        for i in range(50):
            got = client.store.Get(store_pb2.StoreGetRequest(job_id=job, key=f"k{i}",
                                                             timeout_ms=100),
                                   metadata=client.metadata, timeout=5).value
            assert got == b"v%d" % i
        assert client.store.Add(store_pb2.StoreAddRequest(job_id=job, key="n", amount=1),
                                metadata=client.metadata, timeout=5).value == added + 1
        kinds = [(e.kind, e.message) for e in client.list_events(job)]
        assert ("blacklist", "seen before the kill") in kinds
        assert any(kind == "generation" for kind, _ in kinds)
        # The running generation came back; both members re-attach and go on.
        for view in views:
            assert reattach(client, view).restored is False
        assert client.heartbeat(job, views[0].members[0].worker_id).generation == 1
        assert job_state(client, job) == rendezvous_pb2.JOB_STATE_RUNNING
    finally:
        client.close()
        first.stop()
        if second is not None:
            second.stop()


def test_without_a_journal_the_first_report_rebuilds_the_job_and_the_silent_member_is_lost():
    first = CoordinatorProcess(["--lease-s", "2"]).start()
    second = None
    client = Client(first.grpc_address, first.token)
    try:
        job = new_job_id()
        views = client.join_all(job, 3)
        second = restart(first, "--lease-s", "2")
        client.close()
        client = Client(second.grpc_address, second.token)
        with pytest.raises(grpc.RpcError) as unknown:
            client.heartbeat(job, "w0")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert reattach(client, views[0]).restored is True
        assert reattach(client, views[1]).restored is False
        # views[2] never re-attaches: a non-elastic job fails once the re-attach
        # window (10 s, longer than this 2 s lease) has passed.
        deadline = time.monotonic() + 30
        while job_state(client, job) != rendezvous_pb2.JOB_STATE_FAILED:
            assert time.monotonic() < deadline, "the silent member was never lost"
            for view in views[:2]:  # the re-attached members stay alive
                client.heartbeat(job, view.members[view.rank].worker_id, 1)
            time.sleep(0.2)
        failure = client.heartbeat(job, "nobody").failure
        assert "rank 2" in failure and "lease expired" in failure, failure
    finally:
        client.close()
        first.stop()
        if second is not None:
            second.stop()


def test_reports_that_do_not_fit_are_refused_and_the_job_goes_on(coordinator):
    client = Client(coordinator.grpc_address, coordinator.token)
    try:
        job = new_job_id()
        views = client.join_all(job, 2)

        def refused(code: grpc.StatusCode, **kwargs) -> str:
            with pytest.raises(grpc.RpcError) as error:
                reattach(client, views[0], **kwargs)
            assert error.value.code() == code, error.value
            return error.value.details()

        assert "no longer running" in refused(grpc.StatusCode.FAILED_PRECONDITION, generation=7)
        assert "not an active member" in refused(grpc.StatusCode.FAILED_PRECONDITION,
                                                 worker_id="stranger")
        assert "set" in refused(grpc.StatusCode.INVALID_ARGUMENT, sets={1: [5, 9]})
        # Unknown job: a report whose ranks are not 0..size-1 builds nothing.
        bad = client.join_all(new_job_id(), 2)[0]
        bad.job_id = new_job_id()
        members = list(bad.members)
        members[1].rank = 5
        with pytest.raises(grpc.RpcError) as error:
            reattach(client, bad, members=members)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError):
            client.heartbeat(bad.job_id, "w0")  # no job was made of it
        # The job the refusals named goes on, and a fitting report is taken.
        assert reattach(client, views[1], sets={1: [0, 1]}).restored is False
        assert job_state(client, job) == rendezvous_pb2.JOB_STATE_RUNNING
    finally:
        client.close()
