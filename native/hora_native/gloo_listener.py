"""Closing the listening socket Gloo leaves open once its pairs are connected.

torch's ProcessGroupGloo builds a tcp ``Device`` that listens on an
ephemeral port, connects every pair of the group through it (eagerly:
hora never sets ``TORCH_GLOO_LAZY_INIT``, see :func:`check_eager`), and then
keeps listening for the life of the group. That listener checks nothing and
keeps every socket it accepts until it reads a sequence number, so a
stranger who only opens and closes connections to it exhausts the worker's
file descriptors and Gloo aborts the process (issue 25, finding 1).

Gloo has no call to stop listening, so :func:`close_new_listeners` replaces
the listening socket under Gloo's feet: ``dup2`` puts a placeholder on the
listener's file descriptor, which closes the real socket in the kernel (the
port refuses new connections from then on, and the epoll set Gloo's loop
waits on drops it). The placeholder is a non-blocking listening Unix socket
whose path is unlinked at once: nobody can connect to it, so Gloo's loop,
should it be inside its accept loop at that instant, reads ``EAGAIN`` and
returns, and the epoll set never reports it. Gloo closes the placeholder
when the group is destroyed, as it would have closed its listener.

What this does not close: the set-up window itself. Between the moment a
rank's device listens and the moment its pairs are connected, a stranger who
finds the port can connect and send the sequence number a pair waits for
(small, predictable integers) and take that peer's place. Gloo's pair
connection carries no proof, so hora cannot refuse such a connection. The
rank paired with the stranger may then take in the stranger's bytes, and
the real peer's connection is never read, so we expect (not tested) that
the peer's first collective times out and the job fails. The window lasts
from the device's creation until the slowest rank of the group has
connected. In that window a flood also costs file descriptors: Gloo keeps
every stranger's connection that sent 8 bytes (filed under that "sequence
number") until the group is destroyed; the flood test once saw a worker at
668 open files after a long set-up. Closing the window needs authenticated
pairs in Gloo, or hora's own transport for the cross-host collectives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Iterator

__all__ = ["LAZY_INIT_VARIABLE", "addresses_of", "check_eager", "close_new_listeners",
           "closing_listeners", "listening_sockets"]

log = logging.getLogger("hora")

#: torch's switch that connects Gloo pairs at their first use instead of at set-up.
LAZY_INIT_VARIABLE = "TORCH_GLOO_LAZY_INIT"


def check_eager() -> None:
    """Raises ValueError when ``TORCH_GLOO_LAZY_INIT`` asks Gloo to connect pairs lazily.

    Lazily connected pairs need Gloo's listener for the whole job, which is
    exactly what hora closes after set-up.
    """
    value = os.environ.get(LAZY_INIT_VARIABLE, "").strip().lower()
    if value not in ("", "0", "false", "no", "off"):
        raise ValueError(
            f"{LAZY_INIT_VARIABLE}={os.environ[LAZY_INIT_VARIABLE]!r}: hora connects Gloo's "
            f"pairs at set-up and closes Gloo's listener after, so that strangers cannot "
            f"reach it; unset {LAZY_INIT_VARIABLE} for hora's workers")


class _Building:
    """The groups this process is building now, and what listened before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.before: dict[int, tuple[int, tuple[str, int]]] = {}
        self.hosts: set[str] = set()


_building = _Building()


@contextlib.contextmanager
def closing_listeners(address: str) -> Iterator[list[tuple[str, int]]]:
    """Closes, on leaving, the listeners Gloo opened on ``address`` meanwhile.

    Wrap the construction of a ProcessGroupGloo in it. When several threads
    build groups at once (ranks of one group in one process, in tests), the
    listeners are closed when the last construction ends: one group's
    listener must not vanish while another group still connects its pairs
    through it. A construction that fails leaves nothing to close (Gloo's
    device is gone with it).

    Yields:
        A list that receives the addresses closed, if this construction was
        the last to end (else it stays empty).
    """
    with _building.lock:
        if _building.count == 0:
            _building.before = listening_sockets()
            _building.hosts = set()
        _building.count += 1
        _building.hosts |= addresses_of(address)
    closed: list[tuple[str, int]] = []
    try:
        yield closed
    finally:
        with _building.lock:
            _building.count -= 1
            if _building.count == 0:
                closed += close_new_listeners(_building.before, _building.hosts)


def addresses_of(host: str) -> set[str]:
    """The IP addresses ``host`` (a name or an address) stands for, and ``host`` itself."""
    found = {host}
    try:
        found.update(str(info[4][0]) for info in socket.getaddrinfo(host, None))
    except OSError:
        pass
    return found


def listening_sockets() -> dict[int, tuple[int, tuple[str, int]]]:
    """This process's listening TCP sockets: fd -> (inode, local address).

    Read from ``/proc`` only: no socket object is made over another owner's
    descriptor (which could change its blocking mode).
    """
    listening = _listening_inodes()
    found: dict[int, tuple[int, tuple[str, int]]] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, say)
        if target.startswith("socket:["):
            inode = int(target[len("socket:["):-1])
            if inode in listening:
                found[int(name)] = (inode, listening[inode])
    return found


def _listening_inodes() -> dict[int, tuple[str, int]]:
    """Listening TCP sockets of this network namespace: inode -> local address."""
    found: dict[int, tuple[str, int]] = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/self/net/{table}", encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue  # no IPv6 in this kernel, say
        for row in rows:
            # sl, local (hex address:port), remote, state (0A: listen), ..., inode (10th)
            fields = row.split()
            if fields[3] != "0A":
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # The kernel prints the address as 32-bit words in host order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found[int(fields[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def close_new_listeners(before: dict[int, tuple[int, tuple[str, int]]],
                        hosts: set[str]) -> list[tuple[str, int]]:
    """Closes the listening sockets opened since ``before`` on one of ``hosts``.

    Args:
        before: :func:`listening_sockets` taken before the group was built.
        hosts: the IP addresses Gloo's device listens on; a listener other
            code opened meanwhile on another address is left alone.

    Returns:
        The addresses closed.
    """
    closed = []
    for fd, (inode, address) in listening_sockets().items():
        if before.get(fd, (None,))[0] == inode or address[0] not in hosts:
            continue
        with _placeholder() as placeholder:
            os.dup2(placeholder.fileno(), fd, inheritable=False)
        closed.append(address)
    if closed:
        log.debug("gloo: closed the listener(s) at %s after set-up",
                  ", ".join(f"{host}:{port}" for host, port in closed))
    return closed


@contextlib.contextmanager
def _placeholder() -> Iterator[socket.socket]:
    """A non-blocking listening Unix socket nobody can connect to (its path is gone)."""
    with tempfile.TemporaryDirectory(prefix="hora-gloo-") as where:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.path.join(where, "l"))
            sock.listen(1)
            sock.setblocking(False)
            os.unlink(os.path.join(where, "l"))
            yield sock
        finally:
            sock.close()
