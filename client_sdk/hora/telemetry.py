"""What a script may tell the dashboard beyond what hora sees by itself.

``hvd.DistributedOptimizer`` counts steps on its own. A script that steps
without it (a hand-written allreduce loop) calls :func:`report_step` once per
step; :func:`set_batch_size` lets the dashboard show samples per second.
Neither is part of Horovod's API; a Horovod script runs without them.
"""

from __future__ import annotations

from .engine.telemetry import TELEMETRY

__all__ = ["report_step", "set_batch_size"]


def set_batch_size(samples: int) -> None:
    """Samples this rank processes per step (its local batch size)."""
    TELEMETRY.set_batch_size(samples)


def report_step() -> None:
    """One training step done, for a loop that does not use ``DistributedOptimizer``."""
    TELEMETRY.step()
