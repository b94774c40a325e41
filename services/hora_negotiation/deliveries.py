"""Numbered response lists, and re-sending those a rank missed (issue 28).

Every list the coordinator sends to all ranks of a process set gets the
set's next number (per generation, from 1). A rank runs each number once.
The coordinator can die after writing list N to some ranks' streams only:
the ranks that got it run the collective and never ask again, the others
send their requests again once they re-attach. To complete that step, a
worker that opens its stream again reports, per set, the last number it
received and its newest lists (``StreamOpen.received``). From the reports
(and, when it never went away, from its own record of what it sent) the
coordinator knows the newest number of each set and re-sends, in order,
every list a reporting rank lacks. It re-sends rather than re-decides: the
ranks that got list N are already running it, so only the very same list
(the same fusion, the same order) gives the same bits on every rank.

The request a rank sent again for a tensor that such a re-sent list answers
is stale: it is withdrawn from the table when it got there first, and
dropped when it arrives later (it carries ``resent`` and the number of the
last list the rank had received, which is below the re-sent one).

Pure logic: :class:`Deliveries` decides; :mod:`..state.streams` sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from .messages import ReceivedLists, ResponseList, TensorRequest

__all__ = ["HISTORY", "Deliveries", "Redelivery"]

#: Lists kept per process set for re-sending: the most one rank may lag.
HISTORY = 64


@dataclass
class _SetLog:
    last: int = 0
    lists: dict[int, ResponseList] = field(default_factory=dict)
    # Rank -> the newest number it is known to have; absent: not known (a
    # restarted coordinator learns it from the rank's report).
    holds: dict[int, int] = field(default_factory=dict)

    def keep(self, numbered: ResponseList) -> None:
        self.lists.setdefault(numbered.number, numbered)
        self.last = max(self.last, numbered.number)
        while len(self.lists) > HISTORY:
            del self.lists[min(self.lists)]


@dataclass(frozen=True)
class Redelivery:
    """Lists to send again to one rank, in order, or why they cannot be.

    Attributes:
        rank: The rank that lacks them.
        lists: The lists, numbered, oldest first (empty when ``lost`` is set).
        lost: The numbers no member holds any more (then nothing is re-sent).
    """

    rank: int
    lists: tuple[ResponseList, ...]
    lost: tuple[int, ...] = ()


class Deliveries:
    """The numbered lists of one generation's process sets."""

    def __init__(self) -> None:
        self._sets: dict[int, _SetLog] = {}
        # (rank, set, name) -> the number of the re-sent list that answered it
        # on that rank: a request for it sent before that list arrived is stale.
        self._answered: dict[tuple[int, int, str], int] = {}

    def number(self, process_set_id: int, ranks: Iterable[int],
               response_list: ResponseList) -> ResponseList:
        """``response_list`` numbered as the set's next list, sent to ``ranks``."""
        log = self._sets.setdefault(process_set_id, _SetLog())
        numbered = replace(response_list, number=log.last + 1)
        log.keep(numbered)
        for rank in ranks:
            log.holds[rank] = numbered.number
        return numbered

    def report(self, rank: int, member_of: Sequence[int],
               received: Iterable[ReceivedLists]) -> list[Redelivery]:
        """Takes what ``rank`` reports it received; what every reporting rank lacks.

        ``member_of`` are the sets the rank belongs to: one it reports nothing
        of, it has received no list of.
        """
        reported = {r.process_set_id: r for r in received}
        for set_id in {*member_of, *reported}:
            log = self._sets.setdefault(set_id, _SetLog())
            got = reported.get(set_id)
            if got is None:
                log.holds[rank] = 0
                continue
            log.holds[rank] = got.last_number
            log.last = max(log.last, got.last_number)
            for numbered in got.recent:
                if numbered.number > 0 and all(
                        r.process_set_id == set_id for r in numbered.responses):
                    log.keep(numbered)
        return self._catch_up()

    def _catch_up(self) -> list[Redelivery]:
        out: list[Redelivery] = []
        for set_id, log in self._sets.items():
            for rank, held in log.holds.items():
                if held >= log.last:
                    continue
                wanted = range(held + 1, log.last + 1)
                lost = tuple(n for n in wanted if n not in log.lists)
                log.holds[rank] = log.last
                if lost:
                    out.append(Redelivery(rank, (), lost))
                    continue
                lists = tuple(log.lists[n] for n in wanted)
                for numbered in lists:
                    for response in numbered.responses:
                        for name in response.tensor_names:
                            self._answered[(rank, set_id, name)] = numbered.number
                out.append(Redelivery(rank, lists))
        return out

    @property
    def watching(self) -> bool:
        """Whether some request may be stale (a re-sent list answered names)."""
        return bool(self._answered)

    def stale(self, rank: int, request: TensorRequest) -> bool:
        """Whether ``request`` from ``rank`` asks for a tensor a re-sent list
        already answered there (it was sent again before that list arrived)."""
        key = (rank, request.process_set_id, request.name)
        answered_by = self._answered.get(key)
        if answered_by is None:
            return False
        del self._answered[key]  # the next request of that name is a new step's
        return request.resent and request.received_list < answered_by
