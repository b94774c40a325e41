"""Collectives on torch tensors, with Horovod's signatures and semantics.

Every ``*_async`` function returns an integer handle; :func:`synchronize`
waits for it and returns the result, :func:`poll` asks whether it is done.
The synchronous forms are differentiable where Horovod's are (allreduce,
allgather, broadcast, alltoall, reducescatter).
"""

from __future__ import annotations

import itertools
import threading
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from .. import _runtime
from .._engine import Entry, Handle
from .._ops import OpType, ReduceOp

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set",
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather", "allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "barrier", "join", "poll", "synchronize", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline",
    "gloo_built", "gloo_enabled", "nccl_built", "mpi_built", "mpi_enabled", "ccl_built",
    "cuda_built", "rocm_built", "ddl_built", "mpi_threads_supported",
]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


class ProcessSet:
    """A subset of ranks that runs collectives among themselves.

    Create one with the ranks it holds and register it on every rank with
    :func:`add_process_set` (or ``hvd.init(process_sets=[...])``); then pass
    it as ``process_set=`` to any collective. Ranks are global ranks, also
    for ``root_rank``.
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks: list[int] | None = sorted(int(r) for r in ranks) if ranks is not None \
            else None
        self.process_set_id: int | None = None
        # The runtime it was added to: ids mean nothing after shutdown() or an
        # elastic reset, when the next init() starts numbering sets again.
        self._runtime: object | None = None

    def size(self) -> int:
        """Number of ranks in the set."""
        return size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This process's position in the set.

        Raises:
            ValueError: this process is not in the set.
        """
        if self.ranks is None:  # the global set, whatever the world's size is now
            return rank()
        if rank() not in self.ranks:
            raise ValueError(f"rank {rank()} is not in {self}")
        return self.ranks.index(rank())

    def included(self) -> bool:
        """Whether this process is in the set."""
        return self.ranks is None or rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


# -- lifecycle and world --------------------------------------------------


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Joins the job: blocks until every worker has joined, then builds the data plane.

    ``comm`` and ``process_sets`` are accepted for compatibility with
    Horovod's signature; an MPI communicator cannot be used by hora.
    """
    if comm is not None:
        raise ValueError("hora does not run over MPI: call hvd.init() without a communicator")
    _runtime.init()
    for process_set in process_sets or ():
        add_process_set(process_set)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set; every rank of the world must call it, in the same order.

    The ranks compare their calls before anything is registered, so a mistake
    made on one rank raises the same ValueError on every rank instead of
    leaving the others waiting.

    Returns:
        The registered set (the one given, or a new one for a list of ranks).

    Raises:
        ValueError: the ranks are out of range or repeated, the set was already
            added, or ranks passed different sets (on any rank).
    """
    problem = None
    try:
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
    except (TypeError, ValueError) as exc:
        problem = f"{process_set!r} is not a list of ranks: {exc}"
    if problem is None:
        problem = _process_set_problem(process_set)
    runtime = _runtime.current()
    set_id = runtime.next_process_set_id
    ranks = process_set.ranks if problem is None else None
    from .functions import allgather_object

    calls = allgather_object((ranks, problem), name=f"add_process_set.{set_id}")
    _raise_on_any_rank("add_process_set", calls)
    runtime.engine.add_process_set(set_id, ranks)
    runtime.next_process_set_id += 1
    process_set.process_set_id = set_id
    process_set._runtime = runtime
    return process_set


def _process_set_problem(process_set: ProcessSet) -> str | None:
    if _current_id(process_set) is not None:
        return f"{process_set} has already been added"
    ranks, world = process_set.ranks, size()
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
        return f"process set ranks {ranks} must be distinct ranks in [0, {world})"
    return None


