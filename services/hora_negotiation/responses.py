"""Answers: turning tensors ready on every rank into responses, fused where allowed.

One :class:`ResponseBuilder` per process set collects the set's responses in
the order the tensors became ready. Consecutive allreduces that share a fusion
key go out as one response up to the fusion threshold; a grouped allreduce
always goes out whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hora_proto.tensors import fusion_key

from .messages import ErrorKind, OpType, Response, ResponseType, TensorRequest
from .pending import PendingTensor, SetMembers, request_nbytes
from .validation import alltoall_splits, format_ranks, invalid_calls, op_name, validate

__all__ = [
    "Ready",
    "ReadyError",
    "ReadyGroup",
    "ReadyJoin",
    "ReadyTensor",
    "ResponseBuilder",
    "error_response",
    "fusion_key_of",
    "respond_group",
    "respond_tensor",
]


# Items in the ready list, in the order they became ready.
@dataclass(frozen=True)
class ReadyTensor:
    """A tensor every rank of its set submitted (or joined for)."""

    tensor: PendingTensor


@dataclass(frozen=True)
class ReadyGroup:
    """Every tensor of a grouped allreduce, ready together."""

    process_set: SetMembers
    tensors: tuple[PendingTensor, ...]


@dataclass(frozen=True)
class ReadyError:
    """An error decided before validation (a rank submitted a name twice)."""

    process_set: SetMembers
    names: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class ReadyJoin:
    """The last rank of the world joined."""

    process_set: SetMembers  # always set 0
    last_joined_rank: int


Ready = ReadyTensor | ReadyGroup | ReadyError | ReadyJoin


def error_response(
    names: Iterable[str], process_set_id: int, message: str, kind: ErrorKind = ErrorKind.MISMATCH
) -> Response:
    """An error response for ``names`` of one process set."""
    return Response(
        type=ResponseType.ERROR,
        tensor_names=tuple(names),
        process_set_id=process_set_id,
        error_message=message,
        error_kind=kind,
    )


def fusion_key_of(req: TensorRequest, process_set_id: int) -> tuple[object, ...]:
    """Allreduces whose requests have equal keys may share one fused response."""
    return fusion_key(req.dtype, req.device, req.reduce_op, req.prescale_factor,
                      req.postscale_factor, process_set_id)


class ResponseBuilder:
    """Builds one process set's response list, fusing consecutive allreduces.

    For each allreduce it keeps the request of a rank that submitted it (the
    *donor*); a response that covers a tensor some joined rank never submitted
    gets every name's donor as ``join_fill``, in name order.

    Responses are immutable, so the allreduce still open for fusion is kept as
    its parts and becomes a response when it closes. Every other response
    closes it first, so the list keeps the order in which tensors became ready.
    """

    def __init__(self, process_set: SetMembers, threshold: int) -> None:
        self.process_set = process_set
        self.responses: list[Response] = []
        self.targeted: dict[int, list[Response]] = {}
        self.negotiated = 0
        self.errors = 0
        self._threshold = threshold
        # The open allreduce: its names (None when none is open), key, bytes, donors.
        self._open_names: list[str] | None = None
        self._open_key: tuple[object, ...] | None = None
        self._open_bytes = 0
        self._open_donors: list[TensorRequest] = []
        self._open_fill = False

    def _allreduce(
        self, names: Iterable[str], donors: Iterable[TensorRequest], fill: bool
    ) -> Response:
        return Response(
            type=ResponseType.ALLREDUCE,
            tensor_names=tuple(names),
            process_set_id=self.process_set.id,
            join_fill=tuple(donors) if fill else (),
        )

    def _close(self) -> None:
        if self._open_names is not None:
            self.responses.append(
                self._allreduce(self._open_names, self._open_donors, self._open_fill)
            )
        self._open_names = None
        self._open_fill = False

    def finish(self) -> list[Response]:
        """The response list; the builder takes no more after this."""
        self._close()
        return self.responses

    def error(
        self, names: Iterable[str], message: str, kind: ErrorKind = ErrorKind.MISMATCH
    ) -> None:
        """An error for the whole set, in the set's response list."""
        self._close()
        self.errors += 1
        self.responses.append(error_response(names, self.process_set.id, message, kind))

    def error_to(self, ranks: Iterable[int], names: Iterable[str], message: str) -> None:
        """An error for ``ranks`` only; it does not enter the set's response list."""
        self.errors += 1
        response = error_response(names, self.process_set.id, message)
        for rank in ranks:
            self.targeted.setdefault(rank, []).append(response)

    def whole(self, response: Response) -> None:
        """A response that goes out as it is (never fused with another)."""
        self._close()
        self.negotiated += len(response.tensor_names)
        self.responses.append(response)

    def join(self, last_joined_rank: int) -> None:
        """The answer to the last rank's join: every rank's join returns."""
        self._close()
        self.negotiated += 1
        self.responses.append(
            Response(
                type=ResponseType.JOIN,
                process_set_id=self.process_set.id,
                last_joined_rank=last_joined_rank,
            )
        )

    def allreduce(
        self,
        name: str,
        key: tuple[object, ...],
        nbytes: int,
        donor: TensorRequest,
        fill: bool,
    ) -> None:
        """One allreduce: fused into the open response where key and threshold allow."""
        self.negotiated += 1
        if (
            self._open_names is not None
            and key == self._open_key
            and self._open_bytes + nbytes <= self._threshold
        ):
            self._open_names.append(name)
            self._open_bytes += nbytes
            self._open_donors.append(donor)
            self._open_fill = self._open_fill or fill
            return
        self._close()
        # A tensor at or over the threshold goes alone; threshold 0 never fuses.
        if nbytes < self._threshold:
            self._open_names, self._open_key, self._open_bytes = [name], key, nbytes
            self._open_donors = [donor]
            self._open_fill = fill
        else:
            self.responses.append(self._allreduce([name], [donor], fill))


