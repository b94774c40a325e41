"""Waiting on the mesh's sockets with poll(): any descriptor number works.

``select()`` takes descriptors below 1024 only; a worker that holds more
files (a big data loader, or strangers' connections during set-up) would
fail its exchanges. poll() has no such limit and, for the few sockets of a
mesh, costs about the same.

Before it sleeps in poll(), an exchange whose caller waits in its own thread
polls its sockets without sleeping for up to ``SPIN_S``. Waking a process
that sleeps is the kernel's dearest step on a virtual machine: on the
Intel host of bench/README.md ("Twelfth pass") a 64-byte round trip over a
Unix socket took 85 µs between two sleeping processes and 5 µs between two
spinning ones. Only where each rank on the machine has a core of its own
(:func:`cores_for`): a rank that spins on a shared core delays the very
peer it waits for.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Sequence

__all__ = ["SPIN_S", "cores_for", "ready_sockets"]

#: How long a waiting caller's exchange polls without sleeping, in seconds.
SPIN_S = 200e-6


def cores_for(ranks: int) -> bool:
    """Whether this process may run on at least ``ranks`` cores (its affinity,
    where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return ranks <= cores

_BROKEN = select.POLLERR | select.POLLHUP | select.POLLNVAL


def ready_sockets(wake: socket.socket, reading: Sequence[socket.socket],
                  writing: Sequence[socket.socket], timeout: float, spin_until: float = 0.0
                  ) -> tuple[list[socket.socket], list[socket.socket]]:
    """The sockets of ``reading`` ready to read and of ``writing`` ready to write.

    Waits at most ``timeout`` seconds, or until ``wake`` is readable (it is
    never returned: the caller checks why it was woken). Errors and hang-ups
    count as ready both ways, as with select(): the read or the write then
    raises the socket's error. Until ``spin_until`` (a ``time.perf_counter()``
    time) it asks without sleeping, and sleeps only after it.
    """
    poller = select.poll()
    wanted: dict[int, int] = {wake.fileno(): select.POLLIN}
    by_fd: dict[int, socket.socket] = {}
    for conn in reading:
        by_fd[conn.fileno()] = conn
        wanted[conn.fileno()] = select.POLLIN
    for conn in writing:
        by_fd[conn.fileno()] = conn
        wanted[conn.fileno()] = wanted.get(conn.fileno(), 0) | select.POLLOUT
    for fd, mask in wanted.items():
        poller.register(fd, mask)
    ready_in: list[socket.socket] = []
    ready_out: list[socket.socket] = []
    events: list[tuple[int, int]] = []
    while not events and time.perf_counter() < spin_until:
        events = poller.poll(0)
    if not events:
        events = poller.poll(max(0.0, timeout) * 1000.0)
    for fd, got in events:
        if fd not in by_fd:
            continue  # the wake-up socket
        if got & (select.POLLIN | _BROKEN) and wanted[fd] & select.POLLIN:
            ready_in.append(by_fd[fd])
        if got & (select.POLLOUT | _BROKEN) and wanted[fd] & select.POLLOUT:
            ready_out.append(by_fd[fd])
    return ready_in, ready_out
