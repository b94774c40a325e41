"""The response cache: allreduces the ranks have negotiated before.

After the coordinator has answered an allreduce of the global process set
once, every rank remembers it in a slot. The next time the same name comes
with the same signature, the rank does not ask the coordinator: it marks the
slot ready, and the ranks agree peer to peer, in a tiny allreduce of one
value per slot, on which slots are ready everywhere (see
:mod:`hora.engine.agreement`).

Every rank changes its cache only while executing the same round results in
the same order, so slot numbers, contents and LRU order stay identical on
all ranks without ever being exchanged.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import NamedTuple

from hora_proto.tensors import tensor_nbytes

__all__ = ["ResponseCache", "Signature", "fusion_fields"]


class Signature(NamedTuple):
    """What must match for a cached response to stand for a new request.

    A tuple: the engine makes one per enqueued tensor, and a tuple is several
    times cheaper to build than a frozen dataclass.
    """

    dtype: str
    shape: tuple[int, ...]
    device: str
    reduce_op: int
    prescale_factor: float
    postscale_factor: float

    @property
    def nbytes(self) -> int:
        """Bytes of one tensor with this signature."""
        return tensor_nbytes(self.dtype, self.shape)


#: The fusion key of a cached :class:`Signature`, with one C call: the fields
#: :func:`hora_proto.tensors.fusion_key` is made of (dtype, device, op and factors;
#: a cached tensor is of the global set). Cached tensors with equal keys may share
#: a fusion buffer, as the coordinator fuses negotiated ones.
fusion_fields = operator.itemgetter(0, 2, 3, 4, 5)


class ResponseCache:
    """Slots for negotiated allreduces, with least-recently-used eviction.

    Args:
        capacity: the most slots; 0 disables the cache.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: list[tuple[str, Signature] | None] = []
        self._by_name: dict[str, int] = {}
        self._free: list[int] = []
        self._lru: OrderedDict[int, None] = OrderedDict()
        # Bumped whenever a slot changes, so that derived data can be cached.
        self.version = 0
        # Per slot, the quick key (:meth:`~.pending.Entry.quick_key`) of the last
        # tensor found to match its signature: a tensor with the same key
        # matches too, without building its signature.
        self._quick: dict[int, object] = {}

    def __len__(self) -> int:
        """Number of slots in use or free (the width of a round's control vector)."""
        return len(self._slots)

    def lookup(self, name: str) -> tuple[int, Signature] | None:
        """The slot and signature cached under ``name``, if any."""
        slot = self._by_name.get(name)
        if slot is None:
            return None
        entry = self._slots[slot]
        assert entry is not None
        return slot, entry[1]

    def name(self, slot: int) -> str | None:
        entry = self._slots[slot] if slot < len(self._slots) else None
        return entry[0] if entry is not None else None

    def signature(self, slot: int) -> Signature:
        entry = self._slots[slot]
        assert entry is not None
        return entry[1]

    def quick(self, slot: int) -> object:
        """The quick key last recorded for ``slot`` (None when there is none)."""
        return self._quick.get(slot)

    def record_quick(self, slot: int, key: object) -> None:
        """Records that a tensor with quick key ``key`` matches ``slot``'s signature."""
        self._quick[slot] = key

    def put(self, name: str, signature: Signature) -> tuple[int, int | None]:
        """Caches ``name``; returns its slot and the slot evicted to make room, if any."""
        if self.capacity <= 0:
            raise ValueError("the response cache is disabled")
        self.version += 1
        existing = self._by_name.get(name)
        if existing is not None:
            self._slots[existing] = (name, signature)
            self._quick.pop(existing, None)
            self.touch(existing)
            return existing, None
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif len(self._slots) < self.capacity:
            slot = len(self._slots)
            self._slots.append(None)
        else:
            slot = next(iter(self._lru))
            self.evict(slot)
            evicted = slot
            self._free.remove(slot)
        self._slots[slot] = (name, signature)
        self._by_name[name] = slot
        self._lru[slot] = None
        return slot, evicted

    def touch(self, slot: int) -> None:
        """Marks ``slot`` as just used."""
        self._lru.move_to_end(slot)

    def touch_all(self, slots: list[int]) -> None:
        """Marks ``slots`` as just used, in their order (a round's ready slots)."""
        move = self._lru.move_to_end
        for slot in slots:
            move(slot)

    def evict(self, slot: int) -> str | None:
        """Empties ``slot``; returns the name it held."""
        entry = self._slots[slot] if slot < len(self._slots) else None
        if entry is None:
            return None
        self.version += 1
        self._slots[slot] = None
        self._quick.pop(slot, None)
        del self._by_name[entry[0]]
        self._lru.pop(slot, None)
        self._free.append(slot)
        return entry[0]

    def clear(self) -> list[str]:
        """Evicts everything; returns the names that were cached."""
        names = list(self._by_name)
        for slot in list(self._lru):
            self.evict(slot)
        return names