def respond_group(item: ReadyGroup, builder: ResponseBuilder) -> None:
    """Answers a grouped allreduce whole, in one round: one response per fusion key
    (a group may mix dtypes, as Horovod's may), in the group's order of first
    appearance, or one error naming every tensor."""
    names = [t.name for t in item.tensors]
    for tensor in item.tensors:
        invalid = invalid_calls(tensor)
        if invalid is not None:
            builder.error(names, invalid, ErrorKind.INVALID)
            return
    for tensor in item.tensors:
        problem = validate(tensor)
        if problem is not None:
            builder.error(names, problem)
            return
    firsts = [t.first_request() for t in item.tensors]
    if any(req.op_type != OpType.ALLREDUCE for req in firsts):
        quoted = ", ".join(f"'{n}'" for n in names)
        builder.error(names, f"grouped allreduce of {quoted}: every tensor of a group "
                             "must be an allreduce")
        return
    set_size = len(item.process_set.ranks)
    fill = any(len(t.submissions) < set_size for t in item.tensors)
    parts: dict[tuple[object, ...], list[int]] = {}
    for i, req in enumerate(firsts):
        parts.setdefault(fusion_key_of(req, item.process_set.id), []).append(i)
    for part in parts.values():
        builder.whole(
            Response(
                type=ResponseType.ALLREDUCE,
                tensor_names=tuple(names[i] for i in part),
                process_set_id=item.process_set.id,
                join_fill=tuple(firsts[i] for i in part) if fill else (),
            )
        )


def respond_tensor(tensor: PendingTensor, builder: ResponseBuilder) -> None:
    """Answers one ready tensor: its collective, or the error its requests call for."""
    invalid = invalid_calls(tensor)
    if invalid is not None:
        builder.error([tensor.name], invalid, ErrorKind.INVALID)
        return
    problem = validate(tensor)
    if problem is not None:
        builder.error([tensor.name], problem)
        return
    pset = tensor.process_set
    first = tensor.first_request()
    op = first.op_type
    # Fewer submissions than ranks: the tensor became ready because the rest joined.
    partial = len(tensor.submissions) < len(pset.ranks)
    if op == OpType.ALLREDUCE:
        builder.allreduce(
            tensor.name, fusion_key_of(first, pset.id), request_nbytes(first), first, partial
        )
        return
    if partial:
        joined = format_ranks(tensor.missing_ranks())
        builder.error_to(
            tensor.submitters(),
            [tensor.name],
            f"tensor '{tensor.name}' ({op_name(op)}) cannot run while rank(s) {joined} "
            "have joined: hvd.join() supports allreduce only",
        )
        return
    first_dims: tuple[int, ...] = ()
    matrix: tuple[int, ...] = ()
    if op == OpType.ALLGATHER:
        # By position in the set: entry i is the set's i-th rank (ascending global rank).
        first_dims = tuple(
            tensor.submissions[r].shape[0] if tensor.submissions[r].shape else 1
            for r in pset.ranks
        )
    elif op == OpType.ALLTOALL:
        splits = alltoall_splits(tensor)
        if isinstance(splits, str):
            builder.error([tensor.name], splits)
            return
        matrix = tuple(splits)
    # OpType and ResponseType share their numbers for the collectives.
    builder.whole(
        Response(
            type=ResponseType(op),
            tensor_names=(tensor.name,),
            process_set_id=pset.id,
            first_dims=first_dims,
            splits=matrix,
        )
    )
