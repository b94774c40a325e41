"""What is in flight: handles, entries, the pending table and its failure latch.

A caller's collective becomes an :class:`Entry` with a :class:`Handle`; the
entry waits in :class:`Pending` under its name until a stage completes it.
Once the generation fails (a lost rank, a broken stream, a data-plane
error), :meth:`Pending.fail` completes every waiting handle with that error
and every later :meth:`Pending.add` raises it. :class:`HandleMap` gives
handles the integer ids Horovod's API hands out.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora_proto.v1 import negotiation_pb2

from .._ops import OpType, ReduceOp, dtype_name
from ..errors import HoraError, InvalidCallError
from .cache import Signature

__all__ = ["Entry", "Handle", "HandleMap", "Pending"]

log = logging.getLogger("hora")

# Guards the hand-over between a handle's completion and a thread starting to block on it.
_HANDLE_LOCK = threading.Lock()


class Handle:
    """The future of one enqueued collective."""

    __slots__ = ("name", "_finished", "_event", "_result", "_error", "driver", "_callbacks")

    def __init__(self, name: str) -> None:
        self.name = name
        self._finished = False
        # Made only when a thread blocks on this handle: most handles are
        # completed by the round their waiter runs, and an Event per tensor
        # costs more than the rest of its bookkeeping.
        self._event: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        # Set by the engine for tensors its rounds run: a waiting caller runs
        # the rounds itself (until the deadline, a monotonic time) instead of
        # handing them to a thread and back.
        self.driver: Callable[[Handle, float | None], None] | None = None
        self._callbacks: list[Callable[[Handle], None]] | None = None

    def done(self) -> bool:
        return self._finished

    def _finish(self) -> tuple[threading.Event | None, list[Callable[[Handle], None]] | None]:
        """Marks the handle done; call with ``_HANDLE_LOCK`` held, after checking
        that it was not. Returns what :meth:`_fire` wakes, outside the lock."""
        self._finished = True
        callbacks, self._callbacks = self._callbacks, None
        return self._event, callbacks

    def _fire(self, event: threading.Event | None,
              callbacks: list[Callable[[Handle], None]] | None) -> None:
        if event is not None:
            event.set()
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:  # a callback's bug must not break the round that completed it
                log.exception("a done callback of tensor %r failed", self.name)

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Calls ``callback(handle)`` once the handle is done (now, if it already is).

        It runs in the thread that completes the handle (often the engine's
        round), so it must be quick and must not block: hand the work over.
        """
        with _HANDLE_LOCK:
            if not self._finished:
                self._callbacks = [*(self._callbacks or ()), callback]
                return
        callback(self)

    # The first completion wins (a result or an error, never both): a tensor the
    # data plane finishes as the generation fails is completed once.

    def set_result(self, result: Any) -> None:
        with _HANDLE_LOCK:
            if self._finished:
                return
            self._result = result
            event, callbacks = self._finish()
        self._fire(event, callbacks)

    @staticmethod
    def set_results(handles: Sequence[Handle], results: Sequence[Any]) -> None:
        """``set_result`` on each of ``handles`` (a fused batch), under one lock round."""
        fired = []
        with _HANDLE_LOCK:
            for handle, result in zip(handles, results, strict=True):
                if handle._finished:
                    continue
                handle._result = result
                if handle._event is None and not handle._callbacks:
                    handle._finished = True  # nobody to wake: the common case
                    continue
                fired.append((handle, *handle._finish()))
        for handle, event, callbacks in fired:
            handle._fire(event, callbacks)

    def set_error(self, error: BaseException) -> None:
        with _HANDLE_LOCK:
            if self._finished:
                return
            self._error = error
            event, callbacks = self._finish()
        self._fire(event, callbacks)

    def wait(self, timeout: float | None = None) -> Any:
        """Returns the result, or raises the collective's error.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if self.driver is not None and not self._finished:
            deadline = None if timeout is None else time.monotonic() + timeout
            self.driver(self, deadline)
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
        if not self._finished:
            with _HANDLE_LOCK:
                if not self._finished and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise TimeoutError(f"tensor {self.name!r} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


@dataclasses.dataclass(eq=False, slots=True)
class Entry:
    """One collective as the engine sees it.

    ``buffer`` is what the collective reads (and, for in-place reductions and
    broadcasts, writes); ``result`` turns what the collective produced into
    what the caller's handle returns.
    """

    name: str
    op_type: OpType
    buffer: torch.Tensor
    handle: Handle
    reduce_op: ReduceOp = ReduceOp.SUM
    root_rank: int = 0
    prescale_factor: float = 1.0
    postscale_factor: float = 1.0
    process_set_id: int = 0
    splits: Sequence[int] | None = None
    group_id: int = 0
    group_size: int = 0
    result: Callable[[Any], Any] | None = None
    # Why this rank's call is invalid (see TensorRequest.invalid); the
    # coordinator fails the call on every rank, and it never runs.
    invalid: str = ""
    enqueued_at: float = dataclasses.field(default_factory=time.monotonic)
    stall_warned: bool = False
    # The caller waits on the handle at once (``hvd.allreduce_``): it runs the
    # round itself, so the background thread need not be woken for it.
    waited: bool = False

    def signature(self) -> Signature:
        return Signature(dtype_name(self.buffer.dtype), tuple(self.buffer.shape),
                         self.buffer.device.type, int(self.reduce_op),
                         self.prescale_factor, self.postscale_factor)

    def quick_key(self) -> tuple[object, ...]:
        """What decides :meth:`signature`, as the tensor holds it: equal keys
        mean equal signatures, and a key is several times cheaper to build."""
        buffer = self.buffer
        return (buffer.dtype, buffer.shape, buffer.device, self.reduce_op,
                self.prescale_factor, self.postscale_factor)

    def cacheable(self) -> bool:
        """Global-set, ungrouped allreduces can skip the coordinator once negotiated."""
        return (self.op_type == OpType.ALLREDUCE and self.process_set_id == 0
                and self.group_id == 0)

    def request(self) -> negotiation_pb2.TensorRequest:
        return negotiation_pb2.TensorRequest(
            name=self.name, op_type=self.op_type.value, dtype=dtype_name(self.buffer.dtype),
            shape=list(self.buffer.shape), device=self.buffer.device.type,
            reduce_op=self.reduce_op.value, root_rank=self.root_rank,
            prescale_factor=self.prescale_factor, postscale_factor=self.postscale_factor,
            process_set_id=self.process_set_id, splits=list(self.splits or ()),
            group_id=self.group_id, group_size=self.group_size, invalid=self.invalid)


class Pending:
    """The entries in flight by name, and the generation's failure latch.

    ``lock`` guards the table and is shared with the agreement stage, whose
    condition ``work`` wakes the threads that run rounds.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)
        self.entries: dict[str, Entry] = {}
        self.failure: HoraError | None = None
        self.stopping = threading.Event()
        #: Called with the lock held when the generation fails, to drop what
        #: other stages hold of the failed entries.
        self.on_fail: list[Callable[[], None]] = []
        #: The entries each engine thread took out of the table for the work it
        #: runs now (:meth:`holding`), by thread: a failure completes them too.
        self._held: dict[int, list[Entry]] = {}

    def add(self, entry: Entry) -> None:
        """Records ``entry``; call with the lock held.

        Raises:
            InvalidCallError: a tensor with the same name is already in flight.
            HoraError: the generation has failed (a new error of its class).
        """
        if self.failure is not None:
            raise type(self.failure)(str(self.failure))
        if entry.name in self.entries:
            raise self._in_flight(entry.name)
        self.entries[entry.name] = entry

    def add_all(self, entries: Sequence[Entry]) -> None:
        """:meth:`add` for each of ``entries``, all or none; call with the lock held.

        Raises:
            InvalidCallError: a tensor with the same name is already in flight,
                or two of ``entries`` share a name; none of them is recorded.
            HoraError: as :meth:`add`.
        """
        if self.failure is not None:
            raise type(self.failure)(str(self.failure))
        table = self.entries
        new = {entry.name: entry for entry in entries}
        if len(new) != len(entries) or not table.keys().isdisjoint(new):
            seen: set[str] = set()
            for entry in entries:
                if entry.name in table or entry.name in seen:
                    raise self._in_flight(entry.name)
                seen.add(entry.name)
        table.update(new)

    def _in_flight(self, name: str) -> InvalidCallError:
        return InvalidCallError(f"a tensor named {name!r} is already in flight on rank "
                                f"{self.rank}; names must be unique among pending operations")

    def take(self, names: Sequence[str]) -> list[Entry]:
        """Removes and returns the entries of ``names`` this rank has; the calling
        thread holds them until its :meth:`holding` ends."""
        with self.lock:
            taken = [self.entries.pop(name) for name in names if name in self.entries]
        self._hold(taken)
        return taken

    def discard(self, entries: Sequence[Entry]) -> None:
        """Removes ``entries`` from the table; the calling thread holds them."""
        with self.lock:
            for entry in entries:
                self.entries.pop(entry.name, None)
        self._hold(entries)

    def _hold(self, entries: Sequence[Entry]) -> None:
        held = self._held.get(threading.get_ident())
        if held is not None:
            held.extend(entries)

    def holding(self) -> bool:
        """Starts recording what this thread takes out of the table, until
        :meth:`release`; False when it already records (nested work), and then the
        outer caller releases. Meanwhile a failure of the generation raised in this
        thread completes those entries' handles as well: a tensor inside the data
        plane when a peer dies is no longer in the table."""
        ident = threading.get_ident()
        if ident in self._held:
            return False
        self._held[ident] = []
        return True

    def release(self) -> None:
        self._held.pop(threading.get_ident(), None)

    def fail(self, error: HoraError) -> None:
        """Fails every pending handle with the generation's first error."""
        with self.lock:
            if self.failure is None:
                self.failure = error
            pending, self.entries = self.entries, {}
            for drop in self.on_fail:
                drop()
            self.work.notify_all()
        # Only what this thread holds: another thread's tensors may still be in
        # its data-plane call, writing into their buffers; that call ends (the
        # peer's sockets closed, the collective timeout) and its run_safely
        # fails them then, once nothing writes into them any more.
        held = [entry for entry in self._held.get(threading.get_ident(), ())
                if not entry.handle.done()]
        if (pending or held) and not self.stopping.is_set():
            log.error("rank %d: failing %d pending tensor(s) (%s): %s", self.rank,
                      len(pending) + len(held),
                      ", ".join(sorted([*pending, *(e.name for e in held)])[:5]), error)
        for entry in [*pending.values(), *held]:
            entry.handle.set_error(self.failure)

    def over(self) -> bool:
        """Whether the generation has failed or is shutting down."""
        return self.failure is not None or self.stopping.is_set()


class HandleMap:
    """The integer handles of Horovod's API (``hvd.allreduce_async`` returns one).

    Every operation is one step of a built-in (``next`` on a counter, a dict
    store, get or pop), each atomic in CPython, so threads may share the map
    without a lock: every small allreduce passes here twice.
    """

    def __init__(self) -> None:
        self._handles: dict[int, Handle] = {}
        self._ids = itertools.count(1)

    def register(self, handle: Handle) -> int:
        handle_id = next(self._ids)
        self._handles[handle_id] = handle
        return handle_id

    def get(self, handle_id: int) -> Handle | None:
        return self._handles.get(handle_id)

    def release(self, handle_id: int) -> None:
        self._handles.pop(handle_id, None)
