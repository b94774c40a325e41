"""How a round's control vectors travel: the :class:`ControlTransport` seam.

Two implementations: :class:`MeshControl` (small worlds: one round trip over
the mesh's direct connections, with the bytes of ready tensors after the
vectors) and :class:`GlooControl` (large worlds: a Gloo MIN-allreduce of the
vectors). The agreement's rounds see only the protocol, so tests run rounds
with a fake one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from hora_native import ReduceKind, Reducer

from .cache import ResponseCache
from .control import ControlVector
from .executor import pre_factor
from .pending import Entry

if TYPE_CHECKING:
    from hora_native.mesh import Layout, MeshBackend

    from .process_sets import ProcessSets

__all__ = ["Carried", "ControlTransport", "GlooControl", "MeshControl"]


class Carried(Protocol):
    """The payloads one exchange carried (:class:`hora_native.mesh.MeshRound`)."""

    def carries(self, slot: int) -> bool:
        """Whether every rank sent ``slot``'s bytes."""

    def batch(self, slots: Sequence[tuple[int, int]]) -> Reducer:
        """The reducer of one fused batch: ``slots`` are (slot, nbytes) in buffer order."""


class ControlTransport(Protocol):
    """Exchanges one round's control vectors among the global set's ranks."""

    #: The payload budget this rank proposes (rank 0's is agreed on; 0: none).
    budget: int
    #: Every rank's encoded vector in the last exchange (empty when unknown).
    last_vectors: list[list[int]]

    @property
    def waiting_for(self) -> tuple[int, ...]:
        """The peers the exchange in progress still waits for."""

    def exchange(self, vector: ControlVector, ready: Sequence[tuple[int, Entry]],
                 budget: int, *, spin: bool = False) -> tuple[ControlVector, Carried | None]:
        """Every rank's vector, agreed, and the payloads carried (``ready`` are this
        rank's ready (slot, entry), ascending; ``budget`` the agreed payload budget;
        ``spin``: the caller waits in this thread, which may poll before it sleeps).

        Raises:
            BackendError: a peer or the connection failed.
        """


class MeshControl:
    """Vectors (and payloads) over the mesh's direct connections."""

    def __init__(self, mesh: MeshBackend, cache: ResponseCache) -> None:
        self._mesh = mesh
        self._cache = cache
        self.budget = mesh.budget
        self.last_vectors: list[list[int]] = []

    @property
    def waiting_for(self) -> tuple[int, ...]:
        return self._mesh.waiting_for

    def _layout(self, slots: list[int], budget: int) -> Layout:
        return self._mesh.layout(slots, self._cache.signature, budget, self._cache.version)

    def exchange(self, vector: ControlVector, ready: Sequence[tuple[int, Entry]],
                 budget: int, *, spin: bool = False) -> tuple[ControlVector, Carried | None]:
        mesh = self._mesh
        layout = self._layout([slot for slot, _entry in ready], budget)
        size = mesh.size
        payload = mesh.pack([(slot, entry.buffer, pre_factor(entry, size))
                             for slot, entry in ready], layout)
        messages = mesh.exchange(vector.encode(), payload, uniform=False, spin=spin)
        self.last_vectors = [values for values, _payload in messages]
        agreed = ControlVector.decode(ControlVector.agree(self.last_vectors))
        if not agreed.ready:
            return agreed, None
        # Where each rank's payload holds which tensors. A rank that could
        # not send its payload sent none: its tensors go through Gloo, on
        # every rank alike.
        # In training every rank sent the same vector: one layout serves all.
        by_ready: dict[tuple[int, ...], Layout] = {}
        layouts = []
        for theirs, sent in messages:
            key = tuple(ControlVector.ready_in(theirs))
            found = by_ready.get(key)
            if found is None:
                found = by_ready[key] = self._layout(list(key), budget)
            layouts.append(found.offsets if sent is not None and sent.numel() == found.total
                           else {})

        def factor(slot: int) -> float:
            """The prescale a payload sent from a resident buffer left to the
            reduction (asked of a carried slot: one this rank has ready)."""
            return next(pre_factor(entry, size) for ready_slot, entry in ready
                        if ready_slot == slot)

        return agreed, mesh.round(messages, layouts, factor, spin=spin)


class GlooControl:
    """Vectors through a Gloo MIN-allreduce of the global set; no payloads."""

    budget = 0
    waiting_for: tuple[int, ...] = ()

    def __init__(self, sets: ProcessSets) -> None:
        self._sets = sets
        self.last_vectors: list[list[int]] = []

    def exchange(self, vector: ControlVector, ready: Sequence[tuple[int, Entry]],
                 budget: int, *, spin: bool = False) -> tuple[ControlVector, Carried | None]:
        group = self._sets.get(0)
        if group.size == 1:
            return vector, None
        # A MIN-allreduce needs vectors of one length: the slots go dense.
        tensor = torch.tensor(vector.encode_dense(), dtype=torch.int64)
        self._sets.backend("cpu", group).allreduce(tensor, ReduceKind.MIN)
        return ControlVector.decode_dense(tensor.tolist()), None
