"""Waiting on the mesh's sockets with poll(): any descriptor number works.

``select()`` takes descriptors below 1024 only; a worker that holds more
files (a big data loader, or strangers' connections during set-up) would
fail its exchanges. poll() has no such limit and, for the few sockets of a
mesh, costs about the same.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Sequence

__all__ = ["ready_sockets"]

_BROKEN = select.POLLERR | select.POLLHUP | select.POLLNVAL


def ready_sockets(wake: socket.socket, reading: Sequence[socket.socket],
                  writing: Sequence[socket.socket], timeout: float
                  ) -> tuple[list[socket.socket], list[socket.socket]]:
    """The sockets of ``reading`` ready to read and of ``writing`` ready to write.

    Waits at most ``timeout`` seconds, or until ``wake`` is readable (it is
    never returned: the caller checks why it was woken). Errors and hang-ups
    count as ready both ways, as with select(): the read or the write then
    raises the socket's error.
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
    for fd, got in poller.poll(max(0.0, timeout) * 1000.0):
        if fd not in by_fd:
            continue  # the wake-up socket
        if got & (select.POLLIN | _BROKEN) and wanted[fd] & select.POLLIN:
            ready_in.append(by_fd[fd])
        if got & (select.POLLOUT | _BROKEN) and wanted[fd] & select.POLLOUT:
            ready_out.append(by_fd[fd])
    return ready_in, ready_out
