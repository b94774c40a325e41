"""Departure notices, coalesced: what keeps many members leaving at once O(members).

The transitions tell every remaining member of each departure (a MEMBER_LEFT
event per Leave). Delivered as they are, n members leaving one after another
would put about n^2/2 events on the streams. The coordinator instead notes
them here and delivers, at each periodic check, at most one MEMBER_LEFT per
member that is still active: the members that left since that member's last
notice, in one event (``Event.ranks``). A member that itself left in the
meantime hears nothing more. MEMBER_LEFT is informational (the tensors a
departure fails get their error responses at once, not through this path),
so a delay of one check interval costs nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

from hora_negotiation import format_ranks

from .messages import CoordinatorMessage, Event, EventType

__all__ = ["DepartureNotices", "is_departure"]


def is_departure(message: CoordinatorMessage) -> bool:
    """Whether ``message`` is a MEMBER_LEFT event (coalesced, delivered later)."""
    return message.event is not None and message.event.type is EventType.MEMBER_LEFT


class DepartureNotices:
    """Undelivered MEMBER_LEFT events of every job, and who has yet to hear of them.

    Memory and work are O(departures + recipients) per check interval: one
    list of events per job, and per recipient the index of the first event it
    has not heard of.
    """

    def __init__(self) -> None:
        self._events: dict[str, list[Event]] = {}
        self._first_unheard: dict[str, dict[str, int]] = {}

    def note(self, job_id: str, worker_ids: Iterable[str], event: Event) -> None:
        """Remembers that ``worker_ids`` should hear of ``event``."""
        events = self._events.setdefault(job_id, [])
        events.append(event)
        index = len(events) - 1
        unheard = self._first_unheard.setdefault(job_id, {})
        for worker_id in worker_ids:
            unheard.setdefault(worker_id, index)

    def forget(self, job_id: str) -> None:
        """Drops every notice of ``job_id``."""
        self._events.pop(job_id, None)
        self._first_unheard.pop(job_id, None)

    def take(
        self, still_listening: Callable[[str, str, int], bool]
    ) -> Iterator[tuple[str, tuple[str, ...], CoordinatorMessage]]:
        """Every notice due, one per recipient that is ``still_listening(job, worker,
        generation)``, grouped by message: ``(job_id, worker_ids, message)``, each
        message once (so it is encoded once); then forgets them all."""
        events_by_job, self._events = self._events, {}
        unheard_by_job, self._first_unheard = self._first_unheard, {}
        for job_id, unheard in unheard_by_job.items():
            events = events_by_job[job_id]
            # Recipients mostly share a start: one message per start.
            by_start: dict[int, list[str]] = {}
            for worker_id, start in unheard.items():
                if still_listening(job_id, worker_id, events[-1].generation):
                    by_start.setdefault(start, []).append(worker_id)
            for start, worker_ids in by_start.items():
                yield job_id, tuple(worker_ids), _coalesced(events[start:])


def _coalesced(events: list[Event]) -> CoordinatorMessage:
    """One MEMBER_LEFT event standing for ``events`` (the last one, when alone)."""
    last = events[-1]
    if len(events) == 1:
        return CoordinatorMessage(event=dataclasses.replace(last, ranks=(last.rank,)))
    ranks = tuple(e.rank for e in events)
    return CoordinatorMessage(
        event=dataclasses.replace(
            last,
            message=f"{len(events)} members left (ranks {format_ranks(ranks)}); "
            f"the last, rank {last.rank}: {last.message}",
            ranks=ranks,
        )
    )
