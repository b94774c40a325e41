"""Collectives on torch tensors: Horovod's signatures, semantics and gradients.

Every ``*_async`` function returns an integer handle (see :mod:`hora.world`).

Errors (the tree is drawn in :mod:`hora.errors`):

- A wrong *type* of argument (not a tensor, a process set that was never
  added) raises :class:`InvalidTypeError` / :class:`InvalidCallError` at
  once, before the call takes a name, so the ranks' automatic names stay in
  step when every rank makes the same mistake.
- Any other invalid argument (a 0-d tensor for reducescatter, a root rank
  outside the set, bad splits, an op the dtype cannot take) still goes to
  the negotiation, marked invalid with the reason. Every rank of the call
  then gets :class:`InvalidCallError` naming the ranks that were wrong, so a
  call that is wrong on one rank never leaves the others waiting. Nothing
  reaches the data plane, and the next collective works.
- Ranks that disagree (shapes, dtypes, ops, root ranks) get
  :class:`TensorMismatchError` from the coordinator, for that call only.

The differentiable forms and their gradients are in :mod:`._autograd`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

from .. import _runtime
from .._ops import OpType, ReduceOp
from ..engine import Entry, Handle
from ..errors import InvalidTypeError
from ..world import (
    ProcessSet,
    check_process_set,
    global_process_set,
    register,
    synchronize,
)
from ._adasum_rule import adasum_reduce
from ._submission import (
    _enqueue,
    _Group,
    _in_place,
    _name,
    _own_copy,
    _submit,
    _submit_all,
    _unwritable,
)
from ._validation import (
    _device_problem,
    _op,
    _reducescatter_problem,
    _reduction_problem,
    _root,
    _scale_factors,
    _splits,
    _tensor,
    _tensors,
)

__all__ = [
    "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather_async", "grouped_allgather_async",
    "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall_async", "reducescatter_async",
    "grouped_reducescatter_async", "sparse_allreduce_async",
    "barrier", "join", "start_timeline", "stop_timeline",
]

# -- allreduce ---------------------------------------------------------------------


def _allreduce_entry(tensor: torch.Tensor, name: str, op: ReduceOp, pre: float, post: float,
                     set_id: int, group_id: int = 0, group_size: int = 0,
                     waited: bool = False) -> Entry:
    buffer, result = _in_place(tensor)
    return Entry(name=name, op_type=OpType.ALLREDUCE, buffer=buffer, handle=Handle(name),
                 reduce_op=op, prescale_factor=pre, postscale_factor=post,
                 process_set_id=set_id, group_id=group_id, group_size=group_size,
                 result=result, waited=waited)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Starts an in-place allreduce of ``tensor``; returns a handle."""
    return _allreduce_start(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, waited=False)


def _allreduce_start(tensor: torch.Tensor, average: bool | None, name: str | None,
                     op: ReduceOp | None, prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet, waited: bool) -> int:
    """allreduce_async_; ``waited``: the caller synchronizes on the handle at once."""
    tensor = _tensor(tensor)
    set_id = check_process_set(process_set)
    # Every small allreduce passes here: the checks' usual answers are spelled
    # out, and the helpers run for anything else.
    if type(prescale_factor) is float and type(postscale_factor) is float:
        pre, post = prescale_factor, postscale_factor
    else:
        pre, post = _scale_factors(prescale_factor, postscale_factor)
    problem: str | None = None
    if average is not None or type(op) is not ReduceOp:
        op, problem = _op(op, average)
    problem = problem or _reduction_problem(tensor, op, pre, post, "allreduce")
    if problem is None and not tensor.is_contiguous():
        problem = _unwritable(tensor)
    if type(name) is not str or not name:
        name = _name(name, "allreduce", set_id)
    if op is ReduceOp.ADASUM and problem is None:
        return _adasum_async_(tensor, name, pre, post, set_id)
    return register(_enqueue(_allreduce_entry(tensor, name, op, pre, post, set_id,
                                              waited=waited), problem))


