"""The negotiation table: which named tensors are ready on which ranks.

Pure logic, no I/O and no clock of its own (callers pass ``now``). One table
serves one generation of one job. :meth:`NegotiationTable.submit` is the hot
path of training: it touches only the tensors named in the incoming message,
never the whole table.

A tensor is keyed by ``(process_set_id, name)``. It is *ready* when every rank
of its process set has submitted it; it is then validated across ranks and
turned into a :class:`~hora.v1.negotiation_pb2.Response`. Ready allreduces
that share a fusion key are fused up to the job's fusion threshold; the
tensors of a grouped allreduce always go out together in one response.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hora.v1 import negotiation_pb2 as pb

__all__ = [
    "NegotiationTable",
    "Outcome",
    "PendingTensor",
    "ProcessSet",
    "dtype_itemsize",
    "format_ranks",
    "tensor_nbytes",
]

_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int16": 2,
    "uint16": 2,
    "short": 2,
    "float32": 4,
    "float": 4,
    "int32": 4,
    "uint32": 4,
    "int": 4,
    "float64": 8,
    "double": 8,
    "int64": 8,
    "uint64": 8,
    "long": 8,
    "complex64": 8,
    "complex128": 16,
}

# Ops whose shapes must agree exactly, and ops where only the first dimension may differ.
_SAME_SHAPE = frozenset({pb.OP_TYPE_ALLREDUCE, pb.OP_TYPE_BROADCAST, pb.OP_TYPE_REDUCESCATTER})
_RAGGED_FIRST_DIM = frozenset({pb.OP_TYPE_ALLGATHER, pb.OP_TYPE_ALLTOALL})
# OpType and ResponseType share numbers for the six collectives.
_KNOWN_OPS = frozenset(range(pb.OP_TYPE_ALLREDUCE, pb.OP_TYPE_BARRIER + 1))

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


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name; unknown names count as 8 (never under-fuse)."""
    return _ITEMSIZE.get(dtype.removeprefix("torch."), 8)


def tensor_nbytes(request: pb.TensorRequest) -> int:
    """Size in bytes of the tensor a request describes (numel times itemsize)."""
    numel = 1
    for dim in request.shape:
        numel *= dim
    return numel * dtype_itemsize(request.dtype)


