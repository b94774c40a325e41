"""Autotuning of the fusion threshold and cycle time from measured throughput.

In the spirit of Horovod's ``--autotune``: the engine reports, once per
measurement window, how many bytes it reduced and how long that took; the
tuner answers which ``(fusion_threshold_bytes, cycle_time_ms)`` to run next,
and after a fixed budget it freezes on the best setting it measured.

Horovod fits a Gaussian process (Bayesian optimisation). Over a grid this
small (8 thresholds x 6 cycle times) a coordinate descent is simpler,
deterministic and robust to noisy samples: starting from the default setting,
measure every threshold at the current cycle time, move to the best, measure
every cycle time at that threshold, move to the best, and so on until a full
pass over both axes improves nothing or ``max_candidates`` settings were
measured. Each setting is scored once, by the median of several windows, so
one slow window (a checkpoint, a data-loader hiccup) cannot mislead it. The
search can miss the optimum of a surface with a narrow diagonal ridge; the
throughput of real jobs is close to separable in these two settings.

Pure logic: no clock is read except the injectable ``clock`` for the log's
timestamps, and no I/O except the optional CSV log (Horovod's
``--autotune-log-file``). Not thread-safe: one engine thread drives it.
"""

from __future__ import annotations

import csv
import os
import statistics
import time
from collections.abc import Callable, Sequence

__all__ = ["CYCLE_TIMES_MS", "FUSION_THRESHOLDS", "LOG_COLUMNS", "Autotuner"]

MiB = 1024 * 1024

#: The fusion thresholds tried by default, in bytes (1 to 128 MiB).
FUSION_THRESHOLDS: tuple[int, ...] = tuple(m * MiB for m in (1, 2, 4, 8, 16, 32, 64, 128))
#: The cycle times tried by default, in milliseconds; 0 (hora's default) agrees
#: on whatever is ready at once.
CYCLE_TIMES_MS: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)
#: Header of the CSV log; one row per measured setting.
LOG_COLUMNS = ("timestamp", "fusion_threshold_bytes", "cycle_time_ms", "score", "best")

_Point = tuple[int, int]  # (threshold index, cycle time index)


