"""The negotiation's messages, as plain data: no protobuf in here.

Each class is the twin of a ``hora.v1`` message (``proto/hora/v1/negotiation.proto``)
with the same field names, so the .proto's documentation of a field holds for
its twin, and each enum has the .proto's member names (without the prefix)
and numbers (tests/coordinator/test_wire.py checks both against the
descriptors). :mod:`.wire` converts them to the generated messages.

A tensor request's fields are declared once, in :class:`PlainTensorRequest`.
The table reads requests as :data:`TensorRequest`: that dataclass or the
``hora.v1.TensorRequest`` message as it arrived. Copying every request of
every step into a dataclass would about double the cost of the hot path
(about 2.8 us per request, against about 2.6 us to negotiate it), and the
table only reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from hora_proto.v1 import negotiation_pb2

__all__ = [
    "ErrorKind",
    "OpType",
    "PlainTensorRequest",
    "ReceivedLists",
    "ReduceOp",
    "Response",
    "ResponseList",
    "ResponseType",
    "TensorRequest",
]


class OpType(enum.IntEnum):
    """The collective a tensor request asks for (``hora.v1.OpType``)."""

    UNSPECIFIED = 0
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    JOIN = 7


class ReduceOp(enum.IntEnum):
    """How an allreduce combines values (``hora.v1.ReduceOp``)."""

    UNSPECIFIED = 0
    AVERAGE = 1
    SUM = 2
    ADASUM = 3
    MIN = 4
    MAX = 5
    PRODUCT = 6


class ResponseType(enum.IntEnum):
    """What a response tells the ranks to do (``hora.v1.ResponseType``).

    The six collectives share their numbers with :class:`OpType`.
    """

    UNSPECIFIED = 0
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    ERROR = 7
    JOIN = 8


class ErrorKind(enum.IntEnum):
    """Why an error response failed its tensors (``hora.v1.ErrorKind``)."""

    UNSPECIFIED = 0
    MISMATCH = 1
    RANK_GONE = 2
    INVALID = 3


@dataclass(frozen=True)
class PlainTensorRequest:
    """A :class:`TensorRequest` as a plain dataclass (``hora.v1.TensorRequest``'s fields)."""

    name: str = ""
    op_type: int = OpType.UNSPECIFIED
    dtype: str = ""
    shape: tuple[int, ...] = ()
    device: str = ""
    reduce_op: int = ReduceOp.UNSPECIFIED
    root_rank: int = 0
    prescale_factor: float = 0.0
    postscale_factor: float = 0.0
    process_set_id: int = 0
    splits: tuple[int, ...] = ()
    group_id: int = 0
    group_size: int = 0
    invalid: str = ""
    resent: bool = False
    received_list: int = 0


#: What the table reads of one rank's request for one tensor: the dataclass,
#: or the message as it arrived (same field names, checked by test_wire).
TensorRequest: TypeAlias = "PlainTensorRequest | negotiation_pb2.TensorRequest"


@dataclass(frozen=True)
class Response:
    """What the ranks of a process set run next, or why they cannot (``hora.v1.Response``).

    Attributes:
        type: The collective, ERROR or JOIN.
        tensor_names: The tensors it covers, in fusion order.
        process_set_id: The set it runs on.
        first_dims: Allgather only: each set rank's first dimension, in set order.
        splits: Alltoall only: the sender-major split matrix.
        error_message: ERROR only: the text every recipient raises.
        error_kind: ERROR only: why.
        join_fill: Allreduces that some joined rank never submitted: the
            request of a rank that did, per name, in name order.
        last_joined_rank: JOIN only: the rank that joined last.
    """

    type: ResponseType
    tensor_names: tuple[str, ...] = ()
    process_set_id: int = 0
    first_dims: tuple[int, ...] = ()
    splits: tuple[int, ...] = ()
    error_message: str = ""
    error_kind: ErrorKind = ErrorKind.UNSPECIFIED
    join_fill: tuple[TensorRequest, ...] = ()
    last_joined_rank: int = 0


@dataclass(frozen=True)
class ResponseList:
    """Responses every recipient runs in this order (``hora.v1.ResponseList``).

    ``number`` counts the lists sent to every rank of one process set, per set
    and generation, from 1; 0 on a list for one rank only.
    """

    responses: tuple[Response, ...] = ()
    number: int = 0


@dataclass(frozen=True)
class ReceivedLists:
    """What a worker opening its stream again has received of one process set
    (``hora.v1.ReceivedLists``): the last list's number and the newest lists."""

    process_set_id: int
    last_number: int
    recent: tuple[ResponseList, ...] = ()
