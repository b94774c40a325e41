"""Unit tests of coalesced departure notices (pure, no servers)."""

from __future__ import annotations

import pytest

from hora_coordinator.messages import Event, EventType
from hora_coordinator.notices import DepartureNotices

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def left(rank: int) -> Event:
    return Event(EventType.MEMBER_LEFT, generation=1, rank=rank, message="shutdown")


def test_notices_come_grouped_one_message_per_distinct_set_of_departures():
    notices = DepartureNotices()
    notices.note("job", ["a", "b", "gone"], left(5))
    notices.note("job", ["a", "b", "c"], left(4))
    taken = list(notices.take(lambda job_id, worker_id, generation: worker_id != "gone"))
    assert [(job, workers, m.event.ranks) for job, workers, m in taken] == [
        ("job", ("a", "b"), (5, 4)),
        ("job", ("c",), (4,)),
    ]
    assert list(notices.take(lambda *_: True)) == []
