"""The shared-memory segments of a mesh's swaps with local peers.

:meth:`.mesh_transport.MeshTransport.swap` uses them.

For each peer on this machine a rank keeps a segment of its own, apart
from the one its exchanges use: double-buffered (swaps alternate between
its halves, so that the peer may still read the last swap's while this one
is written) and grown by new versions. A segment goes from the file system
once the peer has answered a later swap, which it does only after opening it.
"""

from __future__ import annotations

import logging
import os

import torch

from .mesh_segments import Segment, peer_view, unlink

__all__ = ["SwapSegments"]

log = logging.getLogger("hora")


class SwapSegments:
    """A rank's swap segments for its local peers, and the peers' it mapped.

    Args:
        rank: this rank.
        shm_prefix: the mesh's segment prefix (for a message naming its directory).
    """

    def __init__(self, rank: int, shm_prefix: str) -> None:
        self._rank = rank
        self._shm_prefix = shm_prefix
        # Per peer: our segment (version, segment), the number of swaps so far,
        # the files to unlink after a given swap, and the peer's segment we mapped.
        self._own: dict[int, tuple[int, Segment]] = {}
        self._counts: dict[int, int] = {}
        self._unlink: dict[int, list[tuple[int, str]]] = {}
        self._peers: dict[int, tuple[int, Segment]] = {}
        self._refused = 1 << 62  # the smallest swap /dev/shm had no room for
        #: Swaps whose payload went through shared memory (for tests and benchmarks).
        self.shared = 0

    def count(self, peer: int) -> int:
        """The swaps with ``peer`` so far."""
        return self._counts.get(peer, 0)

    def buffer(self, peer: int, nbytes: int, prefix: str
               ) -> tuple[torch.Tensor, int, int] | None:
        """Where this rank writes the next swap's payload for ``peer``: a half
        of its segment for that peer, its offset and the segment's version;
        None when /dev/shm has no room (``prefix``: this rank's, from the probe)."""
        if nbytes >= self._refused:
            return None
        found = self._own.get(peer)
        count = self.count(peer)
        if found is None or found[1].half < nbytes:
            version = found[0] + 1 if found is not None else 0
            half = max(nbytes, 2 * found[1].half if found is not None else 1 << 20)
            path = f"{prefix}-{self._rank}-swap{peer}-{version}"
            try:
                segment = Segment(path, 2 * half, create=True)
            except OSError as exc:
                try:
                    segment = Segment(path, 2 * nbytes, create=True)
                except OSError:
                    self._refused = nbytes
                    log.warning("rank %d: no room in %s for a %d byte swap (%s); such swaps "
                                "go over the mesh's sockets instead", self._rank,
                                os.path.dirname(self._shm_prefix), nbytes, exc)
                    return None
            if found is not None:
                found[1].close()  # the peer keeps its own mapping of it
            found = self._own[peer] = (version, segment)
            self._unlink.setdefault(peer, []).append((count, path))
        version, segment = found
        offset = (count % 2) * segment.half
        self.shared += 1
        return segment.region(offset, nbytes), offset, version

    def peer_payload(self, peer: int, version: int, offset: int, nbytes: int,
                     peer_prefix: str) -> torch.Tensor:
        """The ``nbytes`` at ``offset`` of ``peer``'s swap segment for this rank."""
        path = f"{peer_prefix}-{peer}-swap{self._rank}-{version}"
        return peer_view(self._peers, self._rank, peer, version, path, "swap segment",
                         offset, nbytes)

    def swapped(self, peer: int) -> None:
        """A swap with ``peer`` is done: the segments of ours it has opened go."""
        count = self.count(peer)
        self._counts[peer] = count + 1
        # The peer has opened a segment of ours named in an earlier swap once it
        # has answered a later one.
        pending = self._unlink.get(peer, [])
        while pending and pending[0][0] < count:
            unlink(pending.pop(0)[1])

    def close(self) -> None:
        for pending in self._unlink.values():
            for _swap, path in pending:
                unlink(path)
        self._unlink.clear()
        for _version, segment in [*self._own.values(), *self._peers.values()]:
            segment.close()
        self._own.clear()
        self._peers.clear()
