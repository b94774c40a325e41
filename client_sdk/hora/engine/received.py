"""The numbered response lists a rank received, for a coordinator that lost some.

The coordinator numbers the lists it sends to every rank of a process set
(``ResponseList.number``, per set and generation, from 1). It can die after
writing list N to some ranks only. When this rank opens a new stream after
re-attaching, it reports, per set, the last number it received and its
newest lists (``StreamOpen.received``); the coordinator then re-sends to each
rank the lists it lacks, taken from a rank that holds them. A list received
twice is run once (:meth:`ReceivedLog.first_time`). The requests this rank
sends again are marked with the last number it had, so that the coordinator
can tell one a re-sent list has since answered (:meth:`ReceivedLog.resent`).
"""

from __future__ import annotations

import logging
from collections import deque

from hora_proto.v1 import negotiation_pb2

__all__ = ["HISTORY", "REPORT_BYTES", "ReceivedLog"]

log = logging.getLogger("hora")

#: Newest lists kept per process set (the coordinator keeps as many).
HISTORY = 64
#: Most bytes of lists one report carries (the coordinator takes 4 MiB messages).
REPORT_BYTES = 1024 * 1024


class ReceivedLog:
    """The numbered lists one rank received in its generation, by process set.

    Not thread-safe: the negotiation reader thread alone uses it.
    """

    def __init__(self) -> None:
        self._last: dict[int, int] = {}
        self._recent: dict[int, deque[negotiation_pb2.ResponseList]] = {}

    def first_time(self, response_list: negotiation_pb2.ResponseList) -> bool:
        """Records a list; False when its number was received already (do not run it)."""
        number = response_list.number
        if not number:
            return True  # one rank's errors: not numbered
        set_id = response_list.responses[0].process_set_id if response_list.responses else 0
        if number <= self._last.get(set_id, 0):
            log.info("response list %d of process set %d came again; it ran already",
                     number, set_id)
            return False
        self._last[set_id] = number
        recent = self._recent.get(set_id)
        if recent is None:
            recent = self._recent[set_id] = deque(maxlen=HISTORY)
        recent.append(response_list)
        return True

    def report(self) -> list[negotiation_pb2.ReceivedLists]:
        """What a new stream's open reports: per set, the last number and the
        newest lists (up to :data:`REPORT_BYTES` in all), oldest first."""
        budget = REPORT_BYTES
        reports = []
        for set_id, last in self._last.items():
            lists: list[negotiation_pb2.ResponseList] = []
            for response_list in reversed(self._recent.get(set_id, ())):
                budget -= response_list.ByteSize()
                if budget < 0:
                    break
                lists.append(response_list)
            reports.append(negotiation_pb2.ReceivedLists(
                process_set_id=set_id, last_number=last, recent=lists[::-1]))
        return reports

    def resent(self, request: negotiation_pb2.TensorRequest) -> negotiation_pb2.TensorRequest:
        """A copy of ``request`` marked as sent again, after the last list of its set
        this rank received."""
        again = negotiation_pb2.TensorRequest()
        again.CopyFrom(request)
        again.resent = True
        again.received_list = self._last.get(request.process_set_id, 0)
        return again
