"""Checks of a collective's arguments on this rank, before it is submitted.

A wrong *type* raises at once (:class:`InvalidTypeError`); any other
problem is returned as a reason, and the call goes to the negotiation
marked invalid, so that every rank of the call fails alike (see
:mod:`._collectives`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from hora_native import BackendError, backend_for_device

from .._ops import ReduceOp
from ..errors import InvalidCallError, InvalidTypeError
from ..world import ProcessSet, size

# Element types every reduction takes (bool as logic: Sum is or, Product and).
# Collectives that only move data take every dtype: they move bytes.
_REDUCIBLE = frozenset({
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.bool})
_BOOL = torch.bool
_ADASUM = ReduceOp.ADASUM
_SCATTER_OPS = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


def _tensor(tensor: Any, what: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise InvalidTypeError(f"{what} is sparse: use hvd.sparse_allreduce_async (or "
                               f"allgather its indices and values, or sparse_as_dense=True)")
    return tensor


def _tensors(tensors: Any, call: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise InvalidTypeError(f"{call} takes a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise InvalidCallError(f"{call} needs at least one tensor")
    return [_tensor(t, f"{call}'s tensor {i}") for i, t in enumerate(tensors)]


# Devices a backend was found for: a backend, once there, stays (the check
# costs more than the rest of a small allreduce's submission, and looking up
# a device costs less than asking its type).
_SERVED: set[torch.device] = set()


def _device_problem(tensor: torch.Tensor) -> str | None:
    device = tensor.device
    if device in _SERVED:
        return None
    try:
        backend_for_device(device.type)
    except BackendError as exc:
        return str(exc)
    _SERVED.add(device)
    return None


def _op(op: Any, average: bool | None) -> tuple[ReduceOp, str | None]:
    """The reduction asked for, and what is wrong with the request (SUM stands in then)."""
    if op is not None and average is not None:
        return ReduceOp.SUM, "pass either op= or the deprecated average=, not both"
    if average is not None:
        warnings.warn("average= is deprecated; use op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=3)
        return (ReduceOp.AVERAGE if average else ReduceOp.SUM), None
    if op is None:
        return ReduceOp.AVERAGE, None
    if type(op) is ReduceOp:
        return op, None
    try:
        return ReduceOp(op), None
    except ValueError:
        return ReduceOp.SUM, f"op {op!r} is not one of hvd.Average, Sum, Adasum, Min, Max, Product"


def _reduction_problem(tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                       call: str) -> str | None:
    problem = _device_problem(tensor)
    if problem is not None:
        return problem
    dtype = tensor.dtype
    if dtype not in _REDUCIBLE:
        return f"{call} cannot reduce {dtype}"
    if dtype is _BOOL and (op in (ReduceOp.AVERAGE, ReduceOp.ADASUM)
                           or pre != 1.0 or post != 1.0):
        return (f"{call} of a bool tensor takes op Sum (or), Min, Max or Product, without "
                f"scale factors; got op {op.name} with factors {pre} and {post}")
    if op is _ADASUM and not tensor.is_floating_point():
        return f"op=hvd.Adasum needs a floating point tensor, got {tensor.dtype}"
    return None


def _scale_factors(prescale_factor: Any, postscale_factor: Any) -> tuple[float, float]:
    try:
        return float(prescale_factor), float(postscale_factor)
    except (TypeError, ValueError):
        raise InvalidTypeError(f"prescale_factor and postscale_factor must be numbers, got "
                               f"{prescale_factor!r} and {postscale_factor!r}") from None


def _root(root_rank: Any, process_set: ProcessSet) -> tuple[int, str | None]:
    try:
        root = int(root_rank)
    except (TypeError, ValueError):
        raise InvalidTypeError(f"root_rank must be an integer, got {root_rank!r}") from None
    if not 0 <= root < size():
        return 0, f"root_rank {root} is outside the world of size {size()}"
    if process_set.ranks is not None and root not in process_set.ranks:
        return 0, f"root_rank {root} is not in {process_set}"
    return root, None


def _splits(tensor: torch.Tensor, splits: Any, world: int) -> tuple[list[int], str | None]:
    if tensor.dim() == 0:
        return [], "alltoall needs a tensor with at least one dimension"
    rows = tensor.shape[0]
    if splits is None:
        if rows % world:
            return [], (f"alltoall without splits needs a first dimension divisible by the "
                        f"process set size {world}, got {rows}")
        return [rows // world] * world, None
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            return [], f"alltoall splits must be integers, got a {splits.dtype} tensor"
        values = splits.reshape(-1).tolist()
    else:
        try:
            values = list(splits)
        except TypeError:
            raise InvalidTypeError(f"alltoall splits must be a list or tensor of integers, "
                                   f"got {type(splits).__name__}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return [], f"alltoall splits must be integers, got {values}"
    if len(values) != world or any(v < 0 for v in values) or sum(values) != rows:
        return [], (f"alltoall splits {values} must have {world} non-negative entries summing "
                    f"to the first dimension {rows}")
    return values, None


def _reducescatter_problem(tensor: torch.Tensor, op: ReduceOp, pre: float,
                           post: float) -> str | None:
    if tensor.dim() == 0:
        return "reducescatter needs a tensor with at least one dimension"
    if op not in _SCATTER_OPS:
        return f"reducescatter does not support op {op.name}"
    return _reduction_problem(tensor, op, pre, post, "reducescatter")
