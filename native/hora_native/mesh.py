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

In a world of two ranks that share no memory (two machines), the batches
too large to ride the round go through :class:`PairExchange` instead of
Gloo: one swap of the whole tensor over the same connection, which moves
exactly the bytes of a two-rank ring allreduce in one step instead of two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .base import BackendError, ReduceKind, scale_
from .mesh_transport import MAX_MESH_SIZE, MeshTransport

__all__ = ["MAX_MESH_SIZE", "MESH_DTYPES", "PAIR_CHUNK_BYTES", "MeshBackend", "MeshRound",
           "PairExchange", "TensorSpec"]

# Element types the mesh reduces itself, by wire name.
MESH_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "uint8", "int8",
                         "int16", "int32", "int64"})

_REDUCE_INTO: dict[ReduceKind, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    ReduceKind.SUM: torch.Tensor.add_,
    ReduceKind.MIN: lambda acc, other: torch.minimum(acc, other, out=acc),
    ReduceKind.MAX: lambda acc, other: torch.maximum(acc, other, out=acc),
    ReduceKind.PRODUCT: torch.Tensor.mul_,
}

# The most bytes one swap of a PairExchange moves: a larger tensor goes in
# chunks, so the receive buffer the transport keeps stays this small.
PAIR_CHUNK_BYTES = 16 << 20

Layout = tuple[dict[int, int], int]
Message = tuple[list[int], torch.Tensor | None]


class TensorSpec(Protocol):
    """What the layout needs to know of a tensor (the engine's cache signature)."""

    @property
    def dtype(self) -> str: ...

    @property
    def device(self) -> str: ...

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
            among the peers; 0 also turns :attr:`pair` off.

    Attributes:
        pair: for two ranks that share no memory, the backend that allreduces
            batches too large for the round's payload (None otherwise).
    """

    name = "mesh"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 address: str, *, shared_memory: bool, shm_prefix: str, shm_bytes: int,
                 socket_bytes: int, token: str, context: str) -> None:
        self.rank = rank
        self.size = size
        self.transport = MeshTransport(store, rank, size, timeout, address,
                                       shared_memory=shared_memory, shm_prefix=shm_prefix,
                                       token=token, context=context)
        #: The payload budget this rank proposes (rank 0's is agreed on).
        self.budget = shm_bytes if self.transport.shared else socket_bytes // (size - 1)
        self.pair = PairExchange(self.transport, rank) \
            if size == 2 and not self.transport.shared and socket_bytes > 0 else None
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._layouts_key: tuple[int, int] = (-1, -1)

    @property
    def waiting_for(self) -> tuple[int, ...]:
        """The peers the exchange in progress still waits for."""
        return self.transport.waiting_for

    def layout(self, slots: Iterable[int], spec: Callable[[int], TensorSpec], budget: int,
               version: int) -> Layout:
        """Which of a rank's ready tensors travel in its payload, and where.

        ``slots`` are the cache slots the rank marked ready, ascending. A
        tensor travels when it is a non-empty CPU tensor of a dtype the mesh
        reduces and the payload stays within ``budget``. Tensors sit back
        to back in slot order; a change of dtype starts at the next 8-byte
        boundary, so that each can be viewed in place. Layouts are kept
        while the cache ``version`` and the budget stay the same (in
        training, the same tensors are ready round after round).

        Returns:
            {slot: byte offset} and the payload's length.
        """
        if budget <= 0:
            return {}, 0
        slots = tuple(slots)
        if self._layouts_key != (version, budget):
            self._layouts.clear()
            self._layouts_key = (version, budget)
        found = self._layouts.get(slots)
        if found is None:
            found = self._layouts[slots] = _compute_layout(slots, spec, budget)
        return found

    def pack(self, tensors: Sequence[tuple[int, torch.Tensor, float]], layout: Layout
             ) -> torch.Tensor | None:
        """This rank's payload: each (slot, tensor, prescale factor) the layout
        places, prescaled; None when it places none."""
        offsets, total = layout
        if not offsets:
            return None
        send = self.transport.payload_buffer(total)
        # Copy runs of tensors that lie back to back with one call each.
        runs: list[list[Any]] = []  # [start, end, prescale, tensors]
        for slot, tensor, prescale in tensors:
            offset = offsets.get(slot)
            if offset is None:
                continue
            flat = tensor if tensor.dim() == 1 else tensor.view(-1)
            end = offset + flat.nbytes
            last = runs[-1] if runs else None
            if (last is not None and last[1] == offset and last[3][0].dtype == flat.dtype
                    and last[2] == prescale):
                last[1] = end
                last[3].append(flat)
            else:
                runs.append([offset, end, prescale, [flat]])
        for start, end, prescale, flats in runs:
            out = send[start:end].view(flats[0].dtype)
            if len(flats) == 1:
                out.copy_(flats[0])
            else:
                torch.cat(flats, out=out)
            scale_(out, prescale)
        return send

    def exchange(self, values: Sequence[int], payload: torch.Tensor | None) -> list[Message]:
        """Every rank's vector and payload, by rank (see :meth:`MeshTransport.exchange`)."""
        return self.transport.exchange(values, payload)

    def round(self, messages: list[Message], layouts: list[dict[int, int]]) -> MeshRound:
        """The payloads of one exchange, with the layout each rank sent them in."""
        return MeshRound(messages, layouts)

    def abort(self, reason: str) -> None:
        """Fails the exchange in progress and every later one (any thread)."""
        self.transport.abort(reason)

    def close(self) -> None:
        self.transport.close()


