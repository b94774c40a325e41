"""The mesh's messages on the wire, one peer's at a time (see :mod:`.mesh_transport`).

A message: number of int64 values, payload bytes, where the payload lies in
the sender's shared segment (offset, segment version; version -1: the bytes
follow the values on the socket); then the values, then any inline payload.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Protocol

import torch

from .base import BackendError

__all__: list[str] = []  # private to the mesh


class MeshTransport(Protocol):
    """What a message uses of its mesh (``.mesh_transport.MeshTransport``; a protocol,
    so this module does not import the one that imports it)."""

    @property
    def rank(self) -> int: ...
    def _peer_payload(self, peer: int, version: int, offset: int, nbytes: int
                      ) -> torch.Tensor: ...
    def _buffer(self, peer: int, nbytes: int) -> torch.Tensor: ...

_MESSAGE = struct.Struct("<IQQq")
_INLINE = -1
# The most values a message of any length may carry (a control vector lists the
# ready and invalid slots of a response cache, far fewer).
MAX_VALUES = 1 << 24


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

    __slots__ = ("mesh", "peer", "n", "locate", "buf", "view", "got", "stage", "values",
                 "payload", "shared")

    def __init__(self, mesh: MeshTransport, peer: int, n: int | None,
                 locate: Callable[[int, int, int, int], torch.Tensor] | None = None) -> None:
        self.mesh, self.peer, self.n = mesh, peer, n
        # Finds a payload the peer left in shared memory: (peer, version, offset, nbytes).
        self.locate = locate if locate is not None else mesh._peer_payload
        self.buf = bytearray(_MESSAGE.size)
        self.view = memoryview(self.buf)
        self.got = 0
        self.stage = 0  # 0: header, 1: values, 2: payload, 3: done
        self.values: list[int] | None = None
        self.payload: torch.Tensor | None = None  # inline bytes still to read
        self.shared: torch.Tensor | None = None  # bytes in the peer's segment

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
            n, nbytes, offset, version = _MESSAGE.unpack(self.buf)
            if self.n is None:  # any length (the sender's own), within reason
                if n > MAX_VALUES:
                    raise BackendError(f"control mesh: rank {self.peer} sent {n} values, more "
                                       f"than the {MAX_VALUES} a vector may hold")
                self.n = n
            elif n != self.n:
                raise BackendError(
                    f"control mesh: rank {self.peer} sent {n} values, rank {self.mesh.rank} "
                    f"{self.n}; the ranks' caches diverged")
            if nbytes and version != _INLINE:
                self.shared = self.locate(self.peer, version, offset, nbytes)
            elif nbytes:
                self.payload = self.mesh._buffer(self.peer, nbytes)
            self.buf = bytearray(8 * n)
            self.view = memoryview(self.buf)
            self.stage = 1
        elif self.stage == 1:
            self.values = list(struct.unpack(f"<{self.n}q", self.buf))
            if self.payload is not None:
                self.view = memoryview(self.payload.numpy())  # type: ignore[arg-type]
                self.stage = 2
            else:
                self.stage = 3
        else:
            self.stage = 3

    def message(self) -> tuple[list[int], torch.Tensor | None]:
        assert self.values is not None
        return self.values, self.shared if self.shared is not None else self.payload
