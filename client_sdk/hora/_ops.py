"""Operation kinds shared by the engine and the framework layers.

The members take their values from the contract's enums (negotiation.proto),
so a request is built without translation tables.
"""

from __future__ import annotations

import enum

import torch

from hora_proto.v1 import negotiation_pb2 as _pb

__all__ = ["OpType", "ReduceOp", "dtype_name", "split_rows"]


class ReduceOp(enum.IntEnum):
    """Reductions offered to users (``hvd.Average``, ``hvd.Sum``, ...)."""

    AVERAGE = _pb.REDUCE_OP_AVERAGE
    SUM = _pb.REDUCE_OP_SUM
    ADASUM = _pb.REDUCE_OP_ADASUM
    MIN = _pb.REDUCE_OP_MIN
    MAX = _pb.REDUCE_OP_MAX
    PRODUCT = _pb.REDUCE_OP_PRODUCT


class OpType(enum.IntEnum):
    """Collectives the engine negotiates."""

    ALLREDUCE = _pb.OP_TYPE_ALLREDUCE
    ALLGATHER = _pb.OP_TYPE_ALLGATHER
    BROADCAST = _pb.OP_TYPE_BROADCAST
    ALLTOALL = _pb.OP_TYPE_ALLTOALL
    REDUCESCATTER = _pb.OP_TYPE_REDUCESCATTER
    BARRIER = _pb.OP_TYPE_BARRIER
    JOIN = _pb.OP_TYPE_JOIN


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype: ``torch.float32`` -> ``"float32"``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def split_rows(rows: int, parts: int) -> list[int]:
    """How reducescatter splits ``rows`` over ``parts`` ranks: earlier ranks get the remainder."""
    base, extra = divmod(rows, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]
