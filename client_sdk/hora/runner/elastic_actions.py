"""What the elastic planner is given and answers: its limits, the starts and
events it decides, and Horovod's cooldown backoff (see :mod:`.elastic`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from .hosts import SlotInfo

__all__ = ["ElasticPolicy", "ReportEvent", "StartWorker", "cooldown_after"]


@dataclass(frozen=True)
class ElasticPolicy:
    """The limits an elastic job runs under.

    Attributes:
        num_proc: usable slots to wait for before the first workers start
            (then every usable slot up to ``max_np`` gets one, as in Horovod).
        min_np: fewest workers the job may run with.
        max_np: most workers it may run with (None: no limit).
        elastic_timeout: how long it may wait for, or stay below, ``min_np``;
            also how long the others get to finish once one has.
        cooldown_range: ``(MIN, MAX)`` of a blacklisted host's cooldown, or
            None to blacklist for good.
        reset_limit: resets the job may go through (None: no limit).
    """

    num_proc: int
    min_np: int
    max_np: int | None = None
    elastic_timeout: timedelta = timedelta(seconds=600)
    cooldown_range: tuple[timedelta, timedelta] | None = None
    reset_limit: int | None = None


@dataclass(frozen=True)
class StartWorker:
    """Start a worker on ``host``'s slot ``slot``.

    ``announce`` is False for the workers of the initial start, which are
    not news; True for replacements and workers on new hosts. ``placement``
    is the slot's place in the assignment the worker starts in (None only
    where a caller builds one by hand).
    """

    worker_id: int
    host: str
    slot: int
    announce: bool = False
    placement: SlotInfo | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """``host:slot``, what prefixes the worker's output."""
        return f"{self.host}:{self.slot}"


@dataclass(frozen=True)
class ReportEvent:
    """Record an event in the job's event log at the coordinator."""

    kind: str
    host: str
    message: str


def cooldown_after(failures: int, low: float, high: float, draw: float) -> float:
    """Seconds a host sits out after its ``failures``-th failure (1 for the first).

    Horovod's backoff: ``low * 2**failures`` plus ``draw * low`` (``draw`` in
    ``[0, 1)``), held within ``[low, high]``.
    """
    return max(low, min(high, low * 2 ** failures + draw * low))