def _raise_on_any_rank(call: str, calls: list[tuple[Any, str | None]]) -> None:
    """Raises on every rank alike when any rank's call was bad or the calls differ.

    ``calls`` holds each rank's (argument, problem or None), in rank order.
    """
    problems = [f"rank {r}: {problem}" for r, (_arg, problem) in enumerate(calls) if problem]
    if problems:
        raise ValueError(f"{call} failed on every rank because of " + "; ".join(problems))
    if any(arg != calls[0][0] for arg, _problem in calls):
        detail = "; ".join(f"rank {r}: {arg}" for r, (arg, _problem) in enumerate(calls))
        raise ValueError(f"ranks called {call} with different sets: {detail}")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set on every rank (all ranks call it). Returns whether it existed.

    Raises:
        ValueError: a rank passed the global set, or ranks passed different sets
            (on every rank).
    """
    set_id = _current_id(process_set)
    problem = "the global process set cannot be removed" \
        if process_set is global_process_set or set_id == 0 else None
    from .functions import allgather_object

    _raise_on_any_rank("remove_process_set", allgather_object((set_id, problem)))
    if set_id is None:
        return False
    _runtime.current().engine.remove_process_set(set_id)
    process_set.process_set_id = None
    return True


def shutdown() -> None:
    """Leaves the job; ``init()`` may be called again afterwards."""
    _runtime.shutdown()


def is_initialized() -> bool:
    return _runtime.is_initialized()


def _world() -> Any:
    return _runtime.current().world


def size() -> int:
    return _world().size


def rank() -> int:
    return _world().rank


def local_size() -> int:
    return _world().local_size


def local_rank() -> int:
    return _world().local_rank


def cross_size() -> int:
    return _world().cross_size


def cross_rank() -> int:
    return _world().cross_rank


def is_homogeneous() -> bool:
    return _world().is_homogeneous


# -- builds -----------------------------------------------------------------


def gloo_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def gloo_enabled() -> bool:
    return gloo_built()


def nccl_built() -> int | bool:
    """The NCCL version torch was built with (as Horovod's int, e.g. 21803), or False."""
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return False
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return False
    if isinstance(version, tuple):
        major, minor, patch = (list(version) + [0, 0, 0])[:3]
        return major * 10000 + minor * 100 + patch
    return int(version)


def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.cuda.is_available() and bool(nccl_built())


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


# -- handles -----------------------------------------------------------------

_handles: dict[int, Handle] = {}
_handles_lock = threading.Lock()
_handle_ids = itertools.count(1)


def _register(handle: Handle) -> int:
    with _handles_lock:
        handle_id = next(_handle_ids)
        _handles[handle_id] = handle
    return handle_id


def _lookup(handle: int) -> Handle:
    with _handles_lock:
        found = _handles.get(handle)
    if found is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    return found


def poll(handle: int) -> bool:
    """True when the collective behind ``handle`` has finished (or failed)."""
    return _lookup(handle).done()


def synchronize(handle: int) -> Any:
    """Waits for the collective behind ``handle`` and returns its result.

    Raises:
        HorovodInternalError: the collective failed on this rank (a peer was
            lost, ranks disagreed on the tensor, the data plane broke).
    """
    entry = _lookup(handle)
    runtime = _runtime.current() if _runtime.is_initialized() else None
    try:
        # Every failure path of the engine completes the handle, so this
        # waits in slices only to stay responsive to KeyboardInterrupt.
        while True:
            try:
                return entry.wait(timeout=1.0)
            except TimeoutError:
                if runtime is not None and runtime.engine.failure() is not None and \
                        not entry.done():
                    raise runtime.engine.failure() from None
    finally:
        with _handles_lock:
            _handles.pop(handle, None)


# -- submission -------------------------------------------------------------


def _current_id(process_set: ProcessSet) -> int | None:
    """The set's id in this runtime; None when it was added to an earlier one."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return set_id
    return set_id if process_set._runtime is _runtime.current() else None


def _check_process_set(process_set: ProcessSet) -> int:
    if _current_id(process_set) is None:
        if process_set.process_set_id is not None:
            raise ValueError(f"{process_set} was added before hvd.shutdown() or an elastic "
                             f"reset; add it again with hvd.add_process_set")
        raise ValueError(f"{process_set} has not been added; call hvd.add_process_set first")
    if process_set.process_set_id != 0 and not process_set.included():
        raise ValueError(f"rank {rank()} is not in {process_set}; only its members may run "
                         f"collectives on it")
    return process_set.process_set_id


def _op(op: ReduceOp | None, average: bool | None) -> ReduceOp:
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if average is not None:
        warnings.warn("average= is deprecated; use op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=3)
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return ReduceOp.AVERAGE
    return ReduceOp(op)


def _submit(entry: Entry) -> int:
    runtime = _runtime.current()
    return _register(runtime.engine.enqueue(entry))


def _name(name: str | None, op: str, process_set: ProcessSet) -> str:
    return name if name else _runtime.current().auto_name(op, process_set.process_set_id or 0)


def _check_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError("sparse tensors cannot be reduced directly; use allgather on "
                        "their indices and values (or sparse_as_dense=True)")
    return tensor


def _allreduce_entry(tensor: torch.Tensor, buffer: torch.Tensor, name: str, op: ReduceOp,
                     prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                     group_id: int = 0, group_size: int = 0) -> Entry:
    return Entry(name=name, op_type=OpType.ALLREDUCE, buffer=buffer, handle=Handle(name),
                 reduce_op=op, prescale_factor=float(prescale_factor),
                 postscale_factor=float(postscale_factor),
                 process_set_id=_check_process_set(process_set), group_id=group_id,
                 group_size=group_size,
                 result=None if buffer is tensor else _copy_back(tensor))


def _copy_back(target: torch.Tensor) -> Any:
    def result(value: torch.Tensor) -> torch.Tensor:
        if value is not target:
            target.copy_(value.view_as(target))
        return target
    return result


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Starts an in-place allreduce of ``tensor``; returns a handle."""
    tensor = _check_tensor(tensor)
    op = _op(op, average)
    if op == ReduceOp.ADASUM:
        return _adasum_async_(tensor, _name(name, "allreduce", process_set), prescale_factor,
                              postscale_factor, process_set)
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    return _submit(_allreduce_entry(tensor, buffer, _name(name, "allreduce", process_set),
                                    op, prescale_factor, postscale_factor, process_set))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts an allreduce into a new tensor; returns a handle."""
    output = _check_tensor(tensor).detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(output, average, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Allreduces ``tensor`` in place and returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                prescale_factor: float, postscale_factor: float,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, prescale_factor, postscale_factor, \
            process_set
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor,
                                           postscale_factor, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = synchronize(allreduce_async(grad.contiguous(), None, None, ctx.op, ctx.pre,
                                              ctx.post, ctx.process_set))
        return reduced, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = None, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns the reduction of ``tensor`` over all ranks (differentiable).

    Args:
        tensor: the tensor to reduce; every rank passes the same shape and dtype.
        name: a name unique among in-flight operations; generated when omitted.
        compression: ``hvd.Compression.none`` (default) or ``fp16``/``bf16``.
        op: ``hvd.Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after the reduction.
    """
    op = _op(op, average)
    if compression is None:
        return _AllreduceFunction.apply(tensor, name, op, prescale_factor, postscale_factor,
                                        process_set)
    compressed, ctx = compression.compress(tensor)
    reduced = _AllreduceFunction.apply(compressed, name, op, prescale_factor, postscale_factor,
                                       process_set)
    return compression.decompress(reduced, ctx)


class _AdasumHandle(Handle):
    """Adasum over a gathered tensor: combined by the Adasum rule when waited on."""

    __slots__ = ("inner", "target", "pre", "post")

    def __init__(self, inner: Handle, target: torch.Tensor, pre: float, post: float) -> None:
        super().__init__(inner.name)
        self.inner, self.target, self.pre, self.post = inner, target, pre, post

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        from .adasum import adasum_reduce

        gathered = self.inner.wait(timeout)
        combined = adasum_reduce(list(gathered * self.pre if self.pre != 1.0 else gathered))
        if self.post != 1.0:
            combined = combined * self.post
        with torch.no_grad():
            self.target.copy_(combined.reshape(self.target.shape))
        return self.target


def _adasum_async_(tensor: torch.Tensor, name: str, prescale_factor: float,
                   postscale_factor: float, process_set: ProcessSet) -> int:
    if not tensor.is_floating_point():
        raise TypeError(f"op=hvd.Adasum needs a floating point tensor, got {tensor.dtype}")
    # Every rank gathers every rank's tensor and applies the Adasum tree
    # locally: the same result everywhere, at O(size) memory per tensor.
    flat = tensor.detach().reshape(1, -1).contiguous()
    entry = Entry(name=name, op_type=OpType.ALLGATHER, buffer=flat, handle=Handle(name),
                  process_set_id=_check_process_set(process_set))
    inner = _runtime.current().engine.enqueue(entry)
    return _register(_AdasumHandle(inner, tensor, float(prescale_factor),
                                   float(postscale_factor)))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Starts an in-place allreduce of ``tensors`` as one group; returns one handle."""
    if not tensors:
        raise ValueError("grouped_allreduce needs at least one tensor")
    op = _op(op, average)
    if op == ReduceOp.ADASUM:
        raise ValueError("grouped_allreduce does not support op=hvd.Adasum; reduce the "
                         "tensors one by one")
    base = _name(name, "grouped_allreduce", process_set)
    runtime = _runtime.current()
    # Derived from the name so that every rank computes the same id.
    group_id = zlib.crc32(base.encode()) + 1
    group = _Group(list(tensors))
    handles = []
    for i, tensor in enumerate(tensors):
        tensor = _check_tensor(tensor)
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        entry = _allreduce_entry(tensor, buffer, f"{base}.{i}", op, prescale_factor,
                                 postscale_factor, process_set, group_id, len(tensors))
        handles.append(runtime.engine.enqueue(entry))
    group.handles = handles
    return _register(group)


class _Group(Handle):
    """One handle over the tensors of a grouped allreduce."""

    __slots__ = ("tensors", "handles")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__("group")
        self.tensors = tensors
        self.handles: list[Handle] = []

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> list[torch.Tensor]:
        return [h.wait(timeout) for h in self.handles]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Starts a grouped allreduce into new tensors; returns one handle."""
    outputs = [_check_tensor(t).detach().clone(memory_format=torch.contiguous_format)
               for t in tensors]
    return grouped_allreduce_async_(outputs, average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = None,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduces several tensors as one negotiated, fused group."""
    if compression is None:
        return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                                   postscale_factor, process_set))
    pairs = [compression.compress(t) for t in tensors]
    reduced = synchronize(grouped_allreduce_async([p[0] for p in pairs], average, name, op,
                                                  prescale_factor, postscale_factor,
                                                  process_set))
    return [compression.decompress(r, p[1]) for r, p in zip(reduced, pairs, strict=True)]


# -- allgather, broadcast, alltoall, reducescatter --------------------------


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts concatenating every rank's ``tensor`` along dim 0 (sizes may differ)."""
    tensor = _check_tensor(tensor).detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    name = _name(name, "allgather", process_set)
    return _submit(Entry(name=name, op_type=OpType.ALLGATHER, buffer=tensor.contiguous(),
                         handle=Handle(name), process_set_id=_check_process_set(process_set)))


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad_sum = synchronize(allreduce_async(grad.contiguous(), op=Sum,
                                               process_set=ctx.process_set))
        dims = synchronize(allgather_async(torch.tensor([ctx.dim0]),
                                           process_set=ctx.process_set))
        offset = int(dims[: ctx.process_set.rank()].sum())
        return grad_sum.narrow(0, offset, ctx.dim0), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along dim 0; first dimensions may differ."""
    return _AllgatherFunction.apply(tensor, name, process_set)


def _check_root(root_rank: int, process_set: ProcessSet) -> int:
    root_rank = int(root_rank)
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank {root_rank} is outside the world of size {size()}")
    if process_set.ranks is not None and root_rank not in process_set.ranks:
        raise ValueError(f"root_rank {root_rank} is not in {process_set}")
    return root_rank


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Starts overwriting ``tensor`` with the root rank's value, in place."""
    tensor = _check_tensor(tensor)
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    name = _name(name, "broadcast", process_set)
    return _submit(Entry(name=name, op_type=OpType.BROADCAST, buffer=buffer,
                         handle=Handle(name), root_rank=_check_root(root_rank, process_set),
                         process_set_id=_check_process_set(process_set),
                         result=None if buffer is tensor else _copy_back(tensor)))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts a broadcast of the root rank's ``tensor`` into a new tensor."""
    output = _check_tensor(tensor).detach().clone(memory_format=torch.contiguous_format)
    return broadcast_async_(output, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Sum,
                                              process_set=ctx.process_set))
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns the root rank's ``tensor`` on every rank (differentiable)."""
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Starts scattering slices of ``tensor`` to every rank and gathering theirs.

    ``splits[r]`` rows go to rank r; without splits the first dimension is
    divided evenly (it must be divisible by the world size).
    """
    tensor = _check_tensor(tensor).detach().contiguous()
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    world = process_set.size()
    if splits is None:
        if tensor.shape[0] % world:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by "
                             f"the process set size {world}, got {tensor.shape[0]}")
        split_list = [tensor.shape[0] // world] * world
    else:
        split_list = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor)
                                       else splits)]
        if len(split_list) != world or any(s < 0 for s in split_list) or \
                sum(split_list) != tensor.shape[0]:
            raise ValueError(f"alltoall splits {split_list} must have {world} non-negative "
                             f"entries summing to the first dimension {tensor.shape[0]}")
    name = _name(name, "alltoall", process_set)
    return _submit(Entry(name=name, op_type=OpType.ALLTOALL, buffer=tensor, handle=Handle(name),
                         splits=split_list, process_set_id=_check_process_set(process_set)))


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
    """Exchanges slices of ``tensor`` between all ranks.

    Returns:
        The gathered tensor; with ``splits`` given, a pair ``(tensor,
        received_splits)`` where ``received_splits[r]`` rows came from rank r.
    """
    output, received = _AlltoallFunction.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Starts reducing ``tensor`` and scattering its rows: rank r keeps its share."""
    tensor = _check_tensor(tensor).detach().clone(memory_format=torch.contiguous_format)
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    op = _op(op, None)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX,
                  ReduceOp.PRODUCT):
        raise ValueError(f"reducescatter does not support op {op.name}")
    name = _name(name, "reducescatter", process_set)
    return _submit(Entry(name=name, op_type=OpType.REDUCESCATTER, buffer=tensor,
                         handle=Handle(name), reduce_op=op,
                         prescale_factor=float(prescale_factor),
                         postscale_factor=float(postscale_factor),
                         process_set_id=_check_process_set(process_set)))


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                process_set: ProcessSet, pre: float, post: float) -> torch.Tensor:
        ctx.op, ctx.process_set, ctx.scale = op, process_set, pre * post
        ctx.rows = tensor.shape[0]
        return synchronize(reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gathered = synchronize(allgather_async(grad.contiguous(), process_set=ctx.process_set))
        scale = ctx.scale / (ctx.process_set.size() if ctx.op == ReduceOp.AVERAGE else 1)
        return gathered * scale, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None,
                  op: ReduceOp | None = None,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces ``tensor`` over all ranks and returns this rank's rows.

    Rank r receives ``split_rows(n, size)[r]`` rows: the first ``n % size``
    ranks get one extra row.
    """
    op = _op(op, None)
    if compression is None:
        return _ReducescatterFunction.apply(tensor, name, op, process_set, prescale_factor,
                                            postscale_factor)
    compressed, cctx = compression.compress(tensor)
    out = _ReducescatterFunction.apply(compressed, name, op, process_set, prescale_factor,
                                       postscale_factor)
    return compression.decompress(out, cctx)


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
                                     handle=Handle(name))))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the process set has reached it."""
    name = _name(None, "barrier", process_set)
    synchronize(_submit(Entry(name=name, op_type=OpType.BARRIER,
                              buffer=torch.empty(0), handle=Handle(name),
                              process_set_id=_check_process_set(process_set))))

