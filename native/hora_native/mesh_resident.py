"""Buffers in /dev/shm that a mesh's peers read in place: no payload copy.

On one machine a round's payload is a copy of the ready tensors into this
rank's segment (:mod:`.mesh_transport`), which every peer then reads. A
tensor that lives in shared memory already needs no copy: a
``DistributedOptimizer`` whose gradients are views of one flat buffer
(``hora/torch/_fused.py``) asks the engine for that buffer here, and from
then on its round sends where the buffer lies instead of the bytes. The
peers map the buffer's file once and reduce from it
(:class:`~.mesh.CarriedBatch`).

A resident buffer is named ``<the rank's prefix>-<rank>-res<id>``. A message
carrying one says so with a segment version of ``-2 - id``; the file goes
from the file system once every peer has opened it (the exchange after the
first one that named it), and the mappings keep the memory until the buffer
and the peers' views of it are gone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .base import BackendError, scale_
from .mesh_segments import Segment, unlink

__all__ = ["FIRST_RESIDENT", "RESIDENT_MIN_BYTES", "ResidentBuffers", "reduce_in_place"]

#: The segment version of resident buffer 0 in a message; buffer ``i`` is ``-2 - i``.
FIRST_RESIDENT = -2

#: The smallest resident buffer: below it, copying a payload costs less than
#: the check and the barrier after a reduction in place.
RESIDENT_MIN_BYTES = 64 << 10


class ResidentBuffers:
    """This rank's resident buffers and the peers' that it mapped.

    Args:
        rank: this rank.
        prefix: this rank's segment prefix (the probe's; see :mod:`.mesh_local`).
        peer_prefix: each peer's prefix, by rank.
    """

    def __init__(self, rank: int, prefix: str, peer_prefix: dict[int, str]) -> None:
        self._rank = rank
        self._prefix = prefix
        self._peer_prefix = peer_prefix
        # Ours by id: (segment, base address, bytes); the ids a message named.
        self._own: dict[int, tuple[Segment, int, int]] = {}
        self._named: set[int] = set()
        self._by_base: dict[int, int] = {}
        self._peers: dict[tuple[int, int], Segment] = {}
        self._next = 0

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed buffer of ``numel`` elements that peers can read in place.

        Raises:
            OSError: /dev/shm has no room for it.
        """
        nbytes = numel * dtype.itemsize
        ident = self._next
        self._next += 1
        segment = Segment(self._path(self._rank, ident), max(nbytes, 1), create=True)
        base = segment.tensor.data_ptr()
        self._own[ident] = (segment, base, nbytes)
        self._by_base[base] = ident
        return segment.tensor[:nbytes].view(dtype)

    @property
    def made(self) -> bool:
        """Whether this rank made any resident buffer."""
        return bool(self._own)

    def holds(self, payload: torch.Tensor) -> bool:
        """Whether ``payload`` lies in one of this rank's resident buffers."""
        return payload.untyped_storage().data_ptr() in self._by_base

    def locate(self, payload: torch.Tensor) -> tuple[int, int, str | None] | None:
        """Where ``payload`` (uint8) lies when it is in one of this rank's
        resident buffers: (version for the message, offset, the file to unlink
        once every peer opened it, the first time a message names it)."""
        if not self._by_base:
            return None
        ident = self._by_base.get(payload.untyped_storage().data_ptr())
        if ident is None:
            return None
        _segment, base, nbytes = self._own[ident]
        offset = payload.data_ptr() - base
        if offset < 0 or offset + payload.numel() > nbytes:
            return None
        first = ident not in self._named
        self._named.add(ident)
        return FIRST_RESIDENT - ident, offset, self._path(self._rank, ident) if first else None

    def peer_view(self, peer: int, version: int, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` at ``offset`` of ``peer``'s resident buffer that a message
        named with ``version``, mapped here once.

        Raises:
            BackendError: the file cannot be opened, or is shorter.
        """
        ident = FIRST_RESIDENT - version
        segment = self._peers.get((peer, ident))
        if segment is None:
            path = self._path(peer, ident, self._peer_prefix[peer])
            try:
                segment = Segment(path, 0, create=False)
            except OSError as exc:
                raise BackendError(f"control mesh: rank {self._rank} could not open rank "
                                   f"{peer}'s resident buffer {path}: {exc}") from exc
            self._peers[(peer, ident)] = segment
        if offset + nbytes > segment.tensor.numel():
            raise BackendError(f"control mesh: rank {peer} named {nbytes} bytes at {offset} "
                               f"of a resident buffer of {segment.tensor.numel()}")
        return segment.region(offset, nbytes)

    def _path(self, rank: int, ident: int, prefix: str | None = None) -> str:
        return f"{self._prefix if prefix is None else prefix}-{rank}-res{ident}"

    def close(self) -> None:
        """Unlinks the files no message named (the others went already) and
        drops this rank's buffers without closing them: a script's tensors
        (a ``DistributedOptimizer``'s gradients) still view them, and
        ``torch.frombuffer`` holds no export of an ``mmap``, so closing one
        under them would unmap their memory (eleventh pass, bench/README.md).
        Each mapping goes with the last tensor that views it. The peers'
        mappings, which only the mesh viewed, are closed."""
        for ident in self._own:
            if ident not in self._named:
                unlink(self._path(self._rank, ident))
        for segment in self._peers.values():
            segment.close()
        self._own.clear()
        self._by_base.clear()
        self._peers.clear()


def reduce_in_place(contributions: Sequence[torch.Tensor], rank: int, factor: float,
                    reduce: Callable[[Sequence[torch.Tensor], torch.Tensor], object],
                    barrier: Callable[[], object]) -> None:
    """Allreduces one batch whose every contribution is a rank's resident
    buffer (``contributions``, typed, by rank, each of the same length): each
    rank reduces its share of the elements in rank order (``reduce`` of the
    terms into a tensor), multiplies it by
    ``factor`` (the prescale that the payloads, not copied, did not apply: 1 or
    a power of two, so that scaling the reduced share is scaling each term,
    but below the smallest normal number), and writes it into every rank's
    buffer; ``barrier`` then waits for every rank's share. Every element is
    computed once, by one rank, so every rank holds the same bits; a rank
    reads and writes a 1/size share of each buffer where the copying path
    packs its whole buffer and reads every rank's (bench/README.md, section 2c).
    """
    size = len(contributions)
    numel = contributions[0].numel()
    lo, hi = rank * numel // size, (rank + 1) * numel // size
    shares = [c[lo:hi] for c in contributions]
    # Into this rank's own share when it is one of the first two terms (an input of
    # an elementwise op may be its output); into a scratch tensor otherwise.
    acc = shares[rank] if rank < 2 else torch.empty_like(shares[rank])
    reduce(shares, acc)
    scale_(acc, factor)
    for share in shares:
        if share is not acc:
            share.copy_(acc)
    barrier()
