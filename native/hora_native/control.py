"""A control mesh: small agreements (and small allreduces) over direct TCP connections.

The engine's rounds agree on which cached tensors are ready with one small
MIN-reduction per round. Through Gloo that costs about 0.45 ms here, more
than the data allreduce of a small tensor; a direct exchange over
connections that stay open costs about one TCP round trip (60-100 us on
loopback). Every rank sends its vector to every other rank and reduces what
it receives, so the mesh suits small worlds: the engine uses it up to
:data:`MAX_MESH_SIZE` ranks and Gloo above that.

A message may carry a payload after the vector: the engine sends the bytes
of the tensors it has ready with its vector, so that when every rank turns
out to be ready with the same tensors, the round has already moved the data
and a second exchange through Gloo is not needed (see
``hora._engine.Engine._round``). Sends and receives run concurrently on
non-blocking sockets, so payloads larger than the kernel's socket buffers
cannot deadlock two ranks that send to each other at once.

The mesh bootstraps through the same store as the data plane: each rank
listens on an ephemeral port and publishes ``host:port``; lower ranks accept,
higher ranks connect.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import BackendError

__all__ = ["ControlMesh", "MAX_MESH_SIZE"]

MAX_MESH_SIZE = 32

_HELLO = struct.Struct("<i")
# A message: number of int64 values, payload bytes; then the values, then the payload.
_MESSAGE = struct.Struct("<IQ")


class ControlMesh:
    """All-to-all exchange of small integer vectors between the ranks of a group.

    Args:
        store: the group's store (already prefixed with the generation).
        rank: this rank.
        size: number of ranks.
        timeout: the longest one exchange, or the set-up, may take.
        address: the interface to listen on.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 address: str) -> None:
        self.rank = rank
        self.size = size
        self._peers: dict[int, socket.socket] = {}
        seconds = timeout.total_seconds()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((address, 0))
            listener.listen(max(size, 1))
            listener.settimeout(seconds)
            store.set(f"ctl/{rank}", f"{address}:{listener.getsockname()[1]}")
            for peer in range(rank):
                host, port = store.get(f"ctl/{peer}").decode().rsplit(":", 1)
                conn = socket.create_connection((host, int(port)), timeout=seconds)
                conn.sendall(_HELLO.pack(rank))
                self._peers[peer] = conn
            for _ in range(rank + 1, size):
                conn, _addr = listener.accept()
                conn.settimeout(seconds)
                (peer,) = _HELLO.unpack(self._recv(conn, _HELLO.size, "hello"))
                self._peers[peer] = conn
        except (OSError, RuntimeError) as exc:
            self.close()
            raise BackendError(f"control mesh: rank {rank} of {size} could not connect: "
                               f"{exc}") from exc
        finally:
            listener.close()
        for conn in self._peers.values():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
        self._timeout = seconds
        self._peer_of = {conn: peer for peer, conn in self._peers.items()}
        self._buffers: dict[int, torch.Tensor] = {}

    def _recv(self, conn: socket.socket, n: int, what: str) -> bytes:
        chunks = []
        while n:
            chunk = conn.recv(n)
            if not chunk:
                raise BackendError(f"control mesh: a peer of rank {self.rank} closed its "
                                   f"connection during {what}")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def min(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum of every rank's ``values`` (all ranks pass the same length).

        Raises:
            BackendError: a peer died, disagreed on the length, or the timeout passed.
        """
        result = list(values)
        for theirs, _payload in self.exchange(values):
            result = [a if a < b else b for a, b in zip(result, theirs, strict=True)]
        return result

    def exchange(self, values: Sequence[int], payload: torch.Tensor | None = None
                 ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Sends ``values`` and ``payload`` (uint8) to every peer; returns what each rank sent.

        The result is indexed by rank and includes this rank's own values and
        payload. A received payload is a view of a buffer the mesh reuses: it
        is valid until the next exchange. Every rank must pass a vector of
        the same length; payload lengths may differ.

        Raises:
            BackendError: a peer died, disagreed on the length, or the timeout passed.
        """
        n = len(values)
        nbytes = 0 if payload is None else payload.numel()
        head = _MESSAGE.pack(n, nbytes) + struct.pack(f"<{n}q", *values)
        body = memoryview(payload.numpy()) if nbytes else None
        result: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * self.size
        result[self.rank] = (list(values), payload if nbytes else None)
        sending = {peer: _Outgoing(conn, head, body) for peer, conn in self._peers.items()}
        receiving = {peer: _Incoming(self, peer, n) for peer in self._peers}
        deadline = time.monotonic() + self._timeout
        try:
            for peer in list(sending):
                if sending[peer].push():
                    del sending[peer]
            while sending or receiving:
                ready_in, ready_out, _ = select.select(
                    [self._peers[p] for p in receiving], [self._peers[p] for p in sending],
                    [], max(0.0, deadline - time.monotonic()))
                if not ready_in and not ready_out:
                    raise BackendError(
                        f"control mesh: rank {self.rank} heard nothing from rank(s) "
                        f"{sorted(receiving) or sorted(sending)} for {self._timeout:g} s")
                for conn in ready_out:
                    peer = self._peer_of[conn]
                    if sending[peer].push():
                        del sending[peer]
                for conn in ready_in:
                    peer = self._peer_of[conn]
                    if receiving[peer].pull(conn):
                        result[peer] = receiving.pop(peer).message()
        except OSError as exc:
            raise BackendError(f"control mesh exchange failed on rank {self.rank}: {exc}") \
                from exc
        return result

    def _buffer(self, peer: int, nbytes: int) -> torch.Tensor:
        """The reused receive buffer for ``peer``, at least ``nbytes`` long."""
        buf = self._buffers.get(peer)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 2 * buf.numel() if buf is not None else 0),
                              dtype=torch.uint8)
            self._buffers[peer] = buf
        return buf[:nbytes]

    def close(self) -> None:
        peers, self._peers = self._peers, {}
        for conn in peers.values():
            try:
                conn.close()
            except OSError:
                pass


