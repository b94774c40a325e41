"""Horovod-style timeline: a Chrome trace of what the engine did to each tensor.

The file is a Trace Event Format JSON array (open it in ``chrome://tracing`` or
https://ui.perfetto.dev). Event names are Horovod's, so a Horovod user's habits
and scripts carry over: per tensor, ``NEGOTIATE_<OP>`` while the ranks agree,
then the top-level ``<OP>`` with nested activities (``QUEUE``,
``MEMCPY_IN_FUSION_BUFFER``, ``GLOO_ALLREDUCE``, ...).

Layout: ``pid`` is the rank (a ``process_name`` metadata event calls it
``rank R``) and every tensor gets its own row, ``tid`` 1, 2, ... in order of
first appearance, named by a ``thread_name`` metadata event as Horovod names
the tensor: its collective, a dot, then the name the script gave it
(``allreduce.fc.weight``, ``allgather.ids``, ``broadcast.bcast``; see
:func:`row_name`), which is what tools grep Horovod's timelines for.
Horovod gives every tensor its own ``pid`` instead; one pid per rank lets the
files of several ranks be concatenated into one trace without collisions.
Row ``tid`` 0, named ``CYCLE_START``, holds the cycle markers.

How the file stays valid JSON at every moment, even across ``kill -9``:
callers only append a tuple to a deque (no lock, no formatting); a writer
thread wakes every ``flush_interval``, formats what piled up, and publishes a
new version of the file: the kernel copies the current array except its
closing ``]`` into a fresh unnamed file (``O_TMPFILE``), the batch and a new
``]`` go after it, and the new file is renamed over the path. Readers
therefore see one complete array or the next, never a write in progress (a
plain ``pwrite`` over the closing bracket is not enough: Linux lets a reader
see a write that spans pages cut at a page boundary), and a published file is
never changed again, so a reader that opened an older version finishes it
intact. A killed process loses at most the last interval of events.

Copying the whole array costs time that grows with the file, so the writer
waits at least 20 times as long as its last copy took: the copying stays
under about 5 % of one core however long the job runs, and a killed process
loses correspondingly more of its last events once the file is large
(copying 100 MB took 34 ms here, so a 0.7 s wait).

The engine calls a timeline unconditionally: while none is active it holds
:data:`NULL_TIMELINE`, whose methods do nothing at all.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import enum
import json
import logging
import os
import threading
import time
from datetime import timedelta
from types import TracebackType

from ._timeline_file import copy_prefix, link_tmpfile, new_file, pwrite_all

__all__ = ["ACTIVITIES", "NULL_TIMELINE", "OPS", "NullTimeline", "Timeline", "row_name"]

logger = logging.getLogger("hora.timeline")

# The longest close() waits for the writer thread to flush.
_CLOSE_TIMEOUT_S = 30.0

#: The collectives, by Horovod's names; ``op`` arguments take these or an enum
#: member whose ``name`` is one (e.g. ``hora._ops.OpType.ALLREDUCE``).
OPS = frozenset(
    {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER", "JOIN"}
)

#: Horovod's activity names the engine is expected to use. Any other string is
#: accepted too (it becomes the event name as is).
ACTIVITIES = frozenset(
    {"QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"}
    | {f"{plane}_{op}" for plane in ("GLOO", "NCCL") for op in OPS}
)

_CYCLE_ROW = 0
_CYCLE_EVENT = "CYCLE_START"
_TRAILER = b"\n]\n"
# The writer waits at least this many times as long as its last copy of the file took.
_COPY_TO_WAIT = 20

# Kinds of queued records. Per-row nesting is decided by the writer thread, in
# the order records were queued, so callers never take a lock.
_NEGOTIATE_START, _NEGOTIATE_END, _START, _END, _ACTIVITY_START, _ACTIVITY_END, _CYCLE = range(7)
_NEGOTIATE_PREFIX = "NEGOTIATE_"


def row_name(name: str, op: str) -> str:
    """The row of tensor ``name`` of collective ``op`` (one of :data:`OPS`), as Horovod names it.

    Horovod's framework layer prefixes every tensor name with its collective
    (``allreduce.<name>``; unnamed ones are ``allreduce.noname.<n>``). Names
    that already carry the prefix, as hora's generated names and
    ``DistributedOptimizer``'s ``allreduce.<parameter>`` do, stay as they are.
    """
    prefix = op.lower()
    if name.startswith((f"{prefix}.", f"grouped_{prefix}.")):
        return name
    return f"{prefix}.{name}"


def _op_name(op: str | enum.Enum) -> str:
    name = op.name if isinstance(op, enum.Enum) else op
    if name not in OPS:
        raise ValueError(f"unknown timeline op {op!r}; expected one of {sorted(OPS)}")
    return name


class NullTimeline:
    """A timeline that records nothing: what the engine holds while none is active.

    Every method returns at once without touching any state, so the engine can
    call them unconditionally on its hot path.
    """

    __slots__ = ()

    #: False: nothing is recorded (a class attribute: the engine reads it per tensor).
    active = False

    def negotiate_start(self, name: str, op: str | enum.Enum) -> None:
        """Does nothing."""

    def negotiate_end(self, name: str) -> None:
        """Does nothing."""

    def start(self, name: str, op: str | enum.Enum) -> None:
        """Does nothing."""

    def end(self, name: str) -> None:
        """Does nothing."""

    def activity_start(self, name: str, activity: str) -> None:
        """Does nothing."""

    def activity_end(self, name: str) -> None:
        """Does nothing."""

    def cycle_start(self) -> None:
        """Does nothing."""

    def close(self) -> None:
        """Does nothing."""


#: The shared do-nothing timeline.
NULL_TIMELINE = NullTimeline()


class Timeline:
    """Writes one rank's timeline to ``path`` while the engine runs.

    Every method is safe to call from any thread, costs one deque append while
    active, and is ignored after :meth:`close`. Per tensor row the events nest
    as Horovod's do::

        NEGOTIATE_ALLREDUCE            (negotiate_start .. negotiate_end)
        ALLREDUCE                      (start .. end)
          QUEUE, MEMCPY_IN_FUSION_BUFFER, GLOO_ALLREDUCE, ...
                                       (activity_start .. activity_end)

    Calls out of order never produce an unbalanced file: :meth:`start` and
    :meth:`negotiate_start` first end whatever is still open on the row,
    :meth:`end` ends an open activity too, an activity started while it
    already runs ends the previous one, and an ``*_end`` with nothing matching
    open (or an activity outside an op) is dropped.

    Args:
        path: The file to write; created or truncated.
        rank: This process's rank; the trace's ``pid``.
        mark_cycles: Record :meth:`cycle_start` markers (Horovod's
            ``--timeline-mark-cycles``).
        flush_interval: How often the writer thread writes what piled up; a
            killed process loses at most this much of the trace.
        max_pending: Records that may wait for the writer; beyond that, calls
            are dropped (and counted) rather than letting memory grow without
            bound when callers outrun the writer. Rows stay balanced anyway.

    Attributes:
        dropped: Calls dropped because ``max_pending`` records were waiting
            (approximate under contention; logged at close).

    Raises:
        OSError: ``path`` cannot be created or written.
        ValueError: ``flush_interval`` is not positive.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        rank: int,
        mark_cycles: bool = False,
        *,
        flush_interval: timedelta = timedelta(milliseconds=100),
        max_pending: int = 1 << 18,
    ) -> None:
        if flush_interval <= timedelta(0):
            raise ValueError(f"flush_interval must be positive, got {flush_interval}")
        self.path = os.fspath(path)
        self.rank = rank
        self.mark_cycles = mark_cycles
        self._interval_s = flush_interval.total_seconds()
        self._t0 = time.perf_counter_ns()
        # deque.append/popleft are atomic, so callers and the writer share it without a lock.
        self._queue: collections.deque[tuple[int, str, str, int]] = collections.deque()
        self._max_pending = max_pending
        self.dropped = 0
        self._closed = False
        self._wake = threading.Event()
        # Writer-thread state: rows by tensor name, open events per row (a stack).
        self._rows: dict[str, int] = {}
        self._open: dict[int, list[str]] = {}
        self._last_ts: dict[int, int] = {}  # per row, so its events never go back in time
        self._names: dict[str, str] = {}  # event name -> its JSON string, escaped once
        # Renaming over a symbolic link would replace the link, not the file it names.
        self._target = os.path.realpath(self.path)
        self._fd = -1  # the published file; none yet
        self._end = 0  # where its closing bracket starts: the next batch goes there
        self._wait_s = self._interval_s
        header = [
            self._meta("process_name", _CYCLE_ROW, {"name": f"rank {rank}"}),
            self._meta("process_sort_index", _CYCLE_ROW, {"sort_index": rank}),
        ]
        if mark_cycles:
            header.append(self._meta("thread_name", _CYCLE_ROW, {"name": _CYCLE_EVENT}))
        self._publish(("[\n" + ",\n".join(header)).encode())
        self._writer = threading.Thread(target=self._run, name=f"hora-timeline-{rank}", daemon=True)
        self._writer.start()
        # A script that never calls stop_timeline still gets its last events.
        atexit.register(self.close)

    # ---- the engine's calls -------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True until :meth:`close`."""
        return not self._closed

    def negotiate_start(self, name: str, op: str | enum.Enum) -> None:
        """``name`` began negotiation for ``op``: opens ``NEGOTIATE_<OP>`` on its row.

        Raises:
            ValueError: ``op`` is not one of :data:`OPS`.
        """
        if self._closed:
            return
        self._put(
            (_NEGOTIATE_START, name, _NEGOTIATE_PREFIX + _op_name(op), time.perf_counter_ns())
        )

    def negotiate_end(self, name: str) -> None:
        """Every rank is ready with ``name``: closes its ``NEGOTIATE_<OP>``."""
        if self._closed:
            return
        self._put((_NEGOTIATE_END, name, "", time.perf_counter_ns()))

    def start(self, name: str, op: str | enum.Enum) -> None:
        """The engine began executing ``op`` on ``name``: opens ``<OP>`` on its row.

        Raises:
            ValueError: ``op`` is not one of :data:`OPS`.
        """
        if self._closed:
            return
        self._put((_START, name, _op_name(op), time.perf_counter_ns()))

    def end(self, name: str) -> None:
        """``name`` is done: closes its open activity, then its ``<OP>``."""
        if self._closed:
            return
        self._put((_END, name, "", time.perf_counter_ns()))

    def activity_start(self, name: str, activity: str) -> None:
        """Opens ``activity`` (e.g. ``"QUEUE"``, ``"GLOO_ALLREDUCE"``) inside ``name``'s op."""
        if self._closed:
            return
        self._put((_ACTIVITY_START, name, activity, time.perf_counter_ns()))

    def activity_end(self, name: str) -> None:
        """Closes the activity open on ``name``'s row."""
        if self._closed:
            return
        self._put((_ACTIVITY_END, name, "", time.perf_counter_ns()))

    def cycle_start(self) -> None:
        """A ``CYCLE_START`` instant on the cycle row; ignored unless ``mark_cycles``."""
        if self._closed or not self.mark_cycles:
            return
        self._put((_CYCLE, "", _CYCLE_EVENT, time.perf_counter_ns()))

    def _put(self, record: tuple[int, str, str, int]) -> None:
        if len(self._queue) < self._max_pending:
            self._queue.append(record)
        else:
            self.dropped += 1

    def close(self) -> None:
        """Writes what is queued, ends every open event, closes the file. Idempotent.

        Calls racing with ``close`` from other threads are either written or
        dropped; the file stays a complete array either way.
        """
        atexit.unregister(self.close)
        self._closed = True
        self._wake.set()
        # Every closer waits, so none returns before the file is final; a
        # writer stuck in the file system (a full or hung disk) must not hold
        # up the process's exit for ever.
        if threading.current_thread() is not self._writer:
            self._writer.join(_CLOSE_TIMEOUT_S)
            if self._writer.is_alive():
                logger.warning("timeline %s: the writer did not finish within %g s; the "
                               "file may lack its last events", self.path, _CLOSE_TIMEOUT_S)

    def __enter__(self) -> Timeline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- the writer thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                self._wake.wait(self._wait_s)
                self._flush(final=False)
            self._flush(final=True)
            if self.dropped:
                logger.warning(
                    "timeline %s: dropped %d events the writer could not keep up with",
                    self.path,
                    self.dropped,
                )
        except OSError as exc:
            # A full disk must not take training down: stop recording, say so once.
            self._closed = True
            logger.warning("timeline %s: stopped recording: %s", self.path, exc)
        finally:
            os.close(self._fd)

    def _flush(self, final: bool) -> None:
        queue = self._queue
        events: list[str] = []
        # Only what is queued now: callers may keep appending while we drain.
        for _ in range(len(queue)):
            kind, name, event, ts = queue.popleft()
            self._apply(events, kind, name, event, ts)
        if final:
            ts = time.perf_counter_ns()
            for row, stack in self._open.items():
                while stack:
                    events.append(self._event("E", stack.pop(), row, ts))
        if events:
            self._publish((",\n" + ",\n".join(events)).encode())

    def _apply(self, out: list[str], kind: int, name: str, event: str, ts: int) -> None:
        if kind == _CYCLE:
            out.append(self._event("i", event, _CYCLE_ROW, ts, ',"s":"t"'))
            return
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._open[row] = []
            self._last_ts[row] = ts
            # The op is known from the first negotiation or start; a row that
            # begins otherwise (nothing of it will be written) keeps the bare name.
            label = name
            if kind == _NEGOTIATE_START:
                label = row_name(name, event[len(_NEGOTIATE_PREFIX):])
            elif kind == _START:
                label = row_name(name, event)
            out.append(self._meta("thread_name", row, {"name": label}))
            out.append(self._meta("thread_sort_index", row, {"sort_index": row}))
        # Two threads may stamp a tensor's calls in one order and queue them in the
        # other; a row's events must still be in time order for the viewers to nest them.
        ts = self._last_ts[row] = max(ts, self._last_ts[row])
        stack = self._open[row]
        if kind in (_NEGOTIATE_START, _START):
            while stack:
                out.append(self._event("E", stack.pop(), row, ts))
            stack.append(event)
            out.append(self._event("B", event, row, ts))
        elif kind == _ACTIVITY_START:
            if not stack or stack[0].startswith(_NEGOTIATE_PREFIX):
                return  # activities live inside an op
            if len(stack) > 1:
                out.append(self._event("E", stack.pop(), row, ts))
            stack.append(event)
            out.append(self._event("B", event, row, ts))
        elif kind == _NEGOTIATE_END:
            if len(stack) == 1 and stack[0].startswith(_NEGOTIATE_PREFIX):
                out.append(self._event("E", stack.pop(), row, ts))
        elif kind == _ACTIVITY_END:
            if len(stack) > 1:
                out.append(self._event("E", stack.pop(), row, ts))
        elif kind == _END:
            if stack and not stack[0].startswith(_NEGOTIATE_PREFIX):
                while stack:
                    out.append(self._event("E", stack.pop(), row, ts))

    def _event(self, phase: str, name: str, row: int, ts: int, extra: str = "") -> str:
        quoted = self._names.get(name)
        if quoted is None:
            quoted = self._names[name] = json.dumps(name)
        micros = (ts - self._t0) / 1000
        return (
            f'{{"name":{quoted},"ph":"{phase}","pid":{self.rank},"tid":{row},'
            f'"ts":{micros:.3f}{extra}}}'
        )

    def _meta(self, name: str, row: int, args: dict[str, object]) -> str:
        return json.dumps(
            {"name": name, "ph": "M", "pid": self.rank, "tid": row, "args": args},
            separators=(",", ":"),
        )

    def _publish(self, batch: bytes) -> None:
        """Renames over the path a new file: the published array with ``batch`` appended."""
        fd, named = new_file(self._target)
        try:
            # CPU time, not wall time: waiting for the GIL is no cost of the copy.
            started = time.thread_time()
            copy_prefix(self._fd, fd, self._end)
            self._wait_s = max(self._interval_s, _COPY_TO_WAIT * (time.thread_time() - started))
            pwrite_all(fd, batch + _TRAILER, self._end)
            if named is None:
                named = link_tmpfile(fd, self._target)
            os.rename(named, self._target)
        except BaseException:
            os.close(fd)
            if named is not None:
                with contextlib.suppress(OSError):
                    os.unlink(named)
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._end += len(batch)

