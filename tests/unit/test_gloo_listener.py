"""Gloo's listener is closed once its pairs are connected (issue 25, finding 1).

Ranks run in threads of this process, over real loopback sockets and real
ProcessGroupGloo groups, as in test_backends.py.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hora_native import BackendError, ReduceKind
from hora_native.gloo import GlooBackend
from hora_native.gloo_listener import LAZY_INIT_VARIABLE, listening_sockets

TIMEOUT = timedelta(seconds=20)


def build(size: int, prefix: str, store: dist.Store) -> list[GlooBackend]:
    backends: list[GlooBackend | None] = [None] * size
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            backends[rank] = GlooBackend(dist.PrefixStore(prefix, store), rank, size, TIMEOUT)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    run([lambda r=r: make(r) for r in range(size)])
    assert not errors, errors
    return backends  # type: ignore[return-value]


def run(fns) -> None:
    threads = [threading.Thread(target=fn) for fn in fns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a collective hung"


def loopback_listeners() -> set[tuple[str, int]]:
    return {address for _inode, address in listening_sockets().values()
            if address[0] == "127.0.0.1"}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_listener_is_left_and_the_old_ports_refuse_connections():
    before = loopback_listeners()
    backends = build(3, "gen1/", dist.HashStore())
    try:
        closed = {address for b in backends for address in b.closed_listeners}
        assert len(closed) == 3, closed  # one device per rank
        assert loopback_listeners() == before
        for address in closed:
            with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
                probe.settimeout(5)
                probe.connect(address)
    finally:
        for backend in backends:
            backend.close()


def test_every_collective_works_after_the_listener_is_closed():
    backends = build(3, "gen1/", dist.HashStore())
    sums: list[list[float]] = [[] for _ in range(3)]
    outputs = [torch.empty(3 * 2, dtype=torch.int32) for _ in range(3)]
    gathered = [torch.empty(3, 2, dtype=torch.int16) for _ in range(3)]
    roots = [torch.full((4,), float(r)) for r in range(3)]

    def work(r: int) -> None:
        b = backends[r]
        for _ in range(20):
            value = torch.full((5,), float(r + 1))
            b.allreduce(value, ReduceKind.SUM)
            sums[r].extend(value.tolist())
        b.broadcast(roots[r], 2)
        b.alltoallv(outputs[r], torch.full((6,), r, dtype=torch.int32), [2, 2, 2], [2, 2, 2])
        b.allgatherv(gathered[r], torch.full((1, 2), r, dtype=torch.int16), [1, 1, 1])
        b.barrier()

    try:
        run([lambda r=r: work(r) for r in range(3)])
        for r in range(3):
            assert sums[r] == [6.0] * 100
            assert torch.equal(roots[r], torch.full((4,), 2.0))
            assert outputs[r].tolist() == [0, 0, 1, 1, 2, 2]
            assert gathered[r].tolist() == [[0, 0], [1, 1], [2, 2]]
    finally:
        for backend in backends:
            backend.close()


def test_generations_and_subgroups_build_use_and_close_without_leaking():
    """New groups in one process (elastic generations, process sets), each closed."""
    store = dist.HashStore()
    before = loopback_listeners()
    start = open_fds()
    for generation in range(4):
        world = build(3, f"gen{generation}/", store)
        subgroup = build(2, f"gen{generation}/set1/", store)
        values = [torch.ones(3) for _ in range(5)]
        run([lambda b=world[r], v=values[r]: b.allreduce(v, ReduceKind.SUM) for r in range(3)]
            + [lambda b=subgroup[r], v=values[3 + r]: b.allreduce(v, ReduceKind.MAX)
               for r in range(2)])
        assert [v.tolist() for v in values] == [[3.0] * 3] * 3 + [[1.0] * 3] * 2
        assert not loopback_listeners() - before
        for backend in world + subgroup:
            backend.close()
        world = subgroup = []
    # Gloo closed its placeholders with its devices: nothing accumulates.
    assert open_fds() <= start + 8, os.listdir("/proc/self/fd")


def test_lazy_pair_connection_is_refused(monkeypatch):
    monkeypatch.setenv(LAZY_INIT_VARIABLE, "1")
    with pytest.raises(BackendError, match=LAZY_INIT_VARIABLE):
        GlooBackend(dist.HashStore(), 0, 1, TIMEOUT)
