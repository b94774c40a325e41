"""The control mesh: ranks in threads of this process, over real loopback sockets."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hora_native import BackendError
from hora_native.mesh_transport import MeshTransport as ControlMesh

TOKEN = "unit-test-token"


def build(size: int, timeout: float = 10.0, shared: bool = False,
          local_ranks: int = 1) -> list[ControlMesh]:
    store = dist.HashStore()
    meshes: list[ControlMesh | None] = [None] * size

    def make(rank: int) -> None:
        meshes[rank] = ControlMesh(store, rank, size, timedelta(seconds=timeout), "127.0.0.1",
                                   shared_memory=shared, token=TOKEN, context="job/gen-1/",
                                   local_ranks=local_ranks)

    run_all([lambda r=r: make(r) for r in range(size)])
    return meshes  # type: ignore[return-value]


def run_all(fns):
    results, errors = [None] * len(fns), [None] * len(fns)

    def call(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "an exchange hung"
    return results, errors


def payload(rank: int, nbytes: int) -> torch.Tensor | None:
    if nbytes == 0:
        return None
    return (torch.arange(nbytes, dtype=torch.int64) * (rank + 3) % 251).to(torch.uint8)


@pytest.mark.parametrize("shared", [False, True], ids=["sockets", "shared-memory"])
def test_min_and_payloads_larger_than_socket_buffers_reach_every_rank(shared):
    meshes = build(3, shared=shared)
    assert all(m.shared == shared for m in meshes)

    def send(rank, vector, nbytes):
        data = payload(rank, nbytes)
        if data is not None:  # written where the mesh wants it, as the engine does
            buf = meshes[rank].payload_buffer(nbytes)
            buf.copy_(data)
            data = buf
        return meshes[rank].exchange(vector, data)

    # 8 MiB each way at once would deadlock blocking sends; sizes differ per
    # rank and grow (a shared segment is replaced by a larger one).
    for round_, sizes in enumerate([[8 << 20, 0, 12345], [100, 3 << 20, 0],
                                    [8 << 20, 5, 20 << 20], [1, 2, 3]]):
        vectors = [[rank, 10 - rank, round_] for rank in range(3)]
        results, errors = run_all([
            lambda r=r, v=vectors, n=sizes: send(r, v[r], n[r]) for r in range(3)])
        assert errors == [None] * 3
        for got in results:
            for sender, (values, data) in enumerate(got):
                assert values == vectors[sender]
                want = payload(sender, sizes[sender])
                assert (data is None) if want is None else torch.equal(data, want)
    results, errors = run_all([lambda r=r: meshes[r].min([r, 5 - r]) for r in range(3)])
    assert errors == [None] * 3 and results == [[0, 3]] * 3
    for mesh in meshes:
        mesh.close()


def test_vectors_of_different_lengths_are_an_error_not_a_hang():
    meshes = build(2)
    _, errors = run_all([lambda: meshes[0].exchange([1, 2]), lambda: meshes[1].exchange([1])])
    assert all(isinstance(e, BackendError) for e in errors)
    assert "diverged" in str(errors[0]) or "diverged" in str(errors[1])
    for mesh in meshes:
        mesh.close()


def test_vectors_of_any_length_travel_when_the_exchange_allows_them():
    """The agreement's vectors list ready slots only, so their lengths differ by rank."""
    meshes = build(3)
    sent = [[], [7], list(range(1000))]
    results, errors = run_all([lambda r=r: meshes[r].exchange(sent[r], uniform=False)
                               for r in range(3)])
    assert errors == [None] * 3
    assert all([values for values, _payload in got] == sent for got in results)
    # Then a uniform exchange still checks the lengths.
    _, errors = run_all([lambda: meshes[0].exchange([1, 2]), lambda: meshes[1].exchange([1]),
                         lambda: meshes[2].exchange([1, 2])])
    assert any(isinstance(e, BackendError) and "diverged" in str(e) for e in errors)
    for mesh in meshes:
        mesh.close()


def test_ranks_of_one_machine_talk_through_unix_domain_sockets():
    before = set(os.listdir("/dev/shm"))
    meshes = build(3, shared=True)
    assert all(m.local_peers == {0, 1, 2} - {m.rank} for m in meshes)
    assert {conn.family for m in meshes for conn in m._peers.values()} == {socket.AF_UNIX}
    results, errors = run_all([lambda r=r: meshes[r].min([r, 5 - r]) for r in range(3)])
    assert errors == [None] * 3 and results == [[0, 3]] * 3
    # The listeners' files went once their peers had connected.
    assert not [name for name in set(os.listdir("/dev/shm")) - before if name.endswith(".sock")]
    for mesh in meshes:
        mesh.close()
    # Without shared memory (ranks of several machines, or refused) they stay on TCP.
    meshes = build(2)
    assert {conn.family for m in meshes for conn in m._peers.values()} == {socket.AF_INET}
    for mesh in meshes:
        mesh.close()


