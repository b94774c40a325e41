"""The mesh data plane: allreduces whose bytes travel with the agreement exchange.

The engine agrees on ready cached tensors with one small exchange per round
(:class:`~.mesh_transport.MeshTransport`: direct sockets, payloads in
``/dev/shm`` on one machine). Each rank packs the bytes of the tensors it
has ready after its vector; when every rank turns out to have sent a
tensor, the round has already moved its data, and the tensor is reduced
here from the payloads instead of through Gloo.

Per round:

1. :meth:`MeshBackend.layout` says which ready tensors a rank sends and at
   which offsets; every rank computes every rank's layout the same way,
   from the slots it marked ready and the (identical) tensor specs.
2. :meth:`MeshBackend.pack` writes this rank's prescaled bytes there and
   :meth:`MeshBackend.exchange` swaps vectors and payloads.
3. :meth:`MeshBackend.round` keeps what arrived; for each fused batch of
   tensors every rank carried, :meth:`MeshRound.batch` is a backend whose
   ``allreduce`` combines the contributions in rank order, so every rank
   computes the same bits.

In a world of 2 or 4 ranks that share no memory (several machines), the
batches too large to ride the round go through :class:`PairwiseAllreduce`
instead of Gloo: swaps between pairs of ranks over the same connections,
with a ring's bytes per rank in fewer steps (one at 2 ranks, four at 4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .base import BackendError, PlacedViews, Placement, ReduceKind, RegionViews, scale_
from .mesh_transport import MAX_MESH_SIZE, MeshTransport

__all__ = ["KEPT_LAYOUTS", "MAX_MESH_SIZE", "MESH_DTYPES", "PAIR_CHUNK_BYTES", "Layout",
           "MeshBackend", "MeshRound", "PairwiseAllreduce", "TensorSpec"]

# Element types the mesh reduces itself, by wire name.
MESH_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "uint8", "int8",
                         "int16", "int32", "int64"})

_REDUCE_INTO: dict[ReduceKind, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    ReduceKind.SUM: torch.Tensor.add_,
    ReduceKind.MIN: lambda acc, other: torch.minimum(acc, other, out=acc),
    ReduceKind.MAX: lambda acc, other: torch.maximum(acc, other, out=acc),
    ReduceKind.PRODUCT: torch.Tensor.mul_,
}

# The same reductions into a third tensor (``out=``): rank 0's and rank 1's in one pass.
_COMBINE: dict[ReduceKind, Callable[..., Any]] = {
    ReduceKind.SUM: torch.add,
    ReduceKind.MIN: torch.minimum,
    ReduceKind.MAX: torch.maximum,
    ReduceKind.PRODUCT: torch.mul,
}

# The most layouts a mesh keeps (each of a set of ready slots).
KEPT_LAYOUTS = 16

# The most bytes of a tensor one pass of PairwiseAllreduce handles: a larger
# tensor goes in chunks, so the receive buffers the transport keeps stay small.
PAIR_CHUNK_BYTES = 16 << 20

Message = tuple[list[int], torch.Tensor | None]


class Layout:
    """Where a rank's ready tensors lie in its payload, for one set of ready slots.

    A mesh keeps one per set (:meth:`MeshBackend.layout`), and it compares by
    identity: it keys the views of the payload that :meth:`MeshBackend.pack`
    keeps for it.

    Attributes:
        offsets: {slot: byte offset}, in slot order.
        total: the payload's length in bytes.
        flat: (start, end) when every placed tensor is 1-D and of one dtype:
            they lie back to back, and one ``cat`` packs them. None otherwise.
    """

    __slots__ = ("flat", "offsets", "total")

    def __init__(self, offsets: dict[int, int], total: int,
                 flat: tuple[int, int] | None) -> None:
        self.offsets = offsets
        self.total = total
        self.flat = flat


_NO_PAYLOAD = Layout({}, 0, None)


class TensorSpec(Protocol):
    """What the layout needs to know of a tensor (the engine's cache signature)."""

    @property
    def dtype(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...


class MeshBackend:
    """The mesh transport of the global set plus the payload layout and reduction.

    Args:
        store, rank, size, timeout, address, shared_memory, shm_prefix, token,
            context: as for :class:`~.mesh_transport.MeshTransport`.
        shm_bytes: the most payload bytes per rank when payloads lie in
            shared memory.
        socket_bytes: the most payload bytes per round over sockets, split
            among the peers.

    Attributes:
        pairwise: for 2 or 4 ranks that share no memory, the backend that
            allreduces batches too large for the round's payload (None otherwise).
            The engine uses it only while the agreed payload budget (rank 0's)
            is above 0, so that every rank picks the same backend.
    """

    name = "mesh"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 address: str, *, shared_memory: bool, shm_prefix: str, shm_bytes: int,
                 socket_bytes: int, token: str, context: str, local_ranks: int = 1) -> None:
        self.rank = rank
        self.size = size
        self.transport = MeshTransport(store, rank, size, timeout, address,
                                       shared_memory=shared_memory, shm_prefix=shm_prefix,
                                       token=token, context=context, local_ranks=local_ranks)
        #: The payload budget this rank proposes (rank 0's is agreed on).
        self.budget = shm_bytes if self.transport.shared else socket_bytes // (size - 1)
        # Built from what every rank agrees on (the size, the shared-memory
        # verdict), never from this rank's own settings.
        self.pairwise = PairwiseAllreduce(self.transport, rank) \
            if size in PairwiseAllreduce.SIZES and not self.transport.shared else None
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._layouts_key: tuple[int, int] = (-1, -1)
        # Views of the payload buffer (it alternates between two halves of a
        # segment) by layout, and typed views of where the payloads hold a run
        # or a batch; both dropped when the transport replaces a buffer.
        self._placed = PlacedViews()
        self._regions = RegionViews()
        self._buffers_seen = 0

    @property
    def waiting_for(self) -> tuple[int, ...]:
        """The peers the exchange in progress still waits for."""
        return self.transport.waiting_for

    def layout(self, slots: Iterable[int], spec: Callable[[int], TensorSpec], budget: int,
               version: int) -> Layout:
        """Which of a rank's ready tensors travel in its payload, and where.

        ``slots`` are the cache slots the rank's vector lists as ready (the
        same list for the rank itself and for its peers), ascending. A
        tensor travels when it is a non-empty CPU tensor of a dtype the mesh
        reduces and the payload stays within ``budget``. Tensors sit back
        to back in slot order; a change of dtype starts at the next 8-byte
        boundary, so that each can be viewed in place. Layouts are kept
        while the cache ``version`` and the budget stay the same (in
        training, the same tensors are ready round after round).

        Returns:
            The layout: offsets by slot, the payload's length, and whether one
            ``cat`` packs it.
        """
        if budget <= 0:
            return _NO_PAYLOAD
        slots = tuple(slots)
        if self._layouts_key != (version, budget):
            self._layouts.clear()
            self._layouts_key = (version, budget)
        found = self._layouts.get(slots)
        if found is None:
            # Rounds the background thread runs during a backward pass find
            # different tensors ready from step to step: keep the newest only.
            if len(self._layouts) >= KEPT_LAYOUTS:
                del self._layouts[next(iter(self._layouts))]
            found = self._layouts[slots] = _compute_layout(slots, spec, budget)
        return found

    def pack(self, tensors: Sequence[tuple[int, torch.Tensor, float]], layout: Layout
             ) -> torch.Tensor | None:
        """This rank's payload: each (slot, tensor, prescale factor) the layout
        places, prescaled; None when it places none."""
        offsets = layout.offsets
        if not offsets:
            return None
        send = self.transport.payload_buffer(layout.total)
        self._drop_stale_views()
        sources: list[torch.Tensor] = []
        scales: list[float] = []
        for slot, tensor, prescale in tensors:
            if slot in offsets:
                sources.append(tensor)
                scales.append(prescale)
        # One factor other than 1 for every tensor (an average's): floats are
        # scaled in the copy's pass, or in one pass after it.
        uniform = scales[0] != 1.0 and scales.count(scales[0]) == len(scales)
        if layout.flat is not None:
            # One kernel for the whole run (the cheapest copy of 1-D tensors).
            start, end = layout.flat
            region = self._regions.get(send, start, end - start, sources[0].dtype)
            if uniform and region.is_floating_point():  # (a flat run has one dtype)
                if len(sources) == 1:
                    torch.mul(sources[0], scales[0], out=region)
                else:
                    torch.cat(sources, out=region)
                    region.mul_(scales[0])
                return send
            torch.cat(sources, out=region)
        else:
            # One copy call for every tensor, into views kept across rounds.
            torch._foreach_copy_(self._views(send, layout, sources), sources)
        if scales.count(1.0) == len(scales):
            return send
        views = self._views(send, layout, sources)
        if uniform and all(t.is_floating_point() for t in sources):
            torch._foreach_mul_(views, scales[0])
            return send
        for view, prescale in zip(views, scales, strict=True):
            scale_(view, prescale)
        return send

    def _views(self, send: torch.Tensor, layout: Layout, sources: list[torch.Tensor]
               ) -> list[torch.Tensor]:
        """Views of the payload buffer ``send`` as each of ``sources`` placed by
        ``layout`` (the tensors of a slot have its signature's dtype and shape,
        so the layout stands for their placements)."""

        def place() -> Placement:
            return [(offset, t.dtype, t.shape) for offset, t in
                    zip(layout.offsets.values(), sources, strict=True)], sources

        return self._placed.get(send, layout, place)

    def exchange(self, values: Sequence[int], payload: torch.Tensor | None, *,
                 uniform: bool = True, spin: bool = False) -> list[Message]:
        """Every rank's vector and payload, by rank (see :meth:`MeshTransport.exchange`)."""
        return self.transport.exchange(values, payload, uniform=uniform, spin=spin)

    def round(self, messages: list[Message], layouts: list[dict[int, int]]) -> MeshRound:
        """The payloads of one exchange, with the layout each rank sent them in."""
        self._drop_stale_views()  # a peer may have grown its segment
        return MeshRound(messages, layouts, self._regions)

    def _drop_stale_views(self) -> None:
        """Drops the kept views once the transport has replaced a payload buffer:
        they would keep the old one (a segment's mapping) alive."""
        if self._buffers_seen != self.transport.buffers_version:
            self._buffers_seen = self.transport.buffers_version
            self._placed.clear()
            self._regions.clear()

    def abort(self, reason: str) -> None:
        """Fails the exchange in progress and every later one (any thread)."""
        self.transport.abort(reason)

    def close(self) -> None:
        self.transport.close()


def _compute_layout(slots: tuple[int, ...], spec: Callable[[int], TensorSpec], budget: int
                    ) -> Layout:
    offsets, total, dtype = {}, 0, None
    flat = True  # every placed tensor 1-D, all of one dtype (so back to back from 0)
    for slot in slots:
        sig = spec(slot)
        nbytes = sig.nbytes
        if not nbytes or sig.device != "cpu" or sig.dtype not in MESH_DTYPES:
            continue
        start = total if sig.dtype == dtype else (total + 7) & ~7
        if start + nbytes > budget:
            continue
        flat = flat and len(sig.shape) == 1 and dtype in (None, sig.dtype)
        offsets[slot], total, dtype = start, start + nbytes, sig.dtype
    return Layout(offsets, total, (0, total) if offsets and flat else None)


class MeshRound:
    """What one exchange brought: every rank's payload and where its tensors lie."""

    def __init__(self, messages: list[Message], layouts: list[dict[int, int]],
                 regions: RegionViews) -> None:
        self._payloads = [payload for _values, payload in messages]
        self._layouts = layouts
        self._regions = regions
        # In training every rank sent one layout (the same object): its slots.
        first = layouts[0]
        self._carried = first.keys() if all(layout is first for layout in layouts) else \
            set(first).intersection(*layouts[1:])

    def carries(self, slot: int) -> bool:
        """Whether every rank sent ``slot``'s bytes."""
        return slot in self._carried

    def batch(self, slots: Sequence[tuple[int, int]]) -> CarriedBatch:
        """A backend for one fused batch: ``slots`` are (slot, nbytes) in buffer order."""
        return CarriedBatch(self._payloads, self._layouts, slots, self._regions)


class CarriedBatch:
    """The backend of one fused batch the payloads carried.

    Its allreduce does not read ``tensor``: it writes the rank-order
    reduction of every rank's (prescaled) contribution into it.
    """

    name = "mesh"
    reads_input = False

    def __init__(self, payloads: list[torch.Tensor | None], layouts: list[dict[int, int]],
                 slots: Sequence[tuple[int, int]], regions: RegionViews) -> None:
        self._payloads = payloads
        self._layouts = layouts
        self._slots = slots
        self._regions = regions

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        dtype, nbytes = flat.dtype, flat.nbytes
        first_slot, last_slot = self._slots[0][0], self._slots[-1][0]
        last_nbytes = self._slots[-1][1]
        reduce = _REDUCE_INTO[op]
        first: torch.Tensor | None = None
        for rank, (payload, layout) in enumerate(zip(self._payloads, self._layouts,
                                                     strict=True)):
            assert payload is not None
            start = layout[first_slot]
            # A view of the payload when the batch lies back to back there
            # (the usual case: every rank was ready with the same tensors).
            if layout[last_slot] + last_nbytes - start == nbytes:
                theirs = self._regions.get(payload, start, nbytes, dtype)
            else:
                theirs = torch.cat([payload[layout[slot]:layout[slot] + size].view(dtype)
                                    for slot, size in self._slots])
            if rank == 0:
                first = theirs
            elif rank == 1:
                # Rank 0's and rank 1's contributions combined in one pass (a
                # mesh has 2 ranks or more).
                assert first is not None
                _COMBINE[op](first, theirs, out=flat)
            else:
                reduce(flat, theirs)


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
        reduce = _REDUCE_INTO[op]
        if self._rank == 1 and op is ReduceKind.MIN:
            torch.minimum(theirs, part, out=part)  # rank 0's value first, as on rank 0
        elif self._rank == 1 and op is ReduceKind.MAX:
            torch.maximum(theirs, part, out=part)
        else:
            reduce(part, theirs)

    def _halving_doubling(self, part: torch.Tensor, op: ReduceKind) -> None:
        reduce = _REDUCE_INTO[op]
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