def _compute_layout(slots: tuple[int, ...], spec: Callable[[int], TensorSpec], budget: int
                    ) -> Layout:
    offsets, total, dtype = {}, 0, None
    for slot in slots:
        sig = spec(slot)
        nbytes = sig.nbytes
        if not nbytes or sig.device != "cpu" or sig.dtype not in MESH_DTYPES:
            continue
        start = total if sig.dtype == dtype else (total + 7) & ~7
        if start + nbytes > budget:
            continue
        offsets[slot], total, dtype = start, start + nbytes, sig.dtype
    return offsets, total


class MeshRound:
    """What one exchange brought: every rank's payload and where its tensors lie."""

    def __init__(self, messages: list[Message], layouts: list[dict[int, int]]) -> None:
        self._payloads = [payload for _values, payload in messages]
        self._layouts = layouts

    def carries(self, slot: int) -> bool:
        """Whether every rank sent ``slot``'s bytes."""
        return all(slot in layout for layout in self._layouts)

    def batch(self, slots: Sequence[tuple[int, int]]) -> CarriedBatch:
        """A backend for one fused batch: ``slots`` are (slot, nbytes) in buffer order."""
        return CarriedBatch(self._payloads, self._layouts, slots)


class CarriedBatch:
    """The backend of one fused batch the payloads carried.

    Its allreduce does not read ``tensor``: it writes the rank-order
    reduction of every rank's (prescaled) contribution into it.
    """

    name = "mesh"
    reads_input = False

    def __init__(self, payloads: list[torch.Tensor | None], layouts: list[dict[int, int]],
                 slots: Sequence[tuple[int, int]]) -> None:
        self._payloads = payloads
        self._layouts = layouts
        self._slots = slots

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        dtype, nbytes = flat.dtype, flat.nbytes
        first_slot, last_slot = self._slots[0][0], self._slots[-1][0]
        last_nbytes = self._slots[-1][1]
        reduce = _REDUCE_INTO[op]
        for rank, (payload, layout) in enumerate(zip(self._payloads, self._layouts,
                                                     strict=True)):
            assert payload is not None
            start = layout[first_slot]
            # A view of the payload when the batch lies back to back there
            # (the usual case: every rank was ready with the same tensors).
            if layout[last_slot] + last_nbytes - start == nbytes:
                theirs = payload[start:start + nbytes].view(dtype)
            else:
                theirs = torch.cat([payload[layout[slot]:layout[slot] + size].view(dtype)
                                    for slot, size in self._slots])
            if rank == 0:
                flat.copy_(theirs)
            else:
                reduce(flat, theirs)


class PairExchange:
    """Allreduce between two ranks that share no memory: both swap the tensor at once.

    A two-rank ring allreduce (Gloo's) sends half the tensor each way, reduces,
    then sends the reduced half each way: the whole tensor each way, in two
    dependent steps. Here each rank sends its whole tensor while it receives
    the other's, over the mesh's connection (sends and receives run
    concurrently), and reduces: the same bytes in one step. Measured across
    two network namespaces, 1 to 64 MiB: 1.2-1.3 times Gloo's speed
    (bench/README.md, section 8).

    Every rank gets the same bits: SUM and PRODUCT are commutative in IEEE
    arithmetic (``a + b`` and ``b + a`` are the same number), MIN and MAX are
    reduced in rank order. Tensors larger than ``chunk_bytes`` are swapped in
    chunks.

    Args:
        transport: the two ranks' mesh transport (not in shared-memory mode).
        rank: this rank, 0 or 1.
        chunk_bytes: the most bytes one swap moves.
    """

    name = "mesh"
    reads_input = True

    def __init__(self, transport: MeshTransport, rank: int,
                 chunk_bytes: int = PAIR_CHUNK_BYTES) -> None:
        if transport.size != 2 or rank not in (0, 1):
            raise ValueError(f"a pair exchange needs 2 ranks, got rank {rank} of "
                             f"{transport.size}")
        self._transport = transport
        self._rank = rank
        self._chunk = chunk_bytes
        #: Tensors (or fused batches) allreduced so far.
        self.allreduces = 0

    @staticmethod
    def takes(dtype: str) -> bool:
        """Whether tensors of ``dtype`` (wire name, ``"float32"``) can go through it."""
        return dtype in MESH_DTYPES

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        """Reduces ``tensor`` (contiguous, CPU) with the other rank's, in place.

        Raises:
            BackendError: the other rank died, sent a different length, or the
                transport's timeout passed.
        """
        flat = tensor.detach().view(-1)
        raw = flat.view(torch.uint8)
        step = max(flat.element_size(), self._chunk // flat.element_size() * flat.element_size())
        reduce = _REDUCE_INTO[op]
        ordered = op in (ReduceKind.MIN, ReduceKind.MAX) and self._rank == 1
        for start in range(0, raw.numel(), step):
            mine = raw[start:start + step]
            theirs = self._transport.exchange((), mine)[1 - self._rank][1]
            if theirs is None or theirs.numel() != mine.numel():
                got = 0 if theirs is None else theirs.numel()
                raise BackendError(
                    f"pair exchange: rank {1 - self._rank} sent {got} bytes at offset {start} "
                    f"of a {raw.numel()} byte allreduce, rank {self._rank} {mine.numel()}")
            acc, other = mine.view(flat.dtype), theirs.view(flat.dtype)
            if ordered:  # rank 0's value first, as on rank 0
                reduce(other, acc)
                acc.copy_(other)
            else:
                reduce(acc, other)
        self.allreduces += 1
