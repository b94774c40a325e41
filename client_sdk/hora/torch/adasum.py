"""Adasum over ranks: :func:`adasum_allreduce`, and the rule itself (see :mod:`._adasum_rule`)."""

from __future__ import annotations

from typing import Any

import torch

from ..world import global_process_set
from ._adasum_rule import adasum_pair, adasum_reduce
from ._autograd import allgather

__all__ = ["adasum_allreduce", "adasum_pair", "adasum_reduce"]


def adasum_allreduce(tensor: torch.Tensor, name: str | None = None,
                     process_set: Any = None) -> torch.Tensor:
    """Returns the Adasum combination of every rank's ``tensor``; every rank calls it.

    Every rank's tensor is gathered (flattened to one row) with ``allgather``,
    and each rank then runs :func:`adasum_reduce` over the rows in rank order.
    All ranks run the same float64 arithmetic on the same rows in the same
    order, so every rank gets the same result bit for bit.

    This gathers the whole tensor from every rank, so it needs ``size()`` times
    the tensor's memory on each rank. Horovod's recursive halving does not;
    this is the simple, exact version.

    Args:
        tensor: a floating point tensor of the same shape and dtype on every rank.
        name: the name of the allgather, identical on every rank; generated when
            omitted.
        process_set: the process set to reduce over (the global set by default).

    Returns:
        The combination, with ``tensor``'s shape and dtype.

    Raises:
        TypeError: ``tensor`` is not floating point.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError("adasum_allreduce needs a floating point torch.Tensor")
    if process_set is None:
        process_set = global_process_set
    rows = allgather(tensor.reshape(1, -1), name=name, process_set=process_set)
    return adasum_reduce(list(rows.unbind(0))).reshape(tensor.shape)
