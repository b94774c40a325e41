"""What the dashboard shows beyond membership: per-rank telemetry and a job's series.

Members fold a bounded summary of their training into the heartbeats they
already send (:class:`RankTelemetry`); the coordinator keeps the newest one
per member. Once a second it samples each running job into a bounded series
(:class:`Sample`): world size and generation, steps and samples per second,
and the negotiation messages per step, whose steady-state value is 0 (the
response cache keeps the coordinator off the hot path). Generations are
marked on that series as they form (:class:`GenerationMark`).

From those, :func:`stragglers` names the rank that most often arrives last at
the agreement rounds, and :func:`is_straggler` says whether that is more than
chance.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = [
    "SERIES_LENGTH",
    "GenerationMark",
    "RankTelemetry",
    "Sample",
    "Series",
    "StragglerSummary",
    "is_straggler",
    "job_rates",
    "stragglers",
]

#: Samples kept per job: 15 minutes at one a second.
SERIES_LENGTH = 900
#: Generation marks kept per job.
MARKS_LENGTH = 1000
# The window over which messages per step are counted (seconds).
_MESSAGES_WINDOW_S = 10.0
# A rank is a straggler when it arrives last this much more often than chance
# would have it (rounds where the ranks came together count nobody last, so
# without a straggler the shares stay below chance), and at least this late
# at the 95th percentile. A step holds several rounds and only the first may
# wait for a slow rank, so the median can stay small even for a straggler.
_LAST_OVER_CHANCE = 1.25
_LAST_SHARE_CAP = 0.6
_STRAGGLER_MIN_LATENESS_MS = 5.0


@dataclass(frozen=True)
class RankTelemetry:
    """A member's own summary, as its newest heartbeat carried it."""

    steps: int = 0
    last_step_s: float = 0.0
    steps_per_s: float = 0.0
    batch_size: int = 0
    rounds: int = 0
    lateness_p50_ms: float = 0.0
    lateness_p95_ms: float = 0.0
    last_arrivals: int = 0
    cache_hits: int = 0
    cache_misses: int = 0

    @property
    def samples_per_s(self) -> float | None:
        """Steps per second times the batch size, when the script said its batch size."""
        return self.steps_per_s * self.batch_size if self.batch_size > 0 else None

    @property
    def last_share(self) -> float:
        """Of the rounds counted, the share this rank arrived at last."""
        return self.last_arrivals / self.rounds if self.rounds > 0 else 0.0


@dataclass(frozen=True)
class Sample:
    """A running job, once a second."""

    unix_ms: int
    generation: int
    size: int
    steps: int  # the most steps any member has done
    steps_per_s: float
    samples_per_s: float | None
    negotiation_messages: int  # cumulative, as the job counts them
    messages_per_step: float | None  # over the last ten seconds; None without steps


@dataclass(frozen=True)
class GenerationMark:
    """A generation as it formed."""

    unix_ms: int
    generation: int
    size: int
    reset: bool


@dataclass
class Series:
    """A job's samples and generation marks, each bounded."""

    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=SERIES_LENGTH))
    marks: deque[GenerationMark] = field(default_factory=lambda: deque(maxlen=MARKS_LENGTH))

    def mark(self, now: float, generation: int, size: int, reset: bool) -> None:
        """Notes that ``generation`` formed with ``size`` members."""
        self.marks.append(GenerationMark(int(now * 1000), generation, size, reset))

    def sample(self, now: float, generation: int, size: int,
               telemetry: list[RankTelemetry], negotiation_messages: int) -> Sample:
        """Appends the job's state at ``now``, given its active members' telemetry."""
        steps_per_s, samples_per_s = job_rates(telemetry)
        steps = max((t.steps for t in telemetry), default=0)
        unix_ms = int(now * 1000)
        per_step: float | None = None
        since = self._window_start(unix_ms)
        if since is not None and steps > since.steps:
            per_step = (negotiation_messages - since.negotiation_messages) / (steps - since.steps)
        sample = Sample(unix_ms, generation, size, steps, steps_per_s, samples_per_s,
                        negotiation_messages, per_step)
        self.samples.append(sample)
        return sample

    def _window_start(self, unix_ms: int) -> Sample | None:
        """The oldest sample within the messages window (None if none)."""
        start = None
        for sample in reversed(self.samples):
            if unix_ms - sample.unix_ms > _MESSAGES_WINDOW_S * 1000:
                break
            start = sample
        return start

    @property
    def latest(self) -> Sample | None:
        """The newest sample, if any."""
        return self.samples[-1] if self.samples else None


def job_rates(telemetry: list[RankTelemetry]) -> tuple[float, float | None]:
    """A job's steps per second (its members step together: the median of theirs)
    and samples per second (the sum of theirs; None when no member said its batch)."""
    if not telemetry:
        return 0.0, None
    rates = sorted(t.steps_per_s for t in telemetry)
    samples = [s for s in (t.samples_per_s for t in telemetry) if s is not None]
    return rates[len(rates) // 2], (sum(samples) if samples else None)


@dataclass(frozen=True)
class StragglerSummary:
    """Which rank most often arrived last, and whether that is more than chance."""

    slowest_rank: int | None
    last_share: float
    lateness_p50_ms: float
    lateness_p95_ms: float
    rounds: int
    is_straggler: bool


def is_straggler(telemetry: RankTelemetry, size: int) -> bool:
    """Whether a rank arrives last clearly more often than its share, and late."""
    if size < 2 or telemetry.rounds == 0:
        return False
    needed = min(_LAST_SHARE_CAP, _LAST_OVER_CHANCE / size)
    return (telemetry.last_share > needed
            and telemetry.lateness_p95_ms >= _STRAGGLER_MIN_LATENESS_MS)


def stragglers(by_rank: dict[int, RankTelemetry], size: int) -> StragglerSummary:
    """The summary over the active ranks' telemetry (rank -> telemetry)."""
    counted = {rank: t for rank, t in by_rank.items() if t.rounds > 0}
    if not counted:
        return StragglerSummary(None, 0.0, 0.0, 0.0, 0, False)
    rank = max(counted, key=lambda r: (counted[r].last_share, counted[r].lateness_p95_ms))
    worst = counted[rank]
    return StragglerSummary(rank, worst.last_share, worst.lateness_p50_ms,
                            worst.lateness_p95_ms, worst.rounds, is_straggler(worst, size))
