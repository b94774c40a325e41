"""What waits in the negotiation table: process sets' ranks and partly submitted tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hora_proto.tensors import tensor_nbytes

from ..messages import TensorRequest

__all__ = ["PendingTensor", "SetMembers", "request_nbytes"]


def request_nbytes(request: TensorRequest) -> int:
    """Size in bytes of the tensor a request describes."""
    return tensor_nbytes(request.dtype, request.shape)


@dataclass(frozen=True)
class SetMembers:
    """Ranks a collective runs over. Set 0 is every rank of the generation."""

    id: int
    ranks: tuple[int, ...]
    members: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", frozenset(self.ranks))


@dataclass(eq=False)
class PendingTensor:
    """A tensor some ranks of its process set have submitted.

    Attributes:
        process_set: The set whose ranks must all submit it.
        name: The tensor's name.
        first_seen: Clock time of the first submission (stall detection).
        submissions: The request of each rank that submitted, by rank.
        last_warned: Clock time of the last stall warning, if any.
    """

    process_set: SetMembers
    name: str
    first_seen: float
    submissions: dict[int, TensorRequest] = field(default_factory=dict)
    last_warned: float | None = None

    def missing_ranks(self) -> list[int]:
        """Ranks of the set that have not submitted yet, ascending."""
        return [r for r in self.process_set.ranks if r not in self.submissions]

    def first_request(self) -> TensorRequest:
        """The request of the lowest rank of the set that submitted it."""
        subs = self.submissions
        for rank in self.process_set.ranks:
            req = subs.get(rank)
            if req is not None:
                return req
        raise LookupError(f"tensor '{self.name}' has no submissions")  # never pending empty

    def submitters(self) -> Sequence[int]:
        """Ranks that submitted it, in set order (all of them unless some joined)."""
        ranks = self.process_set.ranks
        if len(self.submissions) == len(ranks):
            return ranks
        return [r for r in ranks if r in self.submissions]