class Autotuner:
    """Proposes fusion threshold and cycle time settings from measured throughput.

    Use: apply :meth:`current`, run one measurement window, :meth:`record` it;
    repeat. Once :meth:`done`, :meth:`current` stays at :meth:`best`.

    Windows counted by :meth:`record`: the first ``warmup_samples`` of the
    run are discarded (start-up is slower than steady state), then for each
    setting the first ``settle_samples`` (the window in which the setting
    changed mixes two settings), then ``samples_per_candidate`` are kept and
    their median bytes per second is the setting's score.

    Args:
        warmup_samples: Windows discarded at the start, as Horovod's
            ``--autotune-warmup-samples``.
        samples_per_candidate: Windows measured per setting.
        max_candidates: The budget: settings measured before freezing.
        log_file: CSV file written as settings are scored (header
            :data:`LOG_COLUMNS`; ``best`` is 1 when that row's setting is the
            best so far, so the last row with 1 is where the tuner froze).
            Truncated at construction.
        clock: Source of the log's timestamps.
        initial: The setting to start from; snapped to the nearest grid
            point. Default: hora's defaults, 128 MiB and 0 ms.
        fusion_thresholds: Grid of thresholds in bytes.
        cycle_times_ms: Grid of cycle times in milliseconds.
        settle_samples: Windows discarded after each change of setting.

    Raises:
        ValueError: A count is out of range or a grid is empty.
    """

    def __init__(
        self,
        warmup_samples: int = 3,
        samples_per_candidate: int = 5,
        max_candidates: int = 20,
        log_file: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        initial: tuple[int, float] = (128 * MiB, 0.0),
        fusion_thresholds: Sequence[int] = FUSION_THRESHOLDS,
        cycle_times_ms: Sequence[float] = CYCLE_TIMES_MS,
        settle_samples: int = 1,
    ) -> None:
        if warmup_samples < 0 or settle_samples < 0:
            raise ValueError("warmup_samples and settle_samples must be >= 0")
        if samples_per_candidate < 1:
            raise ValueError(f"samples_per_candidate must be >= 1, got {samples_per_candidate}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        if not fusion_thresholds or not cycle_times_ms:
            raise ValueError("the grids of thresholds and cycle times must not be empty")
        self._grid = (tuple(sorted(fusion_thresholds)), tuple(sorted(cycle_times_ms)))
        self._samples_per_candidate = samples_per_candidate
        self._settle_samples = settle_samples
        self._max_candidates = max_candidates
        self._log_file = os.fspath(log_file) if log_file is not None else None
        self._clock = clock
        self._warmup_left = warmup_samples
        self._scores: dict[_Point, float] = {}
        self._best: _Point | None = None
        start = (
            _nearest(self._grid[0], initial[0]),
            _nearest(self._grid[1], initial[1]),
        )
        # The line search in progress: the axis it walks, the points left on it,
        # and the best score when it began (did it improve anything?).
        self._axis = 0
        self._line: list[_Point] = []
        self._line_began_at: float | None = None
        self._fruitless_lines = 0
        self._samples: list[float] = []
        self._skip = 0  # the engine runs the first setting from the start: nothing to settle
        self._done = False
        self._start_line(start)
        self._current = self._line.pop(0)  # ``start`` itself, nearest to itself
        if self._log_file is not None:
            with open(self._log_file, "w", newline="") as f:
                csv.writer(f).writerow(LOG_COLUMNS)

    # ---- the engine's calls -------------------------------------------------------------

    def record(self, bytes_reduced: int, seconds: float) -> bool:
        """Reports one measurement window of the setting :meth:`current` returned.

        Args:
            bytes_reduced: Bytes the collectives processed in the window.
            seconds: How long the window lasted.

        Returns:
            True when :meth:`current` changed: apply the new setting.

        Raises:
            ValueError: ``seconds`` is not positive or ``bytes_reduced`` is negative.
        """
        if seconds <= 0:
            raise ValueError(f"seconds must be positive, got {seconds}")
        if bytes_reduced < 0:
            raise ValueError(f"bytes_reduced must be >= 0, got {bytes_reduced}")
        if self._done:
            return False
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        self._samples.append(bytes_reduced / seconds)
        if len(self._samples) < self._samples_per_candidate:
            return False
        before = self._current
        self._score(statistics.median(self._samples))
        return self._current != before

    def current(self) -> tuple[int, float]:
        """The setting to run now: ``(fusion_threshold_bytes, cycle_time_ms)``."""
        return self._setting(self._current)

    def done(self) -> bool:
        """True once the tuner froze on its best setting (converged or out of budget)."""
        return self._done

    def best(self) -> tuple[int, float, float]:
        """``(fusion_threshold_bytes, cycle_time_ms, score)`` of the best setting so far.

        The score is the median bytes per second; 0.0 before any setting was scored,
        when the setting is the one the tuner started from.
        """
        if self._best is None:
            return (*self._setting(self._current), 0.0)
        return (*self._setting(self._best), self._scores[self._best])

    # ---- the search ---------------------------------------------------------------------

    def _score(self, score: float) -> None:
        point = self._current
        self._scores[point] = score
        is_best = self._best is None or score > self._scores[self._best]
        if is_best:
            self._best = point
        self._log(point, score, is_best)
        self._samples = []
        if len(self._scores) >= self._max_candidates:
            self._freeze()
            return
        self._advance()

    def _advance(self) -> None:
        """Moves to the next unscored point of the line, or of the next line."""
        while True:
            if self._line:
                self._move(self._line.pop(0))
                return
            assert self._best is not None  # a line ends only after scoring its first point
            improved = self._line_began_at is None or self._scores[self._best] > self._line_began_at
            self._fruitless_lines = 0 if improved else self._fruitless_lines + 1
            if self._fruitless_lines >= 2:  # neither axis improves on the best: converged
                self._freeze()
                return
            self._axis = 1 - self._axis
            self._start_line(self._best)

    def _start_line(self, through: _Point) -> None:
        """Queues the unscored points on the current axis through ``through``, nearest first."""
        self._line_began_at = self._scores.get(self._best) if self._best is not None else None
        axis = self._axis
        points = []
        for i in range(len(self._grid[axis])):
            point = (i, through[1]) if axis == 0 else (through[0], i)
            if point not in self._scores:
                points.append(point)
        # Nearest first: if the budget runs out mid-line, the neighbourhood was explored.
        points.sort(key=lambda p: (abs(p[axis] - through[axis]), p[axis]))
        self._line = points

    def _move(self, point: _Point) -> None:
        if point != self._current:
            self._skip = self._settle_samples
        self._current = point

    def _freeze(self) -> None:
        self._done = True
        self._line = []
        if self._best is not None:
            self._current = self._best

    def _setting(self, point: _Point) -> tuple[int, float]:
        return self._grid[0][point[0]], self._grid[1][point[1]]

    def _log(self, point: _Point, score: float, is_best: bool) -> None:
        if self._log_file is None:
            return
        threshold, cycle_ms = self._setting(point)
        # Appended per row (a few dozen in a run), so a crash loses nothing written.
        with open(self._log_file, "a", newline="") as f:
            csv.writer(f).writerow(
                [f"{self._clock():.6f}", threshold, cycle_ms, f"{score:.6g}", int(is_best)]
            )


def _nearest(grid: tuple[float, ...], value: float) -> int:
    return min(range(len(grid)), key=lambda i: (abs(grid[i] - value), i))
