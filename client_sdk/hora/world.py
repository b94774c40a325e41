"""The framework-neutral API: the world, process sets, builds and handles.

``hora.torch`` and ``hora.tensorflow`` both export these (each adds its collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora_native import xccl_built

from . import _runtime
from ._ops import ReduceOp
from .engine import Handle, HandleMap
from .errors import InvalidCallError

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set",
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous",
    "poll", "synchronize", "add_process_set", "remove_process_set",
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

    ``process_sets``, as in Horovod: the sets to add now (each a
    :class:`ProcessSet` or a list of ranks), or ``"dynamic"``, none now and any
    later through :func:`add_process_set` (hora allows that anyway, without
    Horovod's ``HOROVOD_DYNAMIC_PROCESS_SETS``). ``comm`` is accepted for
    Horovod's signature; an MPI communicator cannot be used by hora.
    """
    if comm is not None:
        raise ValueError("hora does not run over MPI: call hvd.init() without a communicator")
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of process sets or 'dynamic', got "
                             f"{process_sets!r}")
        process_sets = None
    _runtime.init()
    for process_set in process_sets or ():
        add_process_set(process_set)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set; every rank of the world must call it, in the same order.

    A collective: the coordinator answers once every rank has called, and
    answers every rank alike. A mistake made on one rank (sent along as this
    rank's problem with the call) raises the same ValueError on every rank
    instead of leaving the others waiting.

    Returns:
        The registered set (the one given, or a new one for a list of ranks).

    Raises:
        ValueError: the ranks are out of range or repeated, the set was already
            added, or ranks passed different sets (on any rank).
        HorovodInternalError: some rank did not call within the stall shutdown
            time (StallError), or a rank left or was lost (RankLostError).
    """
    problem = ""
    pset: ProcessSet | None = None
    try:
        pset = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    except (TypeError, ValueError) as exc:
        problem = f"{process_set!r} is not a list of ranks: {exc}"
    if pset is not None:
        problem = _process_set_problem(pset) or ""
    runtime = _runtime.current()
    set_id = runtime.next_process_set_id
    ranks = pset.ranks if pset is not None and pset.ranks is not None and not problem else []
    runtime.engine.add_process_set(set_id, ranks, invalid=problem)
    if pset is None:  # not reached: the coordinator failed the call on every rank
        raise InvalidCallError(problem)
    runtime.next_process_set_id += 1
    pset.process_set_id = set_id
    pset._runtime = runtime
    return pset


def _process_set_problem(process_set: ProcessSet) -> str | None:
    if current_set_id(process_set) is not None:
        return f"{process_set} has already been added"
    ranks, world = process_set.ranks, size()
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
        return f"process set ranks {ranks} must be distinct ranks in [0, {world})"
    # Horovod keeps one set per list of ranks, the global set's included.
    same = _set_with_ranks(ranks)
    if same is not None:
        return (f"attempted to add a duplicate process set: ranks {ranks} are those of "
                f"process set {same} already")
    return None


def _set_with_ranks(ranks: list[int]) -> int | None:
    """The id of the set (0: the global set) already added with exactly ``ranks``."""
    if ranks == list(range(size())):
        return 0
    runtime = _runtime.current()
    for set_id in range(1, runtime.next_process_set_id):
        try:
            group = runtime.engine.process_set(set_id)
        except ValueError:  # removed since
            continue
        if list(group.ranks) == ranks:
            return set_id
    return None


# RemoveProcessSetRequest.process_set_id of a set this rank never added.
_NOT_ADDED = -1


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set on every rank (all ranks call it). Returns whether it existed.

    A collective, answered alike on every rank as :func:`add_process_set` is.

    Raises:
        ValueError: a rank passed the global set, or ranks passed different sets
            (on every rank).
        HorovodInternalError: as for :func:`add_process_set`.
    """
    set_id = current_set_id(process_set)
    problem = "the global process set cannot be removed" \
        if process_set is global_process_set or set_id == 0 else ""
    _runtime.current().engine.remove_process_set(
        _NOT_ADDED if set_id is None else set_id, invalid=problem)
    if set_id is None:
        return False
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
    """Whether torch has the XCCL process group that serves XPU tensors (oneCCL)."""
    return xccl_built()


def cuda_built() -> bool:
    return torch.cuda.is_available() and bool(nccl_built())


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


# -- handles -----------------------------------------------------------------


class CallableHandle:
    """A handle that is called for its result, as ``sparse_allreduce_async``'s is in Horovod.

    ``handle()`` waits and returns the result (the same one if called again);
    :func:`synchronize` and :func:`poll` accept it too.
    """

    __slots__ = ("_result", "_done", "_wait", "_poll")

    def __init__(self, wait: Callable[[], Any], poll: Callable[[], bool]) -> None:
        self._wait, self._poll = wait, poll
        self._done = False
        self._result: Any = None

    def __call__(self) -> Any:
        if not self._done:
            self._result = self._wait()
            self._done = True
        return self._result

    def done(self) -> bool:
        return self._done or self._poll()


# Module-wide, as in Horovod: a handle outlives the runtime that made it.
_handles = HandleMap()


def register(handle: Handle) -> int:
    """The integer handle users see for ``handle``."""
    return _handles.register(handle)


def _lookup(handle: int) -> Handle:
    found = _handles.get(handle)
    if found is None:
        raise InvalidCallError(f"unknown or already synchronized handle {handle}")
    return found


def take(handle: int) -> Handle:
    """The engine handle behind the integer ``handle``, which is released: the
    caller waits on the object (:func:`wait`) instead."""
    found = _lookup(handle)
    _handles.release(handle)
    return found


def poll(handle: int | CallableHandle) -> bool:
    """True when the collective behind ``handle`` has finished (or failed)."""
    if isinstance(handle, CallableHandle):
        return handle.done()
    return _lookup(handle).done()


def synchronize(handle: int | CallableHandle) -> Any:
    """Waits for the collective behind ``handle`` and returns its result; None
    for a handle that was synchronized already or never made, as Horovod's
    ``synchronize`` returns (``poll`` raises for one).

    Raises:
        HorovodInternalError: the collective failed on this rank (a peer was
            lost, ranks disagreed on the tensor, the data plane broke).
    """
    if isinstance(handle, CallableHandle):
        return handle()
    entry = _handles.get(handle)
    if entry is None:
        return None
    try:
        return wait(entry)
    finally:
        _handles.release(handle)


def wait(handle: Handle) -> Any:
    """:func:`synchronize` for an engine handle that was never given an integer
    (a DistributedOptimizer's gradient allreduces).

    Raises:
        HorovodInternalError: as :func:`synchronize`.
    """
    runtime = _runtime._runtime
    # Every failure path of the engine completes the handle, so this waits in
    # slices only to stay responsive to KeyboardInterrupt.
    while True:
        try:
            return handle.wait(timeout=1.0)
        except TimeoutError:
            failure = runtime.engine.failure() if runtime is not None else None
            if failure is not None and not handle.done():
                raise failure from None


def current_set_id(process_set: ProcessSet) -> int | None:
    """The set's id in this runtime; None when it was added to an earlier one."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return set_id
    return set_id if process_set._runtime is _runtime.current() else None


def check_process_set(process_set: ProcessSet) -> int:
    """The id to submit a collective on ``process_set`` with.

    Raises:
        InvalidCallError: the set was not added (in this runtime), or this
            rank is not in it.
    """
    if process_set is global_process_set:
        return 0  # every rank's, in every runtime
    if not isinstance(process_set, ProcessSet):
        raise InvalidCallError(f"process_set must be a hvd.ProcessSet, got "
                               f"{type(process_set).__name__}")
    if current_set_id(process_set) is None:
        if process_set.process_set_id is not None:
            raise InvalidCallError(f"{process_set} was added before hvd.shutdown() or an "
                                   f"elastic reset; add it again with hvd.add_process_set")
        raise InvalidCallError(f"{process_set} has not been added; call hvd.add_process_set "
                               f"first")
    if process_set.process_set_id != 0 and not process_set.included():
        raise InvalidCallError(f"rank {rank()} is not in {process_set}; only its members may "
                               f"run collectives on it")
    set_id = process_set.process_set_id
    assert set_id is not None  # current_set_id found it
    return set_id
