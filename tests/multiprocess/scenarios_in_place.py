"""In-place collectives on tensors a collective writes with care: leaves that
require grad, and tensors torch cannot write (see test_collectives.py)."""

from __future__ import annotations

import os
import sys
import time

import torch

import hora.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenarios import make_input  # noqa: E402 - beside this file


def in_place_on_leaves():
    """In-place collectives on leaves that require grad, as Horovod runs them
    (its C++ writes their memory outside autograd), then a plain allreduce."""
    rank = hvd.rank()
    out = {}
    for op_name in ("Average", "Sum", "Max"):
        w = make_input(rank, torch.float32, (3, 4)).requires_grad_()
        returned = hvd.allreduce_(w, name=f"leaf.{op_name}", op=getattr(hvd, op_name))
        out[op_name] = (returned is w, w.detach().clone(), w.is_leaf, w.requires_grad)
    a = make_input(rank, torch.float64, (5,)).requires_grad_()
    b = make_input(rank, torch.float64, (2, 2), salt=1).requires_grad_()
    hvd.grouped_allreduce_([a, b], name="leaf.group", op=hvd.Sum)
    out["group"] = [a.detach().clone(), b.detach().clone()]
    c = make_input(rank, torch.float32, (6,), salt=2).requires_grad_()
    out["async"] = hvd.synchronize(hvd.allreduce_async_(c, name="leaf.async")).detach().clone()
    d = make_input(rank, torch.float32, (4,), salt=3).requires_grad_()
    hvd.broadcast_(d, root_rank=1, name="leaf.broadcast")
    out["broadcast"] = d.detach().clone()
    (w * 2).sum().backward()  # autograd still works on the leaf
    out["grad"] = w.grad
    out["after"] = hvd.allreduce(torch.ones(3), name="leaf.after", op=hvd.Sum)
    return out


def _error_of(wait) -> str | tuple[bool, str]:
    """The InvalidCallError ``wait()`` raises: whether it is a ValueError, and its text."""
    try:
        wait()
    except hvd.InvalidCallError as exc:
        return isinstance(exc, ValueError), str(exc)
    return "no error"


def in_place_on_shared_memory_elements():
    """In-place collectives on an expand()ed tensor, which torch cannot write,
    fail as invalid calls on every rank (Horovod refuses any non-contiguous
    tensor the same way, with a ValueError); then a tensor changed while its
    allreduce was in flight fails that call alone. After each, a plain allreduce."""
    rank = hvd.rank()
    out = {}
    calls = {
        "allreduce_": lambda t: hvd.allreduce_(t, name="shared.allreduce", op=hvd.Sum),
        "broadcast_": lambda t: hvd.broadcast_(t, root_rank=0, name="shared.broadcast"),
        "grouped_allreduce_": lambda t: hvd.grouped_allreduce_(
            [torch.ones(2), t], name="shared.group", op=hvd.Sum),
    }
    for call, run in calls.items():
        out[call] = _error_of(lambda run=run: run(torch.ones(1).expand(4)))
        out[f"{call}.after"] = hvd.allreduce(torch.ones(2), name=f"after.{call}", op=hvd.Sum)
    # Out of place, an expanded tensor is only read.
    out["allreduce"] = hvd.allreduce(torch.ones(1).expand(4) * (rank + 1), op=hvd.Sum,
                                     name="shared.oop")
    # Rank 0 comes late, so rank 1's allreduce is still in flight when it
    # resizes the tensor the result is to be copied back into.
    if rank == 0:
        time.sleep(0.5)
    t = torch.arange(8.0)[::2]  # not contiguous: the result is copied back into it
    handle = hvd.allreduce_async_(t, name="shared.resized", op=hvd.Sum)
    t.set_(torch.zeros(3))
    out["resized"] = _error_of(lambda: hvd.synchronize(handle))
    out["resized.after"] = hvd.allreduce(torch.ones(2), name="after.resized", op=hvd.Sum)
    # The same beside another tensor of the same round (fused with it): that one completes.
    if rank == 0:
        time.sleep(0.5)
    a, b = torch.arange(8.0)[::2], torch.ones(3)
    handles = [hvd.allreduce_async_(a, name="shared.fused.a", op=hvd.Sum),
               hvd.allreduce_async_(b, name="shared.fused.b", op=hvd.Sum)]
    a.set_(torch.zeros(3))
    out["fused.resized"] = _error_of(lambda: hvd.synchronize(handles[0]))
    out["fused.other"] = hvd.synchronize(handles[1])
    out["fused.after"] = hvd.allreduce(torch.ones(2), name="after.fused", op=hvd.Sum)
    return out