def format_ranks(ranks: Sequence[int]) -> str:
    """Compact rank list: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    start = prev = None
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


@dataclass(frozen=True)
class ProcessSet:
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

    process_set: ProcessSet
    name: str
    first_seen: float
    submissions: dict[int, pb.TensorRequest] = field(default_factory=dict)
    last_warned: float | None = None

    def missing_ranks(self) -> list[int]:
        """Ranks of the set that have not submitted yet, ascending."""
        return [r for r in self.process_set.ranks if r not in self.submissions]


@dataclass
class Outcome:
    """What one submission decided.

    Attributes:
        broadcasts: Response lists to send, each to every rank of its process set.
        direct: Error responses for the submitting rank only.
        negotiated: Tensor names answered with a collective (not an error).
        errors: Error responses produced.
    """

    broadcasts: list[tuple[ProcessSet, pb.ResponseList]] = field(default_factory=list)
    direct: list[pb.Response] = field(default_factory=list)
    negotiated: int = 0
    errors: int = 0


@dataclass(eq=False)
class _Group:
    size: int
    held: list[PendingTensor] = field(default_factory=list)


# Items in the ready list, in the order they became ready.
@dataclass(frozen=True)
class _ReadyTensor:
    tensor: PendingTensor


@dataclass(frozen=True)
class _ReadyGroup:
    process_set: ProcessSet
    tensors: tuple[PendingTensor, ...]


@dataclass(frozen=True)
class _ReadyError:
    process_set: ProcessSet
    names: tuple[str, ...]
    message: str


_Ready = _ReadyTensor | _ReadyGroup | _ReadyError


def _error(
    names: Iterable[str], process_set_id: int, message: str, kind: int = pb.ERROR_KIND_MISMATCH
) -> pb.Response:
    return pb.Response(
        type=pb.RESPONSE_TYPE_ERROR,
        tensor_names=list(names),
        process_set_id=process_set_id,
        error_message=message,
        error_kind=kind,
    )


def _format_value(field_name: str, value: object) -> str:
    if field_name == "op_type":
        return pb.OpType.Name(value).removeprefix("OP_TYPE_")  # type: ignore[arg-type]
    if field_name == "reduce_op":
        return pb.ReduceOp.Name(value).removeprefix("REDUCE_OP_")  # type: ignore[arg-type]
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if value == "":
        return "''"
    return str(value)


def mismatch_message(name: str, what: str, values: dict[int, str]) -> str:
    """``tensor 'NAME': mismatched WHAT: rank 0 A, rank 1 B``; ranks grouped by value."""
    by_value: dict[str, list[int]] = {}
    for rank in sorted(values):
        by_value.setdefault(values[rank], []).append(rank)
    parts = [
        f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)} {value}"
        for value, ranks in by_value.items()
    ]
    return f"tensor '{name}': mismatched {what}: " + ", ".join(parts)


def validate(tensor: PendingTensor) -> str | None:
    """Checks that every rank submitted a compatible request; the error text if not."""
    ranks = tensor.process_set.ranks
    subs = tensor.submissions
    first = subs[ranks[0]]
    name = tensor.name
    for field_name in _AGREED_FIELDS:
        expected = getattr(first, field_name)
        if any(getattr(subs[r], field_name) != expected for r in ranks[1:]):
            return mismatch_message(
                name,
                field_name,
                {r: _format_value(field_name, getattr(subs[r], field_name)) for r in ranks},
            )
    op = first.op_type
    if op not in _KNOWN_OPS:
        return f"tensor '{name}': op_type {_format_value('op_type', op)} is not a collective"
    if op in _SAME_SHAPE:
        shape = first.shape
        if any(subs[r].shape != shape for r in ranks[1:]):
            return mismatch_message(
                name, "shape", {r: _format_value("shape", tuple(subs[r].shape)) for r in ranks}
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
                {r: _format_value("shape", tuple(subs[r].shape[1:])) for r in ranks},
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
                f"{_format_value('splits', tuple(splits))} sum to {sum(splits)} but its "
                f"first dimension is {first_dim}"
            )
        matrix.extend(splits)
    return matrix


def _fusion_key(req: pb.TensorRequest, process_set_id: int) -> tuple[object, ...]:
    return (
        req.dtype,
        req.device,
        req.reduce_op,
        req.prescale_factor,
        req.postscale_factor,
        process_set_id,
    )


class _Builder:
    """Builds one process set's response list, fusing consecutive allreduces."""

    def __init__(self, process_set: ProcessSet, threshold: int) -> None:
        self.process_set = process_set
        self.responses: list[pb.Response] = []
        self.negotiated = 0
        self.errors = 0
        self._threshold = threshold
        self._open: pb.Response | None = None
        self._open_key: tuple[object, ...] | None = None
        self._open_bytes = 0

    def error(self, names: Iterable[str], message: str) -> None:
        self._open = None
        self.errors += 1
        self.responses.append(_error(names, self.process_set.id, message))

    def whole(self, response: pb.Response) -> None:
        self._open = None
        self.negotiated += len(response.tensor_names)
        self.responses.append(response)

    def allreduce(self, name: str, key: tuple[object, ...], nbytes: int) -> None:
        self.negotiated += 1
        if (
            self._open is not None
            and key == self._open_key
            and self._open_bytes + nbytes <= self._threshold
        ):
            self._open.tensor_names.append(name)
            self._open_bytes += nbytes
            return
        response = pb.Response(
            type=pb.RESPONSE_TYPE_ALLREDUCE, tensor_names=[name], process_set_id=self.process_set.id
        )
        self.responses.append(response)
        # A tensor at or over the threshold goes alone; threshold 0 never fuses.
        if nbytes < self._threshold:
            self._open, self._open_key, self._open_bytes = response, key, nbytes
        else:
            self._open = None


