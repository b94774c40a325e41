"""The differentiable collectives: Horovod's synchronous forms, with Horovod's gradients.

- allreduce: the same allreduce (op and scale factors) of the incoming gradient;
- broadcast: the average of the incoming gradients at the root, zeros elsewhere;
- allgather: the average of the incoming gradients, of which each rank takes
  its own rows;
- reducescatter: the allgather of the incoming gradients, times the set's
  size for Sum, times the prescale and postscale factors;
- alltoall: the gradients go back to the ranks their rows came from;
- grouped calls: the same rules, as one group.

Invalid arguments are left to the ``*_async`` forms in :mod:`._collectives`,
which make them fail on every rank of the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._ops import ReduceOp
from ..world import ProcessSet, global_process_set, rank, synchronize
from ._collectives import (
    _reducescatter_async,
    allgather_async,
    allreduce_,
    allreduce_waited,
    alltoall_async,
    broadcast_async,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
)
from ._validation import _op, _scale_factors, _tensor, _tensors

__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather",
           "grouped_allreduce", "grouped_reducescatter", "reducescatter"]


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                pre: float, post: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return allreduce_waited(tensor, name, op, pre, post, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce_waited(grad.contiguous(), None, ctx.op, ctx.pre, ctx.post,
                                   ctx.process_set)
        return reduced, None, None, None, None, None


def _compressed(compression: Any, tensors: list[torch.Tensor],
                run: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    if compression is None:
        return run(tensors)
    pairs = [compression.compress(t) for t in tensors]
    outputs = run([wire for wire, _ctx in pairs])
    return [compression.decompress(out, ctx) for out, (_wire, ctx) in zip(outputs, pairs,
                                                                          strict=True)]


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = None, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns the reduction of ``tensor`` over all ranks (differentiable).

    Args:
        tensor: the tensor to reduce; every rank passes the same shape and dtype.
        name: a name unique among in-flight operations; generated when omitted.
        compression: ``hvd.Compression.none`` (default) or ``fp16``/``bf16``.
        op: ``hvd.Average`` (default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after the reduction.
    """
    resolved, problem = _op(op, average)
    if problem is not None:  # fails on every rank of the call
        return allreduce_(_tensor(tensor).detach().clone(), average, name, op,
                          prescale_factor, postscale_factor, process_set)
    pre, post = _scale_factors(prescale_factor, postscale_factor)
    return _compressed(compression, [_tensor(tensor)], lambda wire: [_AllreduceFunction.apply(
        wire[0], name, resolved, pre, post, process_set)])[0]


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre,
                                                         post, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], None,
                                                      None, ctx.op, ctx.pre, ctx.post,
                                                      ctx.process_set))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = None,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduces several tensors as one negotiated, fused group (differentiable)."""
    resolved, problem = _op(op, average)
    if problem is not None:  # fails on every rank of the call
        return grouped_allreduce_([t.detach().clone() for t in
                                   _tensors(tensors, "grouped_allreduce")], average, name, op,
                                  prescale_factor, postscale_factor, process_set)
    pre, post = _scale_factors(prescale_factor, postscale_factor)
    return _compressed(compression, _tensors(tensors, "grouped_allreduce"), lambda wire: list(
        _GroupedAllreduceFunction.apply(name, resolved, pre, post, process_set, *wire)))


class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, single: bool,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        if single:
            return (synchronize(allgather_async(tensors[0], name, process_set)),)
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        process_set = ctx.process_set
        averaged = synchronize(grouped_allreduce_async([g.contiguous() for g in grads],
                                                       op=ReduceOp.AVERAGE,
                                                       process_set=process_set))
        rows = [shape[0] if len(shape) else 1 for shape in ctx.shapes]
        counts = synchronize(allgather_async(torch.tensor([rows]), process_set=process_set))
        offsets = counts[: process_set.rank()].sum(dim=0) if process_set.rank() else \
            torch.zeros(len(rows), dtype=torch.int64)
        return (None, None, None, *[g.narrow(0, int(offsets[i]), rows[i]).reshape(ctx.shapes[i])
                                    for i, g in enumerate(averaged)])


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along dim 0; first dimensions may differ."""
    return _GroupedAllgatherFunction.apply(name, process_set, True, _tensor(tensor))[0]


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgathers several tensors as one call (differentiable)."""
    return list(_GroupedAllgatherFunction.apply(name, process_set, False,
                                                *_tensors(tensors, "grouped_allgather")))


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        averaged = allreduce_waited(grad.contiguous(), None, ReduceOp.AVERAGE, 1.0, 1.0,
                                    ctx.process_set)
        if rank() != int(ctx.root_rank):
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns the root rank's ``tensor`` on every rank (differentiable)."""
    return _BroadcastFunction.apply(_tensor(tensor), root_rank, name, process_set)


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.process_set = process_set
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple[Any, ...]:
        grad_in, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received,
                                                process_set=ctx.process_set))
        return grad_in, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Exchanges slices of ``tensor`` between all ranks (differentiable).

    Returns:
        The gathered tensor; with ``splits`` given, a pair ``(tensor,
        received_splits)`` where ``received_splits[r]`` rows came from rank r.
    """
    output, received = _AlltoallFunction.apply(_tensor(tensor), splits, name, process_set)
    return output if splits is None else (output, received)


class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, process_set: ProcessSet, pre: float,
                post: float, single: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.process_set, ctx.scale = op, process_set, pre * post
        result = synchronize(_reducescatter_async(list(tensors), name, op, process_set, pre,
                                                  post, single))
        return (result,) if single else tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads],
                                                       process_set=ctx.process_set))
        scale = ctx.scale * (ctx.process_set.size() if ctx.op == ReduceOp.SUM else 1)
        return (None, None, None, None, None, None, *[g * scale for g in gathered])


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None,
                  op: ReduceOp | None = None,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces ``tensor`` over all ranks and returns this rank's rows (differentiable).

    Rank r receives ``split_rows(n, size)[r]`` rows: the first ``n % size``
    ranks get one extra row.
    """
    return _reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                          postscale_factor, single=True)[0]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = None, op: ReduceOp | None = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatters several tensors as one call (differentiable)."""
    return _reducescatter(tensors, name, compression, op, process_set, prescale_factor,
                          postscale_factor, single=False)


def _reducescatter(tensors: Sequence[torch.Tensor], name: str | None, compression: Any,
                   op: Any, process_set: ProcessSet, prescale_factor: float,
                   postscale_factor: float, single: bool) -> list[torch.Tensor]:
    resolved, problem = _op(op, None)
    if problem is not None:  # fails on every rank of the call
        result = synchronize(_reducescatter_async(tensors, name, op, process_set,
                                                  prescale_factor, postscale_factor, single))
        return [result] if single else result
    pre, post = _scale_factors(prescale_factor, postscale_factor)
    call = "reducescatter" if single else "grouped_reducescatter"
    return _compressed(compression, _tensors(tensors, call), lambda wire: list(
        _GroupedReducescatterFunction.apply(name, resolved, process_set, pre, post, single,
                                            *wire)))