class _Outgoing:
    """One message on its way to one peer, sent as far as the socket takes it."""

    __slots__ = ("conn", "parts")

    def __init__(self, conn: socket.socket, head: bytes, body: memoryview | None) -> None:
        self.conn = conn
        self.parts = [memoryview(head)] + ([body] if body is not None else [])

    def push(self) -> bool:
        """Sends what the socket accepts now; True once everything is sent."""
        while self.parts:
            try:
                sent = self.conn.sendmsg(self.parts)
            except BlockingIOError:
                return False
            while sent and self.parts:
                if sent >= len(self.parts[0]):
                    sent -= len(self.parts[0])
                    self.parts.pop(0)
                else:
                    self.parts[0] = self.parts[0][sent:]
                    sent = 0
        return True


class _Incoming:
    """One message being received from one peer: header, values, then payload."""

    __slots__ = ("mesh", "peer", "n", "buf", "view", "got", "stage", "values", "payload")

    def __init__(self, mesh: ControlMesh, peer: int, n: int) -> None:
        self.mesh, self.peer, self.n = mesh, peer, n
        self.buf = bytearray(_MESSAGE.size)
        self.view = memoryview(self.buf)
        self.got = 0
        self.stage = 0  # 0: header, 1: values, 2: payload, 3: done
        self.values: list[int] | None = None
        self.payload: torch.Tensor | None = None

    def pull(self, conn: socket.socket) -> bool:
        """Reads what has arrived; True once the whole message is in."""
        while True:
            while self.got == len(self.view):
                self._advance()
                if self.stage == 3:
                    return True
            try:
                got = conn.recv_into(self.view[self.got:])
            except BlockingIOError:
                return False
            if not got:
                raise BackendError(f"control mesh: rank {self.peer} closed its connection to "
                                   f"rank {self.mesh.rank} during an exchange")
            self.got += got

    def _advance(self) -> None:
        self.got = 0
        if self.stage == 0:
            n, nbytes = _MESSAGE.unpack(self.buf)
            if n != self.n:
                raise BackendError(
                    f"control mesh: rank {self.peer} sent {n} values, rank {self.mesh.rank} "
                    f"{self.n}; the ranks' caches diverged")
            if nbytes:
                self.payload = self.mesh._buffer(self.peer, nbytes)
            self.buf = bytearray(8 * n)
            self.view = memoryview(self.buf)
            self.stage = 1
        elif self.stage == 1:
            self.values = list(struct.unpack(f"<{self.n}q", self.buf))
            if self.payload is not None:
                self.view = memoryview(self.payload.numpy())
                self.stage = 2
            else:
                self.stage = 3
        else:
            self.stage = 3

    def message(self) -> tuple[list[int], torch.Tensor | None]:
        assert self.values is not None
        return self.values, self.payload