class NegotiationTable:
    """Pending tensors of one generation of one job.

    Args:
        size: World size of the generation (process set 0 is ``range(size)``).
        fusion_threshold_bytes: Largest fused allreduce in bytes; 0 never fuses.
    """

    def __init__(self, size: int, fusion_threshold_bytes: int) -> None:
        self.process_sets: dict[int, ProcessSet] = {0: ProcessSet(0, tuple(range(size)))}
        self.pending: dict[tuple[int, str], PendingTensor] = {}
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self._groups: dict[tuple[int, int], _Group] = {}
        # Process set id -> why its tensors can no longer complete (a rank left).
        self._broken_sets: dict[int, str] = {}

    def submit(self, rank: int, requests: Iterable[pb.TensorRequest], now: float) -> Outcome:
        """Records one message's requests from ``rank`` and answers what became ready."""
        ready: list[_Ready] = []
        outcome = Outcome()
        for req in requests:
            pset = self.process_sets.get(req.process_set_id)
            if pset is None:
                outcome.direct.append(
                    _error(
                        [req.name],
                        req.process_set_id,
                        f"tensor '{req.name}': unknown process set {req.process_set_id}",
                    )
                )
                continue
            if rank not in pset.members:
                outcome.direct.append(
                    _error(
                        [req.name],
                        pset.id,
                        f"tensor '{req.name}': rank {rank} is not in process set {pset.id}",
                    )
                )
                continue
            key = (pset.id, req.name)
            tensor = self.pending.get(key)
            if tensor is None:
                broken = self._broken_sets.get(pset.id)
                if broken is not None:
                    outcome.direct.append(
                        _error(
                            [req.name],
                            pset.id,
                            f"tensor '{req.name}' cannot complete: {broken}",
                            pb.ERROR_KIND_RANK_GONE,
                        )
                    )
                    continue
                tensor = PendingTensor(pset, req.name, now)
                self.pending[key] = tensor
            elif rank in tensor.submissions:
                del self.pending[key]
                ready.append(
                    _ReadyError(
                        pset, (req.name,), f"tensor '{req.name}': rank {rank} submitted it twice"
                    )
                )
                continue
            tensor.submissions[rank] = req
            if len(tensor.submissions) == len(pset.ranks):
                del self.pending[key]
                self._became_ready(tensor, req, ready)
        outcome.errors += len(outcome.direct)
        if ready:
            self._respond(ready, outcome)
        return outcome

    def _became_ready(
        self, tensor: PendingTensor, last: pb.TensorRequest, ready: list[_Ready]
    ) -> None:
        first = tensor.submissions[tensor.process_set.ranks[0]]
        if first.group_id == 0 or first.group_size <= 1:
            ready.append(_ReadyTensor(tensor))
            return
        # Hold group members until the whole group is ready; then they go as one.
        gkey = (tensor.process_set.id, first.group_id)
        group = self._groups.get(gkey)
        if group is None:
            group = self._groups[gkey] = _Group(first.group_size)
        group.held.append(tensor)
        if len(group.held) >= group.size:
            del self._groups[gkey]
            ready.append(_ReadyGroup(tensor.process_set, tuple(group.held)))

    def _respond(self, ready: list[_Ready], outcome: Outcome) -> None:
        builders: dict[int, _Builder] = {}
        for item in ready:
            pset = item.tensor.process_set if isinstance(item, _ReadyTensor) else item.process_set
            builder = builders.get(pset.id)
            if builder is None:
                builder = builders[pset.id] = _Builder(pset, self.fusion_threshold_bytes)
            if isinstance(item, _ReadyError):
                builder.error(item.names, item.message)
            elif isinstance(item, _ReadyGroup):
                self._respond_group(item, builder)
            else:
                self._respond_tensor(item.tensor, builder)
        for builder in builders.values():
            outcome.broadcasts.append(
                (builder.process_set, pb.ResponseList(responses=builder.responses))
            )
            outcome.negotiated += builder.negotiated
            outcome.errors += builder.errors

    @staticmethod
    def _respond_group(item: _ReadyGroup, builder: _Builder) -> None:
        names = [t.name for t in item.tensors]
        for tensor in item.tensors:
            problem = validate(tensor)
            if problem is not None:
                builder.error(names, problem)
                return
        firsts = [t.submissions[t.process_set.ranks[0]] for t in item.tensors]
        keys = {_fusion_key(req, item.process_set.id) for req in firsts}
        if len(keys) > 1 or any(req.op_type != pb.OP_TYPE_ALLREDUCE for req in firsts):
            quoted = ", ".join(f"'{n}'" for n in names)
            builder.error(
                names,
                f"grouped allreduce of {quoted}: the tensors of a group must "
                "all be allreduces with the same dtype, device, reduce_op and "
                "scale factors",
            )
            return
        builder.whole(
            pb.Response(
                type=pb.RESPONSE_TYPE_ALLREDUCE,
                tensor_names=names,
                process_set_id=item.process_set.id,
            )
        )

    @staticmethod
    def _respond_tensor(tensor: PendingTensor, builder: _Builder) -> None:
        problem = validate(tensor)
        if problem is not None:
            builder.error([tensor.name], problem)
            return
        pset = tensor.process_set
        first = tensor.submissions[pset.ranks[0]]
        op = first.op_type
        if op == pb.OP_TYPE_ALLREDUCE:
            builder.allreduce(tensor.name, _fusion_key(first, pset.id), tensor_nbytes(first))
            return
        response = pb.Response(type=op, tensor_names=[tensor.name], process_set_id=pset.id)
        if op == pb.OP_TYPE_ALLGATHER:
            response.first_dims.extend(
                tensor.submissions[r].shape[0] if tensor.submissions[r].shape else 1
                for r in pset.ranks
            )
        elif op == pb.OP_TYPE_ALLTOALL:
            splits = alltoall_splits(tensor)
            if isinstance(splits, str):
                builder.error([tensor.name], splits)
                return
            response.splits.extend(splits)
        builder.whole(response)

    def depart(self, rank: int, reason: str) -> dict[int, list[pb.Response]]:
        """A rank left for good: fail what waits on it and what will need it.

        Every pending tensor of a set containing ``rank`` that ``rank`` has not
        submitted can never complete; each rank that did submit it gets an
        error ``tensor 'NAME' cannot complete: REASON``. Later first
        submissions in those sets fail at once with the same text.

        Returns:
            Error responses to send, by recipient rank.
        """
        out: dict[int, list[pb.Response]] = {}
        broken_groups: set[tuple[int, int]] = set()
        for pset in self.process_sets.values():
            if rank in pset.members:
                self._broken_sets.setdefault(pset.id, reason)
        for key, tensor in list(self.pending.items()):
            if rank not in tensor.process_set.members or rank in tensor.submissions:
                continue
            del self.pending[key]
            response = _error(
                [tensor.name],
                tensor.process_set.id,
                f"tensor '{tensor.name}' cannot complete: {reason}",
                pb.ERROR_KIND_RANK_GONE,
            )
            for submitter in tensor.submissions:
                out.setdefault(submitter, []).append(response)
            first = next(iter(tensor.submissions.values()))
            if first.group_id:
                broken_groups.add((tensor.process_set.id, first.group_id))
        # Group members already ready everywhere cannot go out without their siblings.
        for gkey in broken_groups:
            group = self._groups.pop(gkey, None)
            if group is None:
                continue
            for tensor in group.held:
                response = _error(
                    [tensor.name],
                    tensor.process_set.id,
                    f"tensor '{tensor.name}' cannot complete: {reason}",
                    pb.ERROR_KIND_RANK_GONE,
                )
                for member in tensor.process_set.ranks:
                    if member != rank:
                        out.setdefault(member, []).append(response)
        return out

    def clear(self) -> None:
        """Forgets every pending tensor (the generation ended)."""
        self.pending.clear()
        self._groups.clear()
