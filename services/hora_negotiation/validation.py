"""Do the ranks agree? Checks of the requests every rank sent for one tensor.

Each check returns the error text every rank will see, or None; the texts
name the tensor, the field and the ranks grouped by what they sent. Every
rank gets the text, so it stays a few KiB however many ranks sent however
long a value: each value quoted is clipped (:func:`clipped`), and lists stop
at a budget and count the rest (:func:`listing`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .messages import OpType, ReduceOp
from .pending import PendingTensor

__all__ = [
    "LISTING_BUDGET",
    "QUOTE_LIMIT",
    "alltoall_splits",
    "clipped",
    "format_ranks",
    "format_value",
    "invalid_calls",
    "listing",
    "mismatch_message",
    "op_name",
    "validate",
]

#: Most characters of any one value (a rank's text, a dtype, a rank list) an
#: error message quotes.
QUOTE_LIMIT = 200
#: Characters a list in an error message may take before it counts the rest.
LISTING_BUDGET = 2000

# Ops whose shapes must agree exactly, and ops where only the first dimension may differ.
_SAME_SHAPE = frozenset({OpType.ALLREDUCE, OpType.BROADCAST, OpType.REDUCESCATTER})
_RAGGED_FIRST_DIM = frozenset({OpType.ALLGATHER, OpType.ALLTOALL})
# OpType and ResponseType share numbers for the six collectives.
_KNOWN_OPS = frozenset(range(OpType.ALLREDUCE, OpType.BARRIER + 1))
# Numbers a newer trainer may send that this coordinator has no name for.
_KNOWN_REDUCE_OPS = frozenset(ReduceOp)

# Fields every rank must agree on, for every op.
_AGREED_FIELDS = (
    "op_type",
    "dtype",
    "device",
    "reduce_op",
    "root_rank",
    "prescale_factor",
    "postscale_factor",
    "group_id",
    "group_size",
)


def clipped(text: str) -> str:
    """``text``, cut after :data:`QUOTE_LIMIT` characters (ending in "…")."""
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT] + "…"


def listing(items: Iterable[str], count: int, noun: str = "rank", sep: str = "; ") -> str:
    """The first of ``count`` items joined by ``sep``, until :data:`LISTING_BUDGET`
    characters are spent; then how many are left out ("and 3 more ranks")."""
    shown: list[str] = []
    used = 0
    for item in items:
        used += len(item) + len(sep)
        if shown and used > LISTING_BUDGET:
            more = count - len(shown)
            return sep.join(shown) + f"{sep}and {more} more {noun}{'s' if more > 1 else ''}"
        shown.append(item)
    return sep.join(shown)


def format_ranks(ranks: Sequence[int]) -> str:
    """Compact rank list: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    start: int | None = None
    prev = 0  # read only once start is set
    for rank in sorted(ranks):
        if start is None:
            start = prev = rank
        elif rank == prev + 1:
            prev = rank
        else:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = rank
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def _enum_name(kind: type[OpType] | type[ReduceOp], value: object) -> str:
    """The member name of ``value``, or the bare number when this coordinator knows
    no such member (proto3 enums are open: a newer peer may send any number)."""
    try:
        return kind(value).name  # type: ignore[arg-type]
    except ValueError:
        return str(value)


def format_value(field_name: str, value: object) -> str:
    """One rank's value of a field as mismatch messages show it (enum names, lists)."""
    if field_name == "op_type":
        return _enum_name(OpType, value)
    if field_name == "reduce_op":
        return _enum_name(ReduceOp, value)
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if value == "":
        return "''"
    return str(value)


def mismatch_message(name: str, what: str, values: dict[int, str]) -> str:
    """``tensor 'NAME': mismatched WHAT: rank 0 A, rank 1 B``; ranks grouped by value.

    Each group's ranks and value are clipped, and past :data:`LISTING_BUDGET`
    the rest of the groups are counted (", and 5 more values").
    """
    by_value: dict[str, list[int]] = {}
    for rank in sorted(values):
        by_value.setdefault(values[rank], []).append(rank)
    parts = (
        f"{'rank' if len(ranks) == 1 else 'ranks'} {clipped(format_ranks(ranks))} "
        f"{clipped(value)}"
        for value, ranks in by_value.items()
    )
    return f"tensor '{name}': mismatched {what}: " + listing(
        parts, len(by_value), "value", ", "
    )


