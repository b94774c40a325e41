"""Allreduce by swaps between pairs of ranks (:class:`PairwiseAllreduce`), and the
reductions the mesh performs itself (:mod:`.mesh` reduces the rounds' payloads with them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .base import BackendError, ReduceKind
from .mesh_transport import MeshTransport

__all__ = ["COMBINE", "MESH_DTYPES", "PAIR_CHUNK_BYTES", "REDUCE_INTO", "PairwiseAllreduce",
           "reduce_terms"]

# Element types the mesh reduces itself, by wire name.
MESH_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "uint8", "int8",
                         "int16", "int32", "int64"})

REDUCE_INTO: dict[ReduceKind, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    ReduceKind.SUM: torch.Tensor.add_,
    ReduceKind.MIN: lambda acc, other: torch.minimum(acc, other, out=acc),
    ReduceKind.MAX: lambda acc, other: torch.maximum(acc, other, out=acc),
    ReduceKind.PRODUCT: torch.Tensor.mul_,
}

# The same reductions into a third tensor (``out=``): rank 0's and rank 1's in one pass.
COMBINE: dict[ReduceKind, Callable[..., Any]] = {
    ReduceKind.SUM: torch.add,
    ReduceKind.MIN: torch.minimum,
    ReduceKind.MAX: torch.maximum,
    ReduceKind.PRODUCT: torch.mul,
}

def reduce_terms(terms: Sequence[torch.Tensor], out: torch.Tensor, op: ReduceKind) -> None:
    """Reduces ``terms`` (two or more, by rank) into ``out`` in rank order: rank
    0's and rank 1's in one pass, then each next one. ``out`` may be one of
    the first two terms (an elementwise op's input may be its output)."""
    COMBINE[op](terms[0], terms[1], out=out)
    reduce = REDUCE_INTO[op]
    for term in terms[2:]:
        reduce(out, term)


# The most bytes of a tensor one pass of PairwiseAllreduce handles: a larger
# tensor goes in chunks, so the receive buffers the transport keeps stay small.
PAIR_CHUNK_BYTES = 16 << 20


class PairwiseAllreduce:
    """Allreduce by swaps between pairs of ranks over the mesh's connections.

    For worlds of 2 or 4 ranks that share no memory (several machines), for
    the batches too large to ride the agreement round. Each swap sends and
    receives at once between two ranks only (:meth:`MeshTransport.swap`):

    - **2 ranks:** one swap of the whole tensor; both ranks reduce. A ring
      (Gloo's) moves the same bytes in two dependent steps.
    - **4 ranks:** recursive halving, then doubling (Rabenseifner): swap half
      the tensor with the rank at distance 1 and reduce the half kept, then a
      quarter with the rank at distance 2; then send the reduced quarter back
      the same way, doubling. Four steps instead of a ring's six, with a
      ring's bytes per rank. Ranks fill hosts in order, so with 2 ranks per
      host the distance-1 swaps stay on the machine, where they go through
      /dev/shm (:meth:`MeshTransport.swap` with a local peer), and only
      quarters cross between machines: the whole tensor once each way per
      machine, against 1.5 times that on a ring, and a third of a ring's
      bytes through the network stack.

    Every rank gets the same bits. With 4 ranks one rank reduces each quarter
    and the others receive copies. With 2, both reduce: SUM and PRODUCT are
    commutative in IEEE arithmetic (``a + b`` and ``b + a`` are the same
    number), and MIN and MAX are taken in rank order. Tensors larger than
    ``chunk_bytes`` go in chunks, so the transport's receive buffers stay small.

    Measured across network namespaces (bench/README.md, section 8).

    Args:
        transport: the world's mesh transport.
        rank: this rank.
        chunk_bytes: the most bytes of the tensor one pass of the algorithm handles.

    Raises:
        ValueError: the world is not of 2 or 4 ranks.
    """

    name = "mesh"
    reads_input = True
    SIZES = (2, 4)

    def __init__(self, transport: MeshTransport, rank: int,
                 chunk_bytes: int = PAIR_CHUNK_BYTES) -> None:
        if transport.size not in self.SIZES or not 0 <= rank < transport.size:
            raise ValueError(f"pairwise allreduce needs 2 or 4 ranks, got rank {rank} of "
                             f"{transport.size}")
        self._transport = transport
        self._rank = rank
        self._size = transport.size
        self._chunk = chunk_bytes
        #: Tensors (or fused batches) allreduced so far.
        self.allreduces = 0

    @staticmethod
    def takes(dtype: str) -> bool:
        """Whether tensors of ``dtype`` (wire name, ``"float32"``) can go through it."""
        return dtype in MESH_DTYPES

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        """Reduces ``tensor`` (contiguous, CPU) across the ranks, in place.

        Raises:
            BackendError: a peer died, sent a different length, or the
                transport's timeout passed.
        """
        flat = tensor.detach().view(-1)
        step = max(1, self._chunk // flat.element_size())
        for start in range(0, flat.numel(), step):
            part = flat[start:start + step]
            if self._size == 2:
                self._swap_whole(part, op)
            else:
                self._halving_doubling(part, op)
        self.allreduces += 1

    def _swap(self, peer: int, mine: torch.Tensor) -> torch.Tensor:
        """``mine`` to ``peer``, the peer's as many elements back (a reused buffer)."""
        raw = mine.view(torch.uint8)
        theirs = self._transport.swap(peer, raw)
        if theirs.numel() != raw.numel():
            raise BackendError(
                f"pairwise allreduce: rank {peer} sent {theirs.numel()} bytes where rank "
                f"{self._rank} sent {raw.numel()}; the ranks' tensors differ")
        return theirs.view(mine.dtype)

    def _swap_whole(self, part: torch.Tensor, op: ReduceKind) -> None:
        theirs = self._swap(1 - self._rank, part)
        reduce = REDUCE_INTO[op]
        if self._rank == 1 and op is ReduceKind.MIN:
            torch.minimum(theirs, part, out=part)  # rank 0's value first, as on rank 0
        elif self._rank == 1 and op is ReduceKind.MAX:
            torch.maximum(theirs, part, out=part)
        else:
            reduce(part, theirs)

    def _halving_doubling(self, part: torch.Tensor, op: ReduceKind) -> None:
        reduce = REDUCE_INTO[op]
        lo, hi = 0, part.numel()
        kept: list[tuple[int, int, int]] = []  # (peer, lo, hi) before each halving
        distance = 1
        while distance < self._size:
            peer = self._rank ^ distance
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if self._rank & distance == 0 else \
                ((mid, hi), (lo, mid))
            theirs = self._swap_unequal(peer, part[give[0]:give[1]], keep[1] - keep[0])
            kept.append((peer, lo, hi))
            reduce(part[keep[0]:keep[1]], theirs)
            lo, hi = keep
            distance *= 2
        for peer, parent_lo, parent_hi in reversed(kept):
            sibling = (hi, parent_hi) if lo == parent_lo else (parent_lo, lo)
            theirs = self._swap_unequal(peer, part[lo:hi], sibling[1] - sibling[0])
            part[sibling[0]:sibling[1]].copy_(theirs)
            lo, hi = parent_lo, parent_hi

    def _swap_unequal(self, peer: int, mine: torch.Tensor, expect: int) -> torch.Tensor:
        """Sends ``mine`` and receives ``expect`` elements (the halves may differ by one)."""
        theirs = self._transport.swap(peer, mine.view(torch.uint8))
        if theirs.numel() != expect * mine.element_size():
            raise BackendError(
                f"pairwise allreduce: rank {peer} sent {theirs.numel()} bytes where rank "
                f"{self._rank} expected {expect * mine.element_size()}; the ranks' tensors "
                f"differ")
        return theirs.view(mine.dtype)
