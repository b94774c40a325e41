"""What a fixed-size ``horarun`` decides: start every rank, end at the first failure.

:class:`FixedPlanner` drives the :class:`.supervisor.Supervisor` for a job
without elastic flags. Every rank starts at once, in rank order. Output
lines carry the rank (``[0]<stdout>:``), and ``--output-filename`` writes
``DIR/rank.N/``.

The first worker to fail (or that cannot be started) decides the exit
code. The others get :data:`NOTICE_PERIOD` to fail on their own (a
survivor of a lost rank raises RankLostError naming it), then SIGTERM,
then SIGKILL after the grace period. When every worker exits 0, so does
the job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .supervisor import (
    Action,
    Exit,
    Finish,
    Say,
    Spawn,
    describe_exit,
    exit_code_of,
    plural,
)

__all__ = ["NOTICE_PERIOD", "FixedPlanner", "WorkerSpec"]

# After a worker fails, how long the others may take to fail on their own
# before SIGTERM: long enough for a survivor to report the RankLostError that
# names the lost rank, which is what the user needs to read.
NOTICE_PERIOD = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its rank, host, command and environment."""

    rank: int
    hostname: str
    argv: Sequence[str]
    env: Mapping[str, str]


class FixedPlanner:
    """The decisions of a fixed-size job, for a :class:`.supervisor.Supervisor`.

    Args:
        specs: the workers to start, in rank order.
    """

    kill_prefix = "rank "

    def __init__(self, specs: Sequence[WorkerSpec]) -> None:
        # A worker's id is its index here.
        self._specs = list(specs)
        self._spawned = False
        # The pids of the workers started and not yet exited, by id.
        self._running: dict[int, int] = {}
        self._succeeded = 0
        self._done = False

    def step(self, exits: Sequence[Exit]) -> list[Action]:
        """Every worker at the first call; after that, a failure or the end."""
        actions: list[Action] = []
        if not self._spawned:
            self._spawned = True
            actions += [Spawn(worker_id, spec.hostname, spec.argv, spec.env,
                              label=str(spec.rank), name=f"rank {spec.rank}",
                              output_name=f"rank.{spec.rank}")
                        for worker_id, spec in enumerate(self._specs)]
        for ended in exits:
            self._running.pop(ended.worker_id, None)
            if ended.returncode == 0:
                self._succeeded += 1
                continue
            spec = self._specs[ended.worker_id]
            actions += self._fail(exit_code_of(ended.returncode),
                                  f"rank {spec.rank} (pid {ended.pid}, host {spec.hostname}) "
                                  f"{describe_exit(ended.returncode)}")
        if not self._done and self._succeeded == len(self._specs):
            self._done = True
            actions.append(Finish(0))
        return actions

    def started(self, worker_id: int, pid: int) -> list[Action]:
        """Notes the worker as running."""
        self._running[worker_id] = pid
        return []

    def start_failed(self, worker_id: int, code: int, error: str) -> list[Action]:
        """A worker that cannot start fails the job like one that died."""
        spec = self._specs[worker_id]
        return self._fail(code, f"cannot start rank {spec.rank} on {spec.hostname}: {error}")

    def interrupted(self) -> None:
        """horarun got a signal: exits from here on are its doing."""
        self._done = True

    def _fail(self, code: int, what: str) -> list[Action]:
        """The first failure: say so, and stop everyone else after the notice period."""
        if self._done:
            # Already stopping: deaths from here on are our doing, or too late
            # to change the outcome.
            return []
        self._done = True
        others = len(self._running)
        message = f"{what}; stopping the other {plural(others, 'worker')}" if others else what
        return [Say(message), Finish(code, notice=NOTICE_PERIOD)]