def op_name(op: int) -> str:
    """``allgather`` for OpType.ALLGATHER: the collective as messages name it."""
    return _enum_name(OpType, op).lower()


def invalid_calls(tensor: PendingTensor) -> str | None:
    """What the ranks that found their own call invalid said, or None when none did."""
    said = [(r, tensor.submissions[r].invalid) for r in tensor.submitters()]
    said = [(r, text) for r, text in said if text]
    if not said:
        return None
    return f"tensor '{tensor.name}': invalid call on " + listing(
        (f"rank {r}: {clipped(text)}" for r, text in said), len(said)
    )


def validate(tensor: PendingTensor) -> str | None:
    """Checks that every rank that submitted sent a compatible request; the error text if not."""
    ranks = tensor.submitters()
    subs = tensor.submissions
    first = subs[ranks[0]]
    name = tensor.name
    for field_name in _AGREED_FIELDS:
        expected = getattr(first, field_name)
        if any(getattr(subs[r], field_name) != expected for r in ranks[1:]):
            return mismatch_message(
                name,
                field_name,
                {r: format_value(field_name, getattr(subs[r], field_name)) for r in ranks},
            )
    op = first.op_type
    if op not in _KNOWN_OPS:
        return f"tensor '{name}': op_type {format_value('op_type', op)} is not a collective"
    if first.reduce_op not in _KNOWN_REDUCE_OPS:
        return (
            f"tensor '{name}': reduce_op {first.reduce_op} is not one this coordinator "
            "knows (a trainer newer than the coordinator?)"
        )
    if op in _SAME_SHAPE:
        shape = first.shape
        if any(subs[r].shape != shape for r in ranks[1:]):
            return mismatch_message(
                name, "shape", {r: format_value("shape", tuple(subs[r].shape)) for r in ranks}
            )
    elif op in _RAGGED_FIRST_DIM:
        ndim = len(first.shape)
        if any(len(subs[r].shape) != ndim for r in ranks[1:]):
            return mismatch_message(
                name, "number of dimensions", {r: str(len(subs[r].shape)) for r in ranks}
            )
        trailing = first.shape[1:]
        if any(subs[r].shape[1:] != trailing for r in ranks[1:]):
            return mismatch_message(
                name,
                "shape[1:]",
                {r: format_value("shape", tuple(subs[r].shape[1:])) for r in ranks},
            )
    return None


def alltoall_splits(tensor: PendingTensor) -> list[int] | str:
    """The sender-major split matrix of an alltoall, or the error text.

    A rank that sent no splits divides its first dimension evenly, as
    Horovod does when ``splits`` is omitted.
    """
    ranks = tensor.process_set.ranks
    n = len(ranks)
    matrix: list[int] = []
    for r in ranks:
        req = tensor.submissions[r]
        if not req.shape:
            return f"tensor '{tensor.name}': alltoall needs at least one dimension (rank {r})"
        first_dim = req.shape[0]
        splits = list(req.splits)
        if not splits:
            if first_dim % n:
                return (
                    f"tensor '{tensor.name}': rank {r} sent no splits and its first "
                    f"dimension {first_dim} does not divide among {n} ranks"
                )
            splits = [first_dim // n] * n
        elif len(splits) != n:
            return (
                f"tensor '{tensor.name}': rank {r} sent {len(splits)} splits for a "
                f"process set of {n} ranks"
            )
        elif any(s < 0 for s in splits) or sum(splits) != first_dim:
            return (
                f"tensor '{tensor.name}': rank {r} splits "
                f"{clipped(format_value('splits', tuple(splits)))} sum to {sum(splits)} but its "
                f"first dimension is {first_dim}"
            )
        matrix.extend(splits)
    return matrix
