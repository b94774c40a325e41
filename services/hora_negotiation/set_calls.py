"""Process set calls as collectives: every rank's call gathered, then one decision.

AddProcessSet and RemoveProcessSet are collectives: every rank of the
generation calls, each with its own view of the call (the set, and the
problem it found with its own call, if any). :class:`SetCalls` gathers the
calls, one gathering per kind; once every rank has called,
:func:`disagreement` says whether they may go ahead: not when some rank
reported a problem, nor when the ranks named different sets. The table
applies a call that may (:meth:`.table.NegotiationTable.call_process_set`),
and may still refuse the set. Whatever is decided answers every caller alike
(:class:`SetCallResult`).

A gathering can also end without every rank: a rank departed
(:meth:`SetCalls.abandon`), or the calls waited longer than the job's stall
shutdown time (:meth:`SetCalls.overdue`). The callers then fail with an error
that names the departed member, or the ranks that never called. Time the
coordinator itself stood still does not count (:meth:`SetCalls.shift`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import CallTimeoutError, CoordinatorError, RankGoneError
from .messages import Response
from .validation import QUOTE_LIMIT, clipped, format_ranks, listing

__all__ = [
    "NOT_ADDED",
    "SetCall",
    "SetCallKind",
    "SetCallResult",
    "SetCalls",
    "disagreement",
    "show_ranks",
]

#: ``RemoveProcessSetRequest.process_set_id`` of a rank that never added the set.
NOT_ADDED = -1

# An error message travels in a gRPC trailer, which holds some 8 KiB (past that
# the caller gets RESOURCE_EXHAUSTED instead of the error): it quotes each
# rank's text clipped and lists ranks within a budget (validation.clipped,
# validation.listing).


class SetCallKind(enum.Enum):
    """Which collective call; the value is the name messages give it (the user's call)."""

    ADD = "add_process_set"
    REMOVE = "remove_process_set"


@dataclass(frozen=True)
class SetCall:
    """One rank's call.

    Attributes:
        kind: Add or remove.
        rank: The caller's rank.
        process_set_id: The set; for a removal, :data:`NOT_ADDED` when the
            caller never added it.
        ranks: Add only: the set's ranks, as the caller sent them.
        invalid: The problem the caller found with its own call; empty if none.
    """

    kind: SetCallKind
    rank: int
    process_set_id: int
    ranks: tuple[int, ...] = ()
    invalid: str = ""

    def argument(self) -> tuple[int, tuple[int, ...]]:
        """What every rank's call must agree on."""
        return (self.process_set_id, self.ranks)

    def shown(self, with_id: bool) -> str:
        """The argument as messages show it; ``with_id``: name the id of an added set too."""
        if self.kind is SetCallKind.REMOVE:
            if self.process_set_id == NOT_ADDED:
                return "a set it never added"
            return f"process set {self.process_set_id}"
        ranks = show_ranks(self.ranks)
        return f"process set {self.process_set_id} {ranks}" if with_id else ranks


def show_ranks(ranks: Sequence[int]) -> str:
    """``[0, 2, 5]``, cut after :data:`~.validation.QUOTE_LIMIT` characters (ending in "…")."""
    text = "["
    for i, rank in enumerate(ranks):
        text += f", {rank}" if i else str(rank)
        if len(text) > QUOTE_LIMIT:
            return clipped(text)
    return text + "]"


@dataclass(frozen=True)
class SetCallResult:
    """What one call decided, for every rank whose call it answers.

    Attributes:
        kind: Add or remove.
        callers: The ranks it answers, ascending.
        error: Why every caller fails; None when the call succeeded.
        process_set_id: The set the call was about.
        changed: The call registered or removed a set (not a repeated one).
        ranks: The set's ranks, when an add succeeded.
        failed: A removal's error responses for the set's pending tensors,
            by recipient rank.
    """

    kind: SetCallKind
    callers: tuple[int, ...]
    error: CoordinatorError | None = None
    process_set_id: int = 0
    changed: bool = False
    ranks: tuple[int, ...] = ()
    failed: Mapping[int, list[Response]] = field(default_factory=dict)


def disagreement(calls: Sequence[SetCall]) -> str | None:
    """Why every rank's call fails before the set is even looked at; None if it need not.

    Some rank found a problem with its own call (each such rank is named with
    its text), or the ranks named different sets (every rank's set is named).
    The text stays a few KiB however many ranks there are: each rank's text is
    cut, and ranks past the first few KiB are only counted.

    Args:
        calls: Every rank's call of one kind, in rank order.
    """
    name = calls[0].kind.value
    invalid = [c for c in calls if c.invalid]
    if invalid:
        problems = (f"rank {c.rank}: {clipped(c.invalid)}" for c in invalid)
        return f"{name} failed on every rank because of " + listing(problems, len(invalid))
    if all(c.argument() == calls[0].argument() for c in calls):
        return None
    with_id = any(c.process_set_id != calls[0].process_set_id for c in calls)
    shown = listing((f"rank {c.rank}: {c.shown(with_id)}" for c in calls), len(calls))
    return f"ranks called {name} with different sets: {shown}"


@dataclass(eq=False)
class _Gathering:
    first_seen: float
    calls: dict[int, SetCall] = field(default_factory=dict)


class SetCalls:
    """The calls of one generation that wait for the other ranks, one gathering per kind.

    Args:
        size: The generation's world size: a gathering is complete when every
            rank in ``range(size)`` has called.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._gatherings: dict[SetCallKind, _Gathering] = {}

    def gather(self, call: SetCall, now: float) -> list[SetCall] | None:
        """Records ``call``; when it was the last one missing, every rank's call in rank order.

        A rank's second call of a kind replaces its first. A complete
        gathering is over: the next call of that kind starts a new one.
        """
        gathering = self._gatherings.get(call.kind)
        if gathering is None:
            gathering = self._gatherings[call.kind] = _Gathering(now)
        gathering.calls[call.rank] = call
        if len(gathering.calls) < self.size:
            return None
        del self._gatherings[call.kind]
        return [gathering.calls[rank] for rank in range(self.size)]

    def withdraw(self, kind: SetCallKind, rank: int) -> None:
        """Forgets ``rank``'s waiting call of ``kind`` (its caller gave up), if there is one."""
        gathering = self._gatherings.get(kind)
        if gathering is not None:
            gathering.calls.pop(rank, None)
            if not gathering.calls:
                del self._gatherings[kind]

    def abandon(self, reason: str) -> list[SetCallResult]:
        """Ends every gathering: they can never complete (``reason`` says why)."""
        results = [
            _failure(kind, gathering, RankGoneError(f"{kind.value} cannot complete: {reason}"))
            for kind, gathering in self._gatherings.items()
        ]
        self._gatherings.clear()
        return results

    def shift(self, stalled_s: float) -> None:
        """Moves every gathering's deadline on by ``stalled_s`` (the coordinator stalled)."""
        for gathering in self._gatherings.values():
            gathering.first_seen += stalled_s

    def overdue(self, now: float, limit_s: float) -> list[SetCallResult]:
        """Ends the gatherings whose first call is over ``limit_s`` old, naming who never called."""
        results = []
        for kind, gathering in list(self._gatherings.items()):
            if now - gathering.first_seen <= limit_s:
                continue
            del self._gatherings[kind]
            missing = [r for r in range(self.size) if r not in gathering.calls]
            error = CallTimeoutError(
                f"{kind.value} did not complete: rank(s) {format_ranks(missing)} did not call "
                f"it within {limit_s:g} s (the job's stall shutdown time)"
            )
            results.append(_failure(kind, gathering, error))
        return results


def _failure(kind: SetCallKind, gathering: _Gathering, error: CoordinatorError) -> SetCallResult:
    callers = tuple(sorted(gathering.calls))
    first = gathering.calls[callers[0]]
    return SetCallResult(kind, callers, error, first.process_set_id)
