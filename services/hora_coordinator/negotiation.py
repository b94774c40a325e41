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

Process sets other than 0 are registered by :meth:`NegotiationTable.add_process_set`;
a set's collectives order its ranks by the ascending ``ranks`` list (first_dims,
the alltoall matrix) and are answered to its members only.

``hvd.join()``: a rank that sends an ``OP_TYPE_JOIN`` request is *joined*
until every rank of the world has joined. While it is, a tensor is ready once
every non-joined rank of its set submitted it; an allreduce then goes to the
whole set with ``join_fill`` (what the joined ranks need to contribute the
reduction's identity), any other collective fails on its submitters. When the
last rank joins, every rank gets one ``RESPONSE_TYPE_JOIN`` and the joined state
is cleared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hora_proto.tensors import fusion_key, tensor_nbytes
from hora_proto.v1 import negotiation_pb2 as pb

from .errors import InvalidRequestError

__all__ = [
    "NegotiationTable",
    "Outcome",
    "PendingTensor",
    "ProcessSet",
    "format_ranks",
    "request_nbytes",
]


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


def request_nbytes(request: pb.TensorRequest) -> int:
    """Size in bytes of the tensor a request describes."""
    return tensor_nbytes(request.dtype, request.shape)


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

    def first_request(self) -> pb.TensorRequest:
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


@dataclass
class Outcome:
    """What one submission (or one removal) decided.

    Attributes:
        broadcasts: Response lists to send, each to every rank of its process set.
        direct: Error responses for the submitting rank only.
        targeted: Error responses for some ranks only, by rank (a collective
            that cannot run because ranks joined fails on its submitters).
        negotiated: Tensor names answered with a collective (not an error),
            plus one per completed join.
        errors: Error responses produced.
    """

    broadcasts: list[tuple[ProcessSet, pb.ResponseList]] = field(default_factory=list)
    direct: list[pb.Response] = field(default_factory=list)
    targeted: dict[int, list[pb.Response]] = field(default_factory=dict)
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


@dataclass(frozen=True)
class _ReadyJoin:
    process_set: ProcessSet  # always set 0
    last_joined_rank: int


_Ready = _ReadyTensor | _ReadyGroup | _ReadyError | _ReadyJoin


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


def _op_name(op: int) -> str:
    return pb.OpType.Name(op).removeprefix("OP_TYPE_").lower()  # type: ignore[arg-type]


def invalid_calls(tensor: PendingTensor) -> str | None:
    """What the ranks that found their own call invalid said, or None when none did."""
    said = [(r, tensor.submissions[r].invalid) for r in tensor.submitters()]
    said = [(r, text) for r, text in said if text]
    if not said:
        return None
    return f"tensor '{tensor.name}': invalid call on " + "; ".join(
        f"rank {r}: {text}" for r, text in said
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
    return fusion_key(req.dtype, req.device, req.reduce_op, req.prescale_factor,
                      req.postscale_factor, process_set_id)


class _Builder:
    """Builds one process set's response list, fusing consecutive allreduces.

    For each allreduce it keeps the request of a rank that submitted it (the
    *donor*); a response that covers a tensor some joined rank never submitted
    gets every name's donor as ``join_fill``, in name order.
    """

    def __init__(self, process_set: ProcessSet, threshold: int) -> None:
        self.process_set = process_set
        self.responses: list[pb.Response] = []
        self.targeted: dict[int, list[pb.Response]] = {}
        self.negotiated = 0
        self.errors = 0
        self._threshold = threshold
        self._open: pb.Response | None = None
        self._open_key: tuple[object, ...] | None = None
        self._open_bytes = 0
        self._open_donors: list[pb.TensorRequest] = []
        self._open_fill = False

    def _close(self) -> None:
        if self._open is not None and self._open_fill:
            self._open.join_fill.extend(self._open_donors)
        self._open = None
        self._open_fill = False

    def finish(self) -> list[pb.Response]:
        """The response list; the builder takes no more after this."""
        self._close()
        return self.responses

    def error(
        self, names: Iterable[str], message: str, kind: int = pb.ERROR_KIND_MISMATCH
    ) -> None:
        self._close()
        self.errors += 1
        self.responses.append(_error(names, self.process_set.id, message, kind))

    def error_to(self, ranks: Iterable[int], names: Iterable[str], message: str) -> None:
        """An error for ``ranks`` only; it does not enter the set's response list."""
        self.errors += 1
        response = _error(names, self.process_set.id, message)
        for rank in ranks:
            self.targeted.setdefault(rank, []).append(response)

    def whole(self, response: pb.Response) -> None:
        self._close()
        self.negotiated += len(response.tensor_names)
        self.responses.append(response)

    def join(self, last_joined_rank: int) -> None:
        self._close()
        self.negotiated += 1
        self.responses.append(
            pb.Response(
                type=pb.RESPONSE_TYPE_JOIN,
                process_set_id=self.process_set.id,
                last_joined_rank=last_joined_rank,
            )
        )

    def allreduce(
        self,
        name: str,
        key: tuple[object, ...],
        nbytes: int,
        donor: pb.TensorRequest,
        fill: bool,
    ) -> None:
        self.negotiated += 1
        if (
            self._open is not None
            and key == self._open_key
            and self._open_bytes + nbytes <= self._threshold
        ):
            self._open.tensor_names.append(name)
            self._open_bytes += nbytes
            self._open_donors.append(donor)
            self._open_fill = self._open_fill or fill
            return
        self._close()
        response = pb.Response(
            type=pb.RESPONSE_TYPE_ALLREDUCE, tensor_names=[name], process_set_id=self.process_set.id
        )
        self.responses.append(response)
        # A tensor at or over the threshold goes alone; threshold 0 never fuses.
        if nbytes < self._threshold:
            self._open, self._open_key, self._open_bytes = response, key, nbytes
            self._open_donors = [donor]
            self._open_fill = fill
        elif fill:
            response.join_fill.append(donor)


class NegotiationTable:
    """Pending tensors of one generation of one job.

    Args:
        size: World size of the generation (process set 0 is ``range(size)``).
        fusion_threshold_bytes: Largest fused allreduce in bytes; 0 never fuses.
    """

    def __init__(self, size: int, fusion_threshold_bytes: int) -> None:
        self.size = size
        self.process_sets: dict[int, ProcessSet] = {0: ProcessSet(0, tuple(range(size)))}
        self.pending: dict[tuple[int, str], PendingTensor] = {}
        self.fusion_threshold_bytes = fusion_threshold_bytes
        # Rank -> its pending join request, in join order; empty outside hvd.join().
        self.joined: dict[int, pb.TensorRequest] = {}
        self.last_joined_rank = -1
        self._groups: dict[tuple[int, int], _Group] = {}
        # Process set id -> why its tensors can no longer complete (a rank left).
        self._broken_sets: dict[int, str] = {}
        # Ranks that left, and why (a set added later that holds one is broken at once).
        self._departed: dict[int, str] = {}
        # Ids removed in this generation, with their ranks: a late Add from a rank
        # that had not confirmed yet must not bring the set back.
        self._removed: dict[int, tuple[int, ...]] = {}

    # ---- process sets --------------------------------------------------------------

    def add_process_set(self, process_set_id: int, ranks: Sequence[int]) -> bool:
        """Registers set ``process_set_id``; idempotent for the same ranks.

        Returns:
            Whether this call registered it (False: an earlier call did, or
            it was removed already and this is a late confirmation).

        Raises:
            InvalidRequestError: id below 1; ranks empty, unsorted, repeated or
                outside ``[0, size)``; the id is (or was) registered with other ranks.
        """
        if process_set_id < 1:
            raise InvalidRequestError(
                f"process set id must be at least 1 (0 is the global set), got {process_set_id}"
            )
        ranks = tuple(ranks)
        shown = "[" + ", ".join(str(r) for r in ranks) + "]"
        if not ranks:
            raise InvalidRequestError(f"process set {process_set_id} has no ranks")
        if any(not 0 <= r < self.size for r in ranks):
            raise InvalidRequestError(
                f"process set {process_set_id} ranks {shown} must lie in [0, {self.size})"
            )
        if any(a >= b for a, b in zip(ranks, ranks[1:], strict=False)):
            raise InvalidRequestError(
                f"process set {process_set_id} ranks {shown} must be ascending and distinct"
            )
        known = self.process_sets.get(process_set_id)
        earlier = known.ranks if known is not None else self._removed.get(process_set_id)
        if earlier is not None:
            if earlier != ranks:
                was = "was removed in this generation" if known is None else "is registered"
                raise InvalidRequestError(
                    f"process set {process_set_id} {was} with ranks "
                    f"[{', '.join(str(r) for r in earlier)}], not {shown}"
                )
            return False
        pset = self.process_sets[process_set_id] = ProcessSet(process_set_id, ranks)
        for rank in ranks:
            reason = self._departed.get(rank)
            if reason is not None:
                self._broken_sets.setdefault(pset.id, reason)
                break
        return True

    def remove_process_set(self, process_set_id: int) -> dict[int, list[pb.Response]]:
        """Removes a set (idempotent); its pending tensors fail.

        Costs O(pending tensors); removal is rare.

        Returns:
            Error responses to send, by recipient rank: each pending tensor's
            to the ranks that submitted it.

        Raises:
            InvalidRequestError: ``process_set_id`` is 0 (the global set stays).
        """
        if process_set_id == 0:
            raise InvalidRequestError("process set 0 (the global set) cannot be removed")
        pset = self.process_sets.pop(process_set_id, None)
        if pset is None:
            return {}
        self._removed[process_set_id] = pset.ranks
        self._broken_sets.pop(process_set_id, None)
        out: dict[int, list[pb.Response]] = {}

        def fail(tensor: PendingTensor, recipients: Iterable[int]) -> None:
            response = _error(
                [tensor.name],
                pset.id,
                f"tensor '{tensor.name}': process set {pset.id} was removed",
            )
            for rank in recipients:
                out.setdefault(rank, []).append(response)

        for key in [k for k in self.pending if k[0] == pset.id]:
            tensor = self.pending.pop(key)
            fail(tensor, tensor.submissions)
        for gkey in [k for k in self._groups if k[0] == pset.id]:
            for tensor in self._groups.pop(gkey).held:
                fail(tensor, tensor.submissions)
        return out

    # ---- submissions ---------------------------------------------------------------

    def submit(self, rank: int, requests: Iterable[pb.TensorRequest], now: float) -> Outcome:
        """Records one message's requests from ``rank`` and answers what became ready."""
        ready: list[_Ready] = []
        outcome = Outcome()
        for req in requests:
            if req.op_type == pb.OP_TYPE_JOIN:
                self._join(rank, req, ready, outcome)
                continue
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
            if len(tensor.submissions) == len(pset.ranks) or (
                self.joined and self._complete_with_joined(tensor)
            ):
                del self.pending[key]
                self._became_ready(tensor, ready)
        outcome.errors += len(outcome.direct)
        if ready:
            self._respond(ready, outcome)
        return outcome

    def missing_ranks(self, tensor: PendingTensor) -> list[int]:
        """Ranks of the tensor's set that neither submitted it nor joined, ascending."""
        joined = self.joined
        return [
            r for r in tensor.process_set.ranks if r not in tensor.submissions and r not in joined
        ]

    def _complete_with_joined(self, tensor: PendingTensor) -> bool:
        """Whether every rank of the set that has not submitted has joined. O(joined ranks)."""
        waiting = len(tensor.process_set.ranks) - len(tensor.submissions)
        if waiting > len(self.joined):
            return False
        members, subs = tensor.process_set.members, tensor.submissions
        return waiting == sum(1 for r in self.joined if r in members and r not in subs)

    def _join(
        self, rank: int, req: pb.TensorRequest, ready: list[_Ready], outcome: Outcome
    ) -> None:
        """``rank`` joined: mark it, answer what it was the last one missing from.

        Costs O(pending tensors), once per rank per join.
        """
        if req.process_set_id != 0:
            outcome.direct.append(
                _error(
                    [req.name],
                    req.process_set_id,
                    f"tensor '{req.name}': join runs on process set 0 only, "
                    f"not process set {req.process_set_id}",
                )
            )
            return
        broken = self._broken_sets.get(0)
        if broken is not None:
            outcome.direct.append(
                _error(
                    [req.name],
                    0,
                    f"tensor '{req.name}' (join) cannot complete: {broken}",
                    pb.ERROR_KIND_RANK_GONE,
                )
            )
            return
        if rank in self.joined:
            outcome.direct.append(
                _error(
                    [req.name],
                    0,
                    f"tensor '{req.name}': rank {rank} submitted join twice (it joined as "
                    f"'{self.joined[rank].name}')",
                )
            )
            return
        self.joined[rank] = req
        self.last_joined_rank = rank
        for key, tensor in list(self.pending.items()):
            if (
                rank in tensor.process_set.members
                and rank not in tensor.submissions
                and self._complete_with_joined(tensor)
            ):
                del self.pending[key]
                self._became_ready(tensor, ready)
        if len(self.joined) == self.size:
            ready.append(_ReadyJoin(self.process_sets[0], rank))
            self.joined.clear()
            self.last_joined_rank = -1

    def _became_ready(self, tensor: PendingTensor, ready: list[_Ready]) -> None:
        first = tensor.first_request()
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
            elif isinstance(item, _ReadyJoin):
                builder.join(item.last_joined_rank)
            else:
                self._respond_tensor(item.tensor, builder)
        for builder in builders.values():
            responses = builder.finish()
            if responses:
                outcome.broadcasts.append(
                    (builder.process_set, pb.ResponseList(responses=responses))
                )
            for rank, targeted in builder.targeted.items():
                outcome.targeted.setdefault(rank, []).extend(targeted)
            outcome.negotiated += builder.negotiated
            outcome.errors += builder.errors

    @staticmethod
    def _respond_group(item: _ReadyGroup, builder: _Builder) -> None:
        names = [t.name for t in item.tensors]
        for tensor in item.tensors:
            invalid = invalid_calls(tensor)
            if invalid is not None:
                builder.error(names, invalid, pb.ERROR_KIND_INVALID)
                return
        for tensor in item.tensors:
            problem = validate(tensor)
            if problem is not None:
                builder.error(names, problem)
                return
        firsts = [t.first_request() for t in item.tensors]
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
        response = pb.Response(
            type=pb.RESPONSE_TYPE_ALLREDUCE,
            tensor_names=names,
            process_set_id=item.process_set.id,
        )
        set_size = len(item.process_set.ranks)
        if any(len(t.submissions) < set_size for t in item.tensors):
            response.join_fill.extend(firsts)
        builder.whole(response)

    @staticmethod
    def _respond_tensor(tensor: PendingTensor, builder: _Builder) -> None:
        invalid = invalid_calls(tensor)
        if invalid is not None:
            builder.error([tensor.name], invalid, pb.ERROR_KIND_INVALID)
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
        if op == pb.OP_TYPE_ALLREDUCE:
            builder.allreduce(
                tensor.name, _fusion_key(first, pset.id), request_nbytes(first), first, partial
            )
            return
        if partial:
            joined = format_ranks(tensor.missing_ranks())
            builder.error_to(
                tensor.submitters(),
                [tensor.name],
                f"tensor '{tensor.name}' ({_op_name(op)}) cannot run while rank(s) {joined} "
                "have joined: hvd.join() supports allreduce only",
            )
            return
        response = pb.Response(type=op, tensor_names=[tensor.name], process_set_id=pset.id)
        if op == pb.OP_TYPE_ALLGATHER:
            # By position in the set: entry i is the set's i-th rank (ascending global rank).
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

    # ---- departures ----------------------------------------------------------------

    def depart(self, rank: int, reason: str) -> dict[int, list[pb.Response]]:
        """A rank left for good: fail what waits on it and what will need it.

        Every pending tensor of a set containing ``rank`` that ``rank`` has not
        submitted can never complete; each rank that did submit it gets an
        error ``tensor 'NAME' cannot complete: REASON``. Later first
        submissions in those sets fail at once with the same text. Every
        other rank's pending join fails too (``tensor 'JOIN NAME' (join)
        cannot complete: REASON``), and the joined state is cleared.

        Returns:
            Error responses to send, by recipient rank.
        """
        out: dict[int, list[pb.Response]] = {}
        broken_groups: set[tuple[int, int]] = set()
        self._departed.setdefault(rank, reason)
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
        # Set 0 now holds a departed rank, so the world can never be all joined.
        for joiner, req in self.joined.items():
            if joiner != rank:
                out.setdefault(joiner, []).append(
                    _error(
                        [req.name],
                        0,
                        f"tensor '{req.name}' (join) cannot complete: {reason}",
                        pb.ERROR_KIND_RANK_GONE,
                    )
                )
        self.joined.clear()
        self.last_joined_rank = -1
        return out

    def clear(self) -> None:
        """Forgets every pending tensor and join (the generation ended)."""
        self.pending.clear()
        self._groups.clear()
        self.joined.clear()
        self.last_joined_rank = -1
