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

import math
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from .base import PlacedViews, Placement, ReduceKind, RegionViews, scale_
from .mesh_pairwise import MESH_DTYPES, PAIR_CHUNK_BYTES, PairwiseAllreduce, reduce_terms
from .mesh_resident import RESIDENT_MIN_BYTES, reduce_in_place
from .mesh_transport import MAX_MESH_SIZE, MeshTransport

__all__ = ["KEPT_LAYOUTS", "MAX_MESH_SIZE", "MESH_DTYPES", "PAIR_CHUNK_BYTES",
           "RESIDENT_MIN_BYTES", "Layout", "MeshBackend", "MeshRound", "PairwiseAllreduce",
           "TensorSpec"]

# The dtypes whose prescale a resident payload leaves to the reduction (``_resident_payload``).
_DEFERRED_SCALE = (torch.float32, torch.float64)

# The most layouts a mesh keeps (each of a set of ready slots).
KEPT_LAYOUTS = 16

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
        if len(offsets) == 1 and layout.total >= RESIDENT_MIN_BYTES and \
                self.transport.has_resident:
            resident = self._resident_payload(tensors, layout)
            if resident is not None:
                return resident
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

    def resident_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed tensor whose payload peers read in place (:mod:`.mesh_resident`),
        when it fits this rank's payload budget (see
        :meth:`MeshTransport.resident_zeros` for the other conditions); else None."""
        if numel * dtype.itemsize > self.budget:
            return None
        return self.transport.resident_zeros(numel, dtype)

    def _resident_payload(self, tensors: Sequence[tuple[int, torch.Tensor, float]],
                          layout: Layout) -> torch.Tensor | None:
        """The one tensor ``layout`` places, as bytes, when it lies in a resident
        buffer of this rank (:mod:`.mesh_resident`) and its prescale may wait
        until the reduction (1, or a power of two for float32 and float64): peers read it
        where it is, and nothing is copied. None otherwise."""
        (slot,) = layout.offsets
        found = next((item for item in tensors if item[0] == slot), None)
        if found is None:
            return None
        _slot, tensor, prescale = found
        # Scaling the reduced share by a power of two is scaling each term, but
        # below the smallest normal number or where the sum overflows (as in
        # ``divides_early``; not for half precision, which overflows at 65504).
        if prescale != 1.0 and not (tensor.dtype in _DEFERRED_SCALE and prescale > 0
                                    and math.frexp(prescale)[0] == 0.5):
            return None
        if not tensor.is_contiguous() or tensor.nbytes != layout.total:
            return None
        raw = tensor.view(-1).view(torch.uint8)
        return raw if self.transport.holds_resident(raw) else None

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

    def round(self, messages: list[Message], layouts: list[dict[int, int]],
              factor: Callable[[int], float] = lambda _slot: 1.0, *, spin: bool = False
              ) -> MeshRound:
        """The payloads of one exchange, with the layout each rank sent them in.

        ``factor``: each slot's prescale, which payloads sent from resident
        buffers did not apply; ``spin``: the caller's thread waits for the
        round (see :meth:`MeshTransport.exchange`), also at the barrier that
        follows the reduction of such payloads."""
        self._drop_stale_views()  # a peer may have grown its segment
        transport = self.transport
        ranks = transport.resident_ranks
        resident = _Resident(self.rank, ranks, factor,
                             lambda: transport.exchange((), None, spin=spin)) if ranks else None
        return MeshRound(messages, layouts, self._regions, resident)

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


class _Resident:
    """What a round's reduction needs to know of payloads sent from resident
    buffers (:mod:`.mesh_resident`): this rank, the ranks that sent one, each
    slot's prescale (which those payloads did not apply), and the barrier that
    follows a reduction reading them."""

    __slots__ = ("barrier", "factor", "rank", "ranks")

    def __init__(self, rank: int, ranks: frozenset[int], factor: Callable[[int], float],
                 barrier: Callable[[], object]) -> None:
        self.rank, self.ranks, self.factor, self.barrier = rank, ranks, factor, barrier


class MeshRound:
    """What one exchange brought: every rank's payload and where its tensors lie."""

    def __init__(self, messages: list[Message], layouts: list[dict[int, int]],
                 regions: RegionViews, resident: _Resident | None = None) -> None:
        self._payloads = [payload for _values, payload in messages]
        self._layouts = layouts
        self._regions = regions
        self._resident = resident
        # In training every rank sent one layout (the same object): its slots.
        first = layouts[0]
        self._carried = first.keys() if all(layout is first for layout in layouts) else \
            set(first).intersection(*layouts[1:])

    def carries(self, slot: int) -> bool:
        """Whether every rank sent ``slot``'s bytes."""
        return slot in self._carried

    def batch(self, slots: Sequence[tuple[int, int]]) -> CarriedBatch:
        """A backend for one fused batch: ``slots`` are (slot, nbytes) in buffer order."""
        return CarriedBatch(self._payloads, self._layouts, slots, self._regions,
                            self._resident)


