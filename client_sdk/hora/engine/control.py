"""What one rank brings to an agreement round, and what the others' vectors say.

See :mod:`.agreement` for the rounds themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

__all__ = ["INVALID", "NOT_READY", "READY", "UNSET", "ControlVector", "peers_waiting_in"]

# What a rank says of a cache slot.
INVALID, NOT_READY, READY = 0, 1, 2
# Sent for the values only rank 0 sets: the MIN's identity, so the MIN hands everyone rank 0's.
UNSET = torch.iinfo(torch.int64).max


@dataclasses.dataclass
class ControlVector:
    """What one rank brings to a round; on the wire, ``slots`` then the seven fields.

    ``wait_us`` and ``minus_wait_us`` carry this rank's wait in the previous
    round as ``w`` and ``-w``: agreed, they are the shortest wait and minus the
    longest (:mod:`.telemetry`).
    """

    slots: list[int]
    lists_received: int
    cache_usable: bool
    fusion_threshold_kib: int = UNSET
    cycle_us: int = UNSET
    payload_budget: int = UNSET
    wait_us: int = 0
    minus_wait_us: int = 0

    _FIELDS = 7

    def encode(self) -> list[int]:
        return [*self.slots, self.lists_received, int(self.cache_usable),
                self.fusion_threshold_kib, self.cycle_us, self.payload_budget,
                self.wait_us, self.minus_wait_us]

    @classmethod
    def decode(cls, values: list[int]) -> ControlVector:
        width = len(values) - cls._FIELDS
        received, usable, threshold, cycle, budget, wait, minus_wait = values[width:]
        return cls(values[:width], received, bool(usable), threshold, cycle, budget,
                   wait, minus_wait)

    @staticmethod
    def agree(vectors: list[list[int]]) -> list[int]:
        """The element-wise MIN of encoded vectors."""
        agreed = vectors[0]
        for theirs in vectors[1:]:
            agreed = [a if a < b else b for a, b in zip(agreed, theirs, strict=True)]
        return agreed


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
        width = len(values) - ControlVector._FIELDS
        names = [name_of(slot) for slot in range(width)
                 if values[slot] == READY and slot not in waiting_here]
        found = [f"allreduce '{name}'" for name in names if name is not None]
        if found:
            more = f" and {len(found) - most} more" if len(found) > most else ""
            parts.append(f"rank {peer} is waiting in {', '.join(found[:most])}{more}")
    return "; ".join(parts)