@pytest.mark.parametrize("shared", [False, True], ids=["tcp", "unix"])
def test_a_closed_peer_fails_the_exchange(shared):
    meshes = build(3, shared=shared)
    meshes[2].close()
    _, errors = run_all([lambda: meshes[0].exchange([1]), lambda: meshes[1].exchange([1])])
    # Over TCP the send goes out and the read finds the connection closed; a
    # Unix-domain socket refuses the send at once (a broken pipe). Either names rank 2.
    said = ("rank 2 closed its connection",) if not shared else (
        "rank 2 closed its connection", "rank 2's connection broke")
    for error in errors:
        assert isinstance(error, BackendError) and any(s in str(error) for s in said), error
    for mesh in meshes:
        mesh.close()


@pytest.mark.parametrize("shared", [False, True], ids=["tcp", "unix"])
def test_a_peer_that_exits_with_our_message_unread_is_named(shared):
    # Closing a socket with unread bytes resets the connection (what a rank that
    # exits in the middle of a round leaves behind): the error names that rank.
    meshes = build(2, shared=shared)
    errors: list[BaseException] = []

    def wait_in_exchange() -> None:
        try:
            meshes[0].exchange([1], payload(0, 100))
        except BackendError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait_in_exchange)
    thread.start()
    readable, _, _ = select.select([meshes[1]._peers[0]], [], [], 30)
    assert readable, "rank 0's message never arrived"
    meshes[1].close()
    thread.join(60)
    assert not thread.is_alive()
    assert len(errors) == 1 and "rank 1's connection broke" in str(errors[0]), errors
    meshes[0].close()


def test_a_silent_peer_fails_the_exchange_at_the_timeout():
    meshes = build(2, timeout=1.0)
    with pytest.raises(BackendError, match=r"heard nothing from rank\(s\) \[1\] for 1 s"):
        meshes[0].exchange([1], payload(0, 100))
    for mesh in meshes:
        mesh.close()


def test_shared_segments_leave_no_files_behind():
    before = set(os.listdir("/dev/shm"))
    meshes = build(2, shared=True)
    for nbytes in (10, 5 << 20):
        run_all([lambda r=r, n=nbytes: meshes[r].exchange([r], meshes[r].payload_buffer(n))
                 for r in range(2)])
    for mesh in meshes:
        mesh.close()
    assert set(os.listdir("/dev/shm")) <= before


def test_abort_wakes_an_exchange_blocked_on_a_silent_peer_at_once():
    """A stopped peer keeps its sockets open; abort must not wait for the timeout."""
    meshes = build(2, timeout=60.0)
    timer = threading.Timer(0.5, meshes[0].abort, args=("rank 1 was lost",))
    timer.start()
    started = time.monotonic()
    with pytest.raises(BackendError, match=r"waiting for rank\(s\) \[1\] was aborted: rank 1 "
                                           r"was lost"):
        meshes[0].exchange([1], payload(0, 100))
    assert time.monotonic() - started < 10
    with pytest.raises(BackendError, match="aborted: rank 1 was lost"):
        meshes[0].exchange([1])  # and every later exchange
    timer.join()
    for mesh in meshes:
        mesh.close()


def test_a_waiting_caller_spins_only_where_each_local_rank_has_a_core_and_gets_every_message():
    """A caller's exchange (spin=True) polls before it sleeps, only where every
    rank on the machine has a core; a peer later than the spin, or one whose
    message arrives during it, reaches the exchange all the same, payload too,
    and a silent peer still fails it at the timeout."""
    cores = os.sched_getaffinity(0)
    meshes = build(2, timeout=2.0, shared=True)
    assert [m._spin for m in meshes] == [len(cores) >= 2] * 2

    def exchange(rank: int, late: float):
        if rank and late:
            time.sleep(late)
        return meshes[rank].exchange([rank + 10], payload(rank, 4096), spin=True)

    for late in (0.0, 0.05, 0.0):  # together, a peer late by far more than the spin, again
        results, errors = run_all([lambda r=r, late=late: exchange(r, late) for r in range(2)])
        assert errors == [None, None], (late, errors)
        for got in results:
            assert [values for values, _payload in got] == [[10], [11]], late
            assert all(torch.equal(sent, payload(r, 4096)) for r, (_v, sent) in enumerate(got))
    started = time.monotonic()
    with pytest.raises(BackendError, match="heard nothing from rank"):
        meshes[0].exchange([1], spin=True)
    assert time.monotonic() - started < 10
    for mesh in meshes:
        mesh.close()
    # On one core, two ranks of this machine would delay each other: no spin.
    os.sched_setaffinity(0, {min(cores)})
    try:
        crowded = build(2, shared=True)
    finally:
        os.sched_setaffinity(0, cores)
    assert [m._spin for m in crowded] == [False, False]
    for mesh in crowded:
        mesh.close()
    # Nor where the launcher placed more ranks here than there are cores, also
    # when they share no /dev/shm (their own containers, or shared memory off).
    crowded = build(2, shared=False, local_ranks=len(cores) + 1)
    assert [m.local_peers for m in crowded] == [frozenset(), frozenset()]
    assert [m._spin for m in crowded] == [False, False]
    for mesh in crowded:
        mesh.close()
