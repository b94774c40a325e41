"""A DistributedOptimizer's bookkeeping of one step: each parameter's slot and
the allreduces in flight (see :mod:`.optimizer`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["_HANDED_OVER", "_Pending", "_Slot"]


class _Pending:
    """An allreduce in flight for one parameter or one group of parameters."""

    __slots__ = ("params", "handle", "ctxs", "wire", "sparse")

    def __init__(self, params: list[torch.Tensor], handle: Any, ctxs: list[Any],
                 wire: list[torch.Tensor], sparse: bool = False) -> None:
        self.params = params
        self.handle = handle
        self.ctxs = ctxs
        self.wire = wire
        self.sparse = sparse


class _Slot:
    """One parameter's state in a step, reached from its gradient hook without a
    lookup keyed by the tensor (a tensor's hash is a Python call)."""

    __slots__ = ("param", "group", "wire_name", "nbytes", "delay", "pending")

    def __init__(self, param: torch.Tensor, group: int, name: str, delay: int) -> None:
        self.param = param
        self.group = group
        self.wire_name = f"allreduce.{name}"
        self.nbytes = param.numel() * param.element_size()  # of a dense gradient
        self.delay = delay  # backward passes left before the allreduce
        # The allreduce in flight this step (_HANDED_OVER: noted by the hook,
        # not submitted yet).
        self.pending: _Pending | None = None


# What a slot's ``pending`` holds from its hook to the submission of its batch.
_HANDED_OVER = _Pending([], None, [], [])
