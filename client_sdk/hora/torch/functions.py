"""Helpers that put every rank in the same state: parameters, optimizer state, objects."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import cloudpickle
import torch

from .. import _runtime
from .mpi_ops import (
    ProcessSet,
    allgather,
    broadcast_,
    broadcast_async_,
    global_process_set,
    rank,
    synchronize,
)

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, Any]],
                         root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrites every rank's tensors with the root rank's, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: the rank whose values everyone takes.
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = list(params)
    handles = []
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(value).__name__}, "
                            f"not a tensor; use broadcast_object for other values")
        handles.append(broadcast_async_(value.detach(), root_rank, name=f"broadcast.{name}",
                                        process_set=process_set))
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Makes every rank's optimizer state (hyperparameters and buffers) equal the root's.

    Works for every optimizer whose ``state_dict``/``load_state_dict`` round
    trip, which is all of ``torch.optim``: the root's state dict, including
    tensors, scalars (with their types) and param groups, is broadcast and
    loaded elsewhere.

    As in Horovod, an optimizer that has not stepped yet first gets its
    state made, on every rank, by one local step of the wrapped optimizer on
    zero gradients (sparse ones for SparseAdam and for the sparse
    ``nn.Embedding`` parameters of ``model``); those zero gradients stay in
    ``p.grad`` afterwards. Parameters with ``requires_grad=False`` are left
    alone.

    Args:
        optimizer: a ``torch.optim`` optimizer, plain or from ``DistributedOptimizer``.
        root_rank: the rank whose state everyone takes.
        model: optional; its sparse embeddings get sparse zero gradients.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support LBFGS (it keeps "
                         "closures and per-step history that cannot be broadcast)")
    if not optimizer.state_dict()["state"]:
        _make_state(optimizer, model)
    state = optimizer.state_dict() if rank() == root_rank else None
    state = broadcast_object(state, root_rank, name="broadcast_optimizer_state",
                             process_set=process_set)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


def _make_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """One local step on zero gradients, so that a new optimizer has state to broadcast."""
    sparse = set()
    if model is not None:
        sparse = {id(p) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if all_sparse or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
    # A DistributedOptimizer's own step() would allreduce, and only this rank
    # is here: step the optimizer it wraps.
    step = getattr(optimizer, "_local_step", optimizer.step)
    step()


def _dumps(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _loads(tensor: torch.Tensor) -> Any:
    return cloudpickle.loads(tensor.numpy().tobytes())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns the root rank's ``obj`` on every rank (pickled with cloudpickle)."""
    name = name or _runtime.current().auto_name("broadcast_object")
    if rank() == root_rank:
        payload = _dumps(obj)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, name=f"{name}.size", process_set=process_set)
    if rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if rank() == root_rank else _loads(payload)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Returns the list of every rank's ``obj``, in rank order."""
    name = name or _runtime.current().auto_name("allgather_object")
    payload = _dumps(obj)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64),
                      name=f"{name}.sizes", process_set=process_set)
    data = allgather(payload, name=f"{name}.data", process_set=process_set)
    return [_loads(part) for part in data.split(sizes.tolist())]
