"""Operation kinds shared by the engine and the framework layers.

The numeric values are the wire values of ``hora.v1`` (negotiation.proto),
so a request is built without translation tables.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["OpType", "ReduceOp", "dtype_name", "split_rows"]


class ReduceOp(enum.IntEnum):
    """Reductions offered to users (``hvd.Average``, ``hvd.Sum``, ...)."""

    AVERAGE = 1
    SUM = 2
    ADASUM = 3
    MIN = 4
    MAX = 5
    PRODUCT = 6


class OpType(enum.IntEnum):
    """Collectives the engine negotiates."""

    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    JOIN = 7


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
