"""What the elastic planner is given and answers: its limits (the job's
elastic flags), the starts and events it decides, and Horovod's cooldown
backoff (see :mod:`.elastic`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from hora_proto.options import BY_FIELD

from .hosts import SlotInfo

__all__ = ["ElasticPolicy", "ReportEvent", "StartWorker", "cooldown_after"]


@dataclass(frozen=True)
class ElasticPolicy:
    """How an elastic job may grow and shrink, and where its hosts come from:
    what ``horarun``'s elastic flags say (:mod:`.args`) and the limits the
    planner runs under (one class for both).

    Attributes:
        min_np: fewest workers the job may run with.
        max_np: most workers it may run with (None: no limit; workers are
            then not told a maximum).
        discovery_script: shell command printing ``host[:slots]`` lines, or
            None when the hosts are the fixed ``-H`` / ``--hostfile`` list.
        slots_per_host: slots of a discovered host printed without ``:slots``.
        reset_limit: resets the job may go through (None: no limit).
        cooldown_range: ``(MIN, MAX)`` of a blacklisted host's cooldown, or
            None to blacklist for good.
        elastic_timeout: how long it may wait for, or stay below, ``min_np``;
            also how long the others get to finish once one has.
        num_proc: usable slots to wait for before the first workers start
            (then every usable slot up to ``max_np`` gets one, as in Horovod);
            None: ``min_np``.
    """

    min_np: int
    max_np: int | None = None
    discovery_script: str | None = None
    slots_per_host: int = 1
    reset_limit: int | None = None
    cooldown_range: tuple[timedelta, timedelta] | None = None
    elastic_timeout: timedelta = BY_FIELD["elastic_timeout"].default
    num_proc: int | None = None

    @property
    def start_count(self) -> int:
        """Usable slots the first start waits for (``num_proc``, else ``min_np``)."""
        return self.min_np if self.num_proc is None else self.num_proc


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
