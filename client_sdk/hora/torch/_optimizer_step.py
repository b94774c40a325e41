"""A DistributedOptimizer's bookkeeping of one step: each parameter's slot, the
allreduces in flight, and the allgathers of sparse gradients (see :mod:`.optimizer`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..errors import HoraError
from ..world import ProcessSet, take, wait
from .mpi_ops import allgather_async

__all__ = ["HANDOVER_BYTES", "_HANDED_OVER", "_Pending", "_Slot", "_complete_sparse",
           "_gather_sparse", "_wait_out"]

# The gradient hooks hand the engine their gradients in batches: a hook
# notes its gradient, and once the noted gradients hold HANDOVER_BYTES they
# are submitted together (what is left, at synchronize()). One submission
# between two layers' backward kernels found the interpreter cold and cost
# about 45 µs on the 2-core machine of bench/README.md, against about 10 in a
# batch; and fewer, larger bursts of submissions leave the engine's
# background rounds fewer chances to run beside the backward pass. A model's
# gradients still start while backward runs, every HANDOVER_BYTES. A batch
# reaches the engine in one call (one lock round, and one wait at
# synchronize()), each gradient still its own allreduce under its own name.
# Gradients that all fit under it go as one allreduce from each world's
# second step on (:mod:`._fused`).
HANDOVER_BYTES = 4 << 20


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


def _gather_sparse(p: torch.Tensor, name: str, process_set: ProcessSet) -> _Pending:
    """Starts gathering every rank's nonzeros of ``p``'s sparse gradient: they
    differ from rank to rank, so indices and values are gathered instead of a
    dense tensor reduced."""
    if p.grad is None:
        # Unused in this pass: no rows to contribute, the same calls as the others.
        p.grad = torch.sparse_coo_tensor(
            torch.empty(1, 0, dtype=torch.int64, device=p.device),
            p.new_empty(0, *p.shape[1:]), p.shape, check_invariants=False)
    grad = p.grad.coalesce()
    # Horovod's names: the allgathers of <parameter>.values and .indices.
    values = take(allgather_async(grad._values(), name=f"{name}.values",
                                  process_set=process_set))
    indices = take(allgather_async(grad._indices().t().contiguous(), name=f"{name}.indices",
                                   process_set=process_set))
    return _Pending([p], (values, indices), [None], [], sparse=True)


def _complete_sparse(pending: _Pending, average: bool, set_size: int) -> None:
    """Waits for a sparse gradient's allgathers and makes it the ranks' sum
    (or average) again."""
    p = pending.params[0]
    values = wait(pending.handle[0])
    indices = wait(pending.handle[1])
    if average:
        values = values / set_size
    assert p.grad is not None
    p.grad = torch.sparse_coo_tensor(indices.t(), values, p.grad.shape,
                                     check_invariants=False).coalesce()


def _wait_out(pendings: list[_Pending]) -> None:
    """After a failed ``synchronize()``: waits for every collective of the step
    (each an engine handle, which a second wait answers at once), so that no
    name is still in flight when the next step submits it again, and nothing
    writes a gradient after the step is forgotten. Their errors are the step's,
    already raised."""
    for pending in pendings:
        for handle in pending.handle if pending.sparse else (pending.handle,):
            with contextlib.suppress(HoraError):
                wait(handle)
