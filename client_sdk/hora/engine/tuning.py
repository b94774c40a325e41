"""Rank 0's fusion threshold and cycle time for the cached path, and their autotuning.

Rank 0 proposes both in every round's control vector and the others adopt
its values. With ``--autotune`` rank 0 feeds its tuner the bytes the rounds
reduced per window and moves to the tuner's next candidate.
"""

from __future__ import annotations

import logging
import time

from ..autotune import Autotuner
from ..settings import Settings

__all__ = ["CachedPathTuning"]

log = logging.getLogger("hora")


class CachedPathTuning:
    """The fusion threshold and cycle time a rank proposes, tuned on rank 0."""

    def __init__(self, settings: Settings, rank: int) -> None:
        self.threshold_kib = settings.fusion_threshold // 1024
        self.cycle_us = int(settings.cycle_time.total_seconds() * 1e6)
        self._tuner: Autotuner | None = None
        if settings.autotune and rank == 0:
            # Horovod's --autotune-warmup-samples / --autotune-bayes-opt-max-samples.
            limits: dict[str, int] = {key: value for key, value in (
                ("warmup_samples", settings.autotune_warmup_samples),
                ("max_candidates", settings.autotune_max_samples)) if value is not None}
            self._tuner = Autotuner(log_file=settings.autotune_log or None,
                                    initial=(settings.fusion_threshold,
                                             settings.cycle_time.total_seconds() * 1e3),
                                    **limits)  # type: ignore[arg-type]
        self._bytes = 0
        self._since = time.monotonic()

    def proposal(self) -> tuple[int, int]:
        """The fusion threshold (KiB) and cycle time (us) this rank proposes."""
        return self.threshold_kib, self.cycle_us

    def count(self, nbytes: int) -> None:
        """Bytes a round reduced on the cached path."""
        self._bytes += nbytes

    def step(self) -> None:
        """After a round: feeds the tuner one window of throughput (rank 0 with autotune)."""
        tuner = self._tuner
        if tuner is None:
            return
        elapsed = time.monotonic() - self._since
        if elapsed < 0.2 or tuner.done():
            return
        changed = tuner.record(self._bytes, elapsed)
        self._bytes, self._since = 0, time.monotonic()
        if changed:
            threshold, cycle_ms = tuner.current()
            self.threshold_kib = threshold // 1024
            self.cycle_us = int(cycle_ms * 1000)
        if tuner.done():
            threshold, cycle_ms, score = tuner.best()
            self.threshold_kib, self.cycle_us = threshold // 1024, int(cycle_ms * 1000)
            log.warning("autotune chose a fusion threshold of %g MiB and a cycle time of %g ms "
                        "(%.1f MB/s reduced)", threshold / 2**20, cycle_ms, score / 1e6)