def allreduce_gradient_async_(tensor: torch.Tensor, name: str, op: ReduceOp, pre: float,
                              post: float, process_set: ProcessSet) -> Handle:
    """A DistributedOptimizer's in-place allreduce of one gradient: the checks of
    :func:`allreduce_async_` whose answers can change, and the engine's handle
    itself (waited with :func:`hora.world.wait`), not an integer one.

    ``op`` is Average or Sum and the factors are numbers (the optimizer checked
    them once); ``tensor`` is a dense gradient.
    """
    tensor = _tensor(tensor)  # a compression may hand back anything
    set_id = check_process_set(process_set)
    problem = _reduction_problem(tensor, op, pre, post, "allreduce")
    return _enqueue(_allreduce_entry(tensor, name, op, pre, post, set_id), problem)


def allreduce_gradients_async_(tensors: Sequence[torch.Tensor], names: Sequence[str],
                               op: ReduceOp, pre: float, post: float,
                               process_set: ProcessSet) -> list[Handle] | None:
    """:func:`allreduce_gradient_async_` for a batch of gradients: the engine
    takes them under one lock round, each with its own name and handle.

    None, with nothing submitted, when one of them has a problem (a dtype or
    device no reduction takes): the caller then submits them one by one, so
    that the invalid call fails on every rank as a single one does.
    """
    set_id = check_process_set(process_set)
    entries = []
    for tensor, name in zip(tensors, names, strict=True):
        tensor = _tensor(tensor)
        if _reduction_problem(tensor, op, pre, post, "allreduce") is not None:
            return None
        entries.append(_allreduce_entry(tensor, name, op, pre, post, set_id))
    _runtime.current().engine.enqueue_all(entries)
    return [entry.handle for entry in entries]


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts an allreduce into a new tensor; returns a handle."""
    output = _own_copy(_tensor(tensor))
    return allreduce_async_(output, average, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_waited(tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                     post: float, process_set: ProcessSet) -> torch.Tensor:
    """``synchronize(allreduce_async(...))``: the caller runs the round itself, so
    the background thread is not woken for it (hvd.allreduce's forward and backward)."""
    output = _own_copy(_tensor(tensor))
    return synchronize(_allreduce_start(output, None, name, op, pre, post, process_set,
                                        waited=True))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Allreduces ``tensor`` in place and returns it."""
    return synchronize(_allreduce_start(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set, waited=True))


class _AdasumHandle(Handle):
    """Adasum over a gathered tensor: combined by the Adasum rule when waited on."""

    __slots__ = ("inner", "target", "pre", "post")

    def __init__(self, inner: Handle, target: torch.Tensor, pre: float, post: float) -> None:
        super().__init__(inner.name)
        self.inner, self.target, self.pre, self.post = inner, target, pre, post

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:

        gathered = self.inner.wait(timeout)
        combined = adasum_reduce(list(gathered * self.pre if self.pre != 1.0 else gathered))
        if self.post != 1.0:
            combined = combined * self.post
        with torch.no_grad():
            self.target.copy_(combined.reshape(self.target.shape))
        return self.target


def _adasum_async_(tensor: torch.Tensor, name: str, pre: float, post: float,
                   set_id: int) -> int:
    # Every rank gathers every rank's tensor and applies the Adasum tree
    # locally: the same result everywhere, at O(size) memory per tensor.
    flat = tensor.detach().reshape(1, -1).contiguous()
    entry = Entry(name=name, op_type=OpType.ALLGATHER, buffer=flat, handle=Handle(name),
                  process_set_id=set_id)
    inner = _runtime.current().engine.enqueue(entry)
    return register(_AdasumHandle(inner, tensor, pre, post))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Starts an in-place allreduce of ``tensors`` as one group; returns one handle."""
    tensors = _tensors(tensors, "grouped_allreduce")
    set_id = check_process_set(process_set)
    pre, post = _scale_factors(prescale_factor, postscale_factor)
    op, problem = _op(op, average)
    if problem is None and op == ReduceOp.ADASUM:
        problem = "grouped_allreduce does not support op=hvd.Adasum; reduce the tensors one by one"
    problems = [problem or _reduction_problem(t, op, pre, post, "grouped_allreduce")
                or _unwritable(t) for t in tensors]
    base = _name(name, "grouped_allreduce", set_id)
    # Derived from the name so that every rank computes the same id.
    group_id = zlib.crc32(base.encode()) + 1
    entries = [_allreduce_entry(t, f"{base}.{i}", op, pre, post, set_id, group_id, len(tensors))
               for i, t in enumerate(tensors)]
    return _submit_all(entries, problems, _Group)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Starts a grouped allreduce into new tensors; returns one handle."""
    outputs = [_own_copy(t) for t in _tensors(tensors, "grouped_allreduce")]
    return grouped_allreduce_async_(outputs, average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduces ``tensors`` in place as one group and returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather ---------------------------------------------------------------------


def _allgather_entry(tensor: torch.Tensor, name: str, set_id: int) -> Entry:
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return Entry(name=name, op_type=OpType.ALLGATHER, buffer=tensor.contiguous(),
                 handle=Handle(name), process_set_id=set_id)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts concatenating every rank's ``tensor`` along dim 0 (sizes may differ)."""
    tensor = _tensor(tensor)
    set_id = check_process_set(process_set)
    problem = _device_problem(tensor)
    return _submit(_allgather_entry(tensor, _name(name, "allgather", set_id), set_id), problem)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Starts allgathers of several tensors under one handle (a list of results)."""
    tensors = _tensors(tensors, "grouped_allgather")
    set_id = check_process_set(process_set)
    problems = [_device_problem(t) for t in tensors]
    base = _name(name, "grouped_allgather", set_id)
    entries = [_allgather_entry(t, f"{base}.{i}", set_id) for i, t in enumerate(tensors)]
    return _submit_all(entries, problems, _Group)


# -- broadcast ---------------------------------------------------------------------


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Starts overwriting ``tensor`` with the root rank's value, in place."""
    tensor = _tensor(tensor)
    set_id = check_process_set(process_set)
    root, problem = _root(root_rank, process_set)
    problem = problem or _device_problem(tensor) or _unwritable(tensor)
    name = _name(name, "broadcast", set_id)
    buffer, result = _in_place(tensor)
    return _submit(Entry(name=name, op_type=OpType.BROADCAST, buffer=buffer,
                         handle=Handle(name), root_rank=root, process_set_id=set_id,
                         result=result), problem)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts a broadcast of the root rank's ``tensor`` into a new tensor."""
    output = _own_copy(_tensor(tensor))
    return broadcast_async_(output, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrites ``tensor`` with the root rank's value, in place, and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Starts scattering slices of ``tensor`` to every rank and gathering theirs.

    ``splits[r]`` rows go to rank r; without splits the first dimension is
    divided evenly (it must be divisible by the set's size).
    """
    tensor = _tensor(tensor).detach().contiguous()
    set_id = check_process_set(process_set)
    split_list, problem = _splits(tensor, splits, process_set.size())
    problem = problem or _device_problem(tensor)
    name = _name(name, "alltoall", set_id)
    return _submit(Entry(name=name, op_type=OpType.ALLTOALL, buffer=tensor, handle=Handle(name),
                         splits=split_list, process_set_id=set_id), problem)


# -- reducescatter -----------------------------------------------------------------


def _reducescatter_entry(tensor: torch.Tensor, name: str, op: ReduceOp, pre: float,
                         post: float, set_id: int) -> Entry:
    return Entry(name=name, op_type=OpType.REDUCESCATTER,
                 buffer=_own_copy(tensor),
                 handle=Handle(name), reduce_op=op, prescale_factor=pre,
                 postscale_factor=post, process_set_id=set_id)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Starts reducing ``tensor`` and scattering its rows: rank r keeps its share."""
    return _reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                postscale_factor, single=True)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | None = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Starts reducescatters of several tensors under one handle (a list of results)."""
    return _reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                postscale_factor, single=False)


def _reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None, op: Any,
                         process_set: ProcessSet, prescale_factor: float,
                         postscale_factor: float, single: bool) -> int:
    """One reducescatter (``single``: its handle gives a tensor) or a group of them."""
    tensors = _tensors(tensors, "reducescatter" if single else "grouped_reducescatter")
    set_id = check_process_set(process_set)
    pre, post = _scale_factors(prescale_factor, postscale_factor)
    op, problem = _op(op, None)
    problems = [problem or _reducescatter_problem(t, op, pre, post) for t in tensors]
    if single:
        return _submit(_reducescatter_entry(tensors[0], _name(name, "reducescatter", set_id), op,
                                            pre, post, set_id), problems[0])
    base = _name(name, "grouped_reducescatter", set_id)
    entries = [_reducescatter_entry(t, f"{base}.{i}", op, pre, post, set_id)
               for i, t in enumerate(tensors)]
    return _submit_all(entries, problems, _Group)


# -- sparse ------------------------------------------------------------------------


class _SparseHandle(Handle):
    """A sparse allreduce: every rank's indices and values, gathered and combined."""

    __slots__ = ("indices", "values", "like", "divisor")

    def __init__(self, name: str, indices: Handle, values: Handle, like: torch.Tensor,
                 divisor: int) -> None:
        super().__init__(name)
        self.indices, self.values, self.like, self.divisor = indices, values, like, divisor

    def done(self) -> bool:
        return self.indices.done() and self.values.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        values = self.values.wait(timeout)
        indices = self.indices.wait(timeout)
        if self.divisor != 1:
            values = values / self.divisor
        return torch.sparse_coo_tensor(indices.t(), values, self.like.shape,
                                       check_invariants=True)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None,
                           op: ReduceOp | None = None,
                           process_set: ProcessSet = global_process_set) -> int:
    """Starts summing (or averaging) a sparse tensor over all ranks; returns a handle.

    The result is a sparse COO tensor holding every rank's entries (not
    coalesced: entries that several ranks have appear once per rank and add
    up when coalesced or used).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise InvalidTypeError(f"sparse_allreduce_async takes a sparse tensor, got {tensor!r:.80}")
    set_id = check_process_set(process_set)
    op, problem = _op(op, None)
    if problem is None and op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        problem = f"sparse_allreduce supports op Average and Sum, not {op.name}"
    base = _name(name, "sparse_allreduce", set_id)
    tensor = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # Allgather concatenates along dim 0: send the indices transposed, one row per entry.
    entries = [_allgather_entry(tensor.indices().t(), f"{base}.indices", set_id),
               _allgather_entry(tensor.values(), f"{base}.values", set_id)]
    divisor = process_set.size() if op == ReduceOp.AVERAGE else 1
    return _submit_all(entries, [problem] * len(entries),
                       lambda handles: _SparseHandle(base, handles[0], handles[1], tensor,
                                                     divisor))


# -- barrier, join, timeline -------------------------------------------------------


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts recording a Chrome-trace timeline to ``file_path`` (written by rank 0).

    Open it in chrome://tracing or Perfetto; events carry Horovod's names
    (NEGOTIATE_ALLREDUCE, QUEUE, MEMCPY_IN_FUSION_BUFFER, GLOO_ALLREDUCE, ...).
    """
    _runtime.current().engine.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stops recording the timeline and closes its file."""
    _runtime.current().engine.stop_timeline()


def join(device: int = -1) -> int:
    """Declares that this rank has no more data; returns the last rank to join.

    Until every rank has joined, the other ranks' allreduces complete
    without this one (it contributes zeros to sums and averages, and the
    identity to min, max and product). Other collectives that need a joined
    rank fail with a clear error.
    """
    del device  # Horovod's argument picks a GPU for the zeros; ours follow the tensor
    name = _runtime.current().auto_name("join")
    return synchronize(_submit(Entry(name=name, op_type=OpType.JOIN, buffer=torch.empty(0),
                                     handle=Handle(name)), None))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the process set has reached it."""
    set_id = check_process_set(process_set)
    name = _name(None, "barrier", set_id)
    synchronize(_submit(Entry(name=name, op_type=OpType.BARRIER, buffer=torch.empty(0),
                              handle=Handle(name), process_set_id=set_id), None))
