"""What one rank brings to an agreement round, and what the others' vectors say.

See :mod:`.agreement` for the rounds themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from hora_native import BackendError

__all__ = ["INVALID", "NOT_READY", "READY", "UNSET", "ControlVector", "peers_waiting_in"]

# What a rank says of a cache slot.
INVALID, NOT_READY, READY = 0, 1, 2
# Sent for the values only rank 0 sets: the MIN's identity, so the MIN hands everyone rank 0's.
UNSET = torch.iinfo(torch.int64).max


@dataclasses.dataclass
class ControlVector:
    """What one rank brings to a round.

    The slots travel sparse: the ready ones and the invalid ones, ascending,
    so that a round costs what is ready, not the size of the cache (a model
    whose first step cached 400 gradients then agreeing on one fused
    allreduce per step sends one slot, not 400). ``width`` is the size of the
    cache, the same on every rank while their caches agree.

    On the wire: ``width``, the seven fields, the count of ready slots, the
    ready slots, then the invalid ones. ``wait_us`` and ``minus_wait_us``
    carry this rank's wait in the previous round as ``w`` and ``-w``: agreed,
    they are the shortest wait and minus the longest (:mod:`.telemetry`).
    """

    width: int
    ready: list[int]
    invalid: list[int]
    lists_received: int
    cache_usable: bool
    fusion_threshold_kib: int = UNSET
    cycle_us: int = UNSET
    payload_budget: int = UNSET
    wait_us: int = 0
    minus_wait_us: int = 0

    _HEAD = 9  # width, the seven fields, the count of ready slots

    @classmethod
    def of(cls, slots: Sequence[int], lists_received: int, cache_usable: bool,
           **fields: int) -> ControlVector:
        """The vector of ``slots``, one of READY, NOT_READY or INVALID per cache slot."""
        return cls(len(slots), [i for i, v in enumerate(slots) if v == READY],
                   [i for i, v in enumerate(slots) if v == INVALID], lists_received,
                   cache_usable, **fields)

    @property
    def slots(self) -> list[int]:
        """READY, NOT_READY or INVALID for every cache slot (dense: for the Gloo
        exchange and for tests, never in a round on the mesh)."""
        dense = [NOT_READY] * self.width
        for slot in self.ready:
            dense[slot] = READY
        for slot in self.invalid:
            dense[slot] = INVALID
        return dense

    def encode(self) -> list[int]:
        return [self.width, self.lists_received, int(self.cache_usable),
                self.fusion_threshold_kib, self.cycle_us, self.payload_budget,
                self.wait_us, self.minus_wait_us, len(self.ready), *self.ready, *self.invalid]

    @classmethod
    def decode(cls, values: Sequence[int]) -> ControlVector:
        (width, received, usable, threshold, cycle, budget, wait, minus_wait), ready, \
            invalid = cls._parts(values)
        return cls(width, list(ready), list(invalid), received, bool(usable), threshold,
                   cycle, budget, wait, minus_wait)

    def encode_dense(self) -> list[int]:
        """The width and fields, then one value per slot: for a MIN-allreduce, whose
        vectors all have one length."""
        return [*self.encode()[:self._HEAD - 1], *self.slots]

    @classmethod
    def decode_dense(cls, values: Sequence[int]) -> ControlVector:
        """The vector :meth:`encode_dense` gave (or the MIN of several)."""
        dense = values[cls._HEAD - 1:]
        ready = [i for i, v in enumerate(dense) if v == READY]
        invalid = [i for i, v in enumerate(dense) if v == INVALID]
        return cls.decode([*values[:cls._HEAD - 1], len(ready), *ready, *invalid])

    @classmethod
    def _parts(cls, values: Sequence[int]
               ) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
        """An encoded vector's width and fields, its ready slots and its invalid ones."""
        n = values[cls._HEAD - 1]
        return values[:cls._HEAD - 1], values[cls._HEAD:cls._HEAD + n], values[cls._HEAD + n:]

    @classmethod
    def ready_in(cls, values: Sequence[int]) -> Sequence[int]:
        """The ready slots an encoded vector lists."""
        return cls._parts(values)[1]

    @classmethod
    def agree(cls, vectors: list[list[int]]) -> list[int]:
        """Encoded vectors agreed, encoded: each field's MIN, the slots ready on every
        rank and invalid on none, the slots invalid on any (as the element-wise
        MIN of dense vectors, INVALID < NOT_READY < READY).

        Raises:
            BackendError: the vectors' widths differ (the ranks' caches diverged).
        """
        head, ready, invalid = cls._parts(vectors[0])
        width, fields, stale = head[0], head[1:], set(invalid)
        for rank, theirs in enumerate(vectors[1:], 1):
            (their_width, *their_fields), their_ready, their_invalid = cls._parts(theirs)
            if their_width != width:
                raise BackendError(
                    f"control vectors: rank {rank} has {their_width} cache slots, rank 0 "
                    f"{width}; the ranks' caches diverged")
            fields = [a if a < b else b for a, b in zip(fields, their_fields, strict=True)]
            if their_ready != ready:  # in training, every rank is ready with the same
                found = set(their_ready)
                ready = [slot for slot in ready if slot in found]
            stale.update(their_invalid)
        if stale and ready:
            ready = [slot for slot in ready if slot not in stale]
        return [width, *fields, len(ready), *ready, *sorted(stale)]


def peers_waiting_in(vectors: Sequence[Sequence[int]], rank: int, waiting_here: set[int],
                     name_of: Callable[[int], str | None], most: int = 2) -> str:
    """What the peers of the last round were ready with that this rank was not:
    cached allreduces they wait in (``"rank 1 is waiting in allreduce 'y'"``).

    ``vectors`` are the encoded vectors of the last exchange, by rank (empty
    for a rank not heard from); ``waiting_here`` the slots this rank waits in.
    Read when a stall is reported only, never in a round.
    """
    parts = []
    for peer, values in enumerate(vectors):
        if peer == rank or not values:
            continue
        names = [name_of(slot) for slot in ControlVector.ready_in(values)
                 if slot not in waiting_here]
        found = [f"allreduce '{name}'" for name in names if name is not None]
        if found:
            more = f" and {len(found) - most} more" if len(found) > most else ""
            parts.append(f"rank {peer} is waiting in {', '.join(found[:most])}{more}")
    return "; ".join(parts)
