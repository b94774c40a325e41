"""What the coordinator holds for one job while it serves it: one object per job.

The job's state (:class:`~.state.Job`) is what the transitions decide on;
:class:`JobRuntime` adds what the service keeps beside it (store, waiting
calls, outboxes, lease, counts). Forgetting a job is deleting its runtime:
nothing of it is held anywhere else (the journal on disk and the departure
notices of the next check are forgotten by the coordinator, in one place).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hora_negotiation import SetCallKind
from hora_proto.v1 import rendezvous_pb2 as rpb

from . import state
from .errors import SupersededError
from .outbox import Outbox
from .store import KeyValueStore

_Key = TypeVar("_Key", bound=Hashable)

__all__ = ["Fingerprint", "JobRuntime", "Jobs", "fingerprint"]

Fingerprint = tuple[int, state.JobPhase, int, int, int]


def fingerprint(job: state.Job) -> Fingerprint:
    """What changes whenever a transition changes what the journal keeps of a job
    (every such transition records an event); its first item is the event count."""
    return (job.event_count, job.phase, job.generation, len(job.table.process_sets),
            job.host_update_epoch)


@dataclass(eq=False)
class JobRuntime:
    """Everything the coordinator holds for one job.

    Attributes:
        job: The job's state.
        store: Its key-value store.
        journaled: What the journal last saw of it (None: nothing yet).
        lease: Its lease, sized to the load at the last periodic check (None:
            the fastest).
        heartbeats: Heartbeats answered, by transport ("unary", "stream").
        messages_queued: Messages put on its members' outboxes.
        joins: Waiting Joins, by worker.
        set_calls: Waiting AddProcessSet / RemoveProcessSet calls, by worker and kind.
        outboxes: Each member's outbox, by worker.
        open_streams: Each open stream's outbox, by worker and generation.
        ended_since: When it was seen ended with nothing of it left (None: not).
    """

    job: state.Job
    store: KeyValueStore
    journaled: Fingerprint | None = None
    lease: state.Lease | None = None
    heartbeats: dict[str, int] = field(default_factory=dict)
    messages_queued: int = 0
    joins: dict[str, asyncio.Future[rpb.WorldView]] = field(default_factory=dict)
    set_calls: dict[tuple[str, SetCallKind], asyncio.Future[None]] = field(default_factory=dict)
    outboxes: dict[str, Outbox] = field(default_factory=dict)
    open_streams: dict[tuple[str, int], Outbox] = field(default_factory=dict)
    ended_since: float | None = None

    def held_outboxes(self) -> tuple[int, int]:
        """The outboxes held for its members, and the messages waiting in them."""
        return len(self.outboxes), sum(box.qsize() for box in self.outboxes.values())


class Jobs(MutableMapping[str, state.Job]):
    """The jobs by id (``Coordinator.jobs``): a view of the runtimes.

    Setting a job that is not held yet gives it a fresh runtime (a new store).
    """

    def __init__(self, runtimes: dict[str, JobRuntime],
                 new_store: Callable[[str], KeyValueStore]) -> None:
        self._runtimes = runtimes
        self._new_store = new_store

    def __getitem__(self, job_id: str) -> state.Job:
        return self._runtimes[job_id].job

    def get(self, job_id: str, default: state.Job | None = None) -> state.Job | None:  # type: ignore[override]
        runtime = self._runtimes.get(job_id)
        return default if runtime is None else runtime.job

    def __setitem__(self, job_id: str, job: state.Job) -> None:
        runtime = self._runtimes.get(job_id)
        if runtime is None:
            self._runtimes[job_id] = JobRuntime(job, self._new_store(job_id))
        else:
            runtime.job = job

    def __delitem__(self, job_id: str) -> None:
        del self._runtimes[job_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._runtimes)

    def __len__(self) -> int:
        return len(self._runtimes)


def new_waiter(waiters: dict[_Key, asyncio.Future[Any]], key: _Key,
               superseded: str) -> asyncio.Future[Any]:
    """A fresh waiter for ``key`` (a worker's Join or set call) in ``waiters``; the
    one it replaces, still waiting, fails with SupersededError(``superseded``)."""
    previous = waiters.pop(key, None)
    if previous is not None and not previous.done():
        previous.set_exception(SupersededError(superseded))
    waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    waiters[key] = waiter
    return waiter