class CarriedBatch:
    """The backend of one fused batch the payloads carried.

    Its allreduce does not read ``tensor``: it writes the rank-order
    reduction of every rank's (prescaled) contribution into it.
    """

    name = "mesh"
    reads_input = False

    def __init__(self, payloads: list[torch.Tensor | None], layouts: list[dict[int, int]],
                 slots: Sequence[tuple[int, int]], regions: RegionViews,
                 resident: _Resident | None = None) -> None:
        self._payloads = payloads
        self._layouts = layouts
        self._slots = slots
        self._regions = regions
        self._resident = resident

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        if self._resident is not None:
            self._allreduce_resident(flat, op, self._resident)
            return
        # (A mesh has 2 ranks or more.)
        reduce_terms([self._contribution(rank, flat) for rank in range(len(self._payloads))],
                     flat, op)

    def _contribution(self, rank: int, flat: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s contribution to the batch, as ``flat``'s dtype."""
        payload, layout = self._payloads[rank], self._layouts[rank]
        assert payload is not None
        dtype, nbytes = flat.dtype, flat.nbytes
        first_slot, (last_slot, last_nbytes) = self._slots[0][0], self._slots[-1]
        start = layout[first_slot]
        # A view of the payload when the batch lies back to back there
        # (the usual case: every rank was ready with the same tensors).
        if layout[last_slot] + last_nbytes - start == nbytes:
            return self._regions.get(payload, start, nbytes, dtype)
        return torch.cat([payload[layout[slot]:layout[slot] + size].view(dtype)
                          for slot, size in self._slots])

    def _allreduce_resident(self, flat: torch.Tensor, op: ReduceKind,
                            resident: _Resident) -> None:
        """The batch when some rank sent its payload from a resident buffer
        (:mod:`.mesh_resident`), unscaled, which it may overwrite as soon as
        every rank has read it: each rank then passes one barrier, the same on
        every rank (every rank knows which payloads were resident)."""
        factor = resident.factor(self._slots[0][0])
        if (len(resident.ranks) == len(self._payloads) and len(self._slots) == 1
                and (factor == 1.0 or op is not ReduceKind.PRODUCT)):
            # Every rank's buffer holds the batch alone: each reduces its share.
            terms = [self._contribution(rank, flat) for rank in range(len(self._payloads))]
            reduce_in_place(terms, resident.rank, factor,
                            lambda shares, out: reduce_terms(shares, out, op), resident.barrier)
            if terms[resident.rank].data_ptr() != flat.data_ptr():
                flat.copy_(terms[resident.rank])
            return
        # Some rank copied its payload: the whole reduction here, into a tensor
        # of its own (a resident buffer, ours included, is read until the
        # barrier), with the prescale the copies had applied.
        terms = []
        for rank in range(len(self._payloads)):
            theirs = self._contribution(rank, flat)
            if rank in resident.ranks and factor != 1.0:
                theirs = theirs.clone()
                scale_(theirs, factor)
            terms.append(theirs)
        out = torch.empty_like(flat)
        reduce_terms(terms, out, op)
        resident.barrier()
        flat.copy_(out)
