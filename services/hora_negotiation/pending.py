"""What waits in the negotiation table: process sets' ranks and partly submitted tensors."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hora_proto.tensors import tensor_nbytes

from .messages import OpType, TensorRequest

__all__ = ["PendingTensor", "SetMembers", "describe_waits", "request_nbytes"]


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


def describe_waits(pending: Iterable[PendingTensor], stalled: PendingTensor,
                   ranks: Sequence[int], most_ranks: int = 4, most_tensors: int = 2) -> str:
    """What the ranks that have not submitted ``stalled`` are blocked in, as far as
    the table knows: the collectives they submitted that still wait for others.

    E.g. ``"rank 1 is waiting in allgather 'b'"``; empty when it knows of none.
    At most ``most_ranks`` ranks and ``most_tensors`` tensors per rank are named.
    One pass over the pending tensors.
    """
    wanted = set(ranks[:most_ranks])
    found: dict[int, list[PendingTensor]] = {r: [] for r in wanted}
    for tensor in pending:
        if tensor is stalled:
            continue
        for rank in wanted.intersection(tensor.submissions):
            found[rank].append(tensor)
    parts = []
    for rank in ranks[:most_ranks]:
        tensors = found[rank]
        if not tensors:
            continue
        named = ", ".join(_collective(rank, t) for t in tensors[:most_tensors])
        more = f" and {len(tensors) - most_tensors} more" if len(tensors) > most_tensors else ""
        parts.append(f"rank {rank} is waiting in {named}{more}")
    return "; ".join(parts)


def _collective(rank: int, tensor: PendingTensor) -> str:
    op = tensor.submissions[rank].op_type
    name = OpType(op).name.lower() if op in OpType._value2member_map_ else f"op {op}"
    where = f" (process set {tensor.process_set.id})" if tensor.process_set.id else ""
    return f"{name} '{tensor.name}'{where}"
