"""The autotuner: finds a known optimum within its budget, freezes, logs, ignores warm-up."""

from __future__ import annotations

import csv
import itertools
import math
import random
from collections.abc import Callable

import pytest

from hora.autotune import CYCLE_TIMES_MS, FUSION_THRESHOLDS, LOG_COLUMNS, Autotuner

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MiB = 1024 * 1024
WINDOW_S = 0.5
Throughput = Callable[[int, float], float]


def peaked(best_mib: float, best_ms: float, peak: float = 8e9) -> Throughput:
    """Bytes/s that falls off smoothly in log space around (best_mib, best_ms)."""

    def throughput(threshold: int, cycle_ms: float) -> float:
        dt = math.log2(threshold / MiB) - math.log2(best_mib)
        # A cycle of 0 ms sits a step below the grid's smallest, 0.5 ms.
        dc = math.log2(max(cycle_ms, 0.25)) - math.log2(max(best_ms, 0.25))
        return peak * math.exp(-(dt**2) / 8) * math.exp(-(dc**2) / 4)

    return throughput


def drive(tuner: Autotuner, throughput: Throughput, noise: float = 0.0, seed: int = 0) -> int:
    """Runs windows until the tuner freezes; how many it took."""
    rng = random.Random(seed)
    for windows in itertools.count():
        if tuner.done():
            return windows
        assert windows < 10_000, "the tuner never froze"
        threshold, cycle_ms = tuner.current()
        rate = throughput(threshold, cycle_ms) * (1 + noise * rng.uniform(-1, 1))
        tuner.record(int(rate * WINDOW_S), WINDOW_S)
    raise AssertionError("unreachable")


def grid_optimum(throughput: Throughput) -> float:
    return max(throughput(t, c) for t in FUSION_THRESHOLDS for c in CYCLE_TIMES_MS)


@pytest.mark.parametrize(
    ("best_mib", "best_ms"),
    [(16, 2.0), (1, 10.0), (128, 0.5), (4, 1.0), (64, 5.0), (2, 0.0), (128, 0.0)],
)
def test_finds_a_known_optimum_within_its_budget_and_freezes(best_mib, best_ms):
    throughput = peaked(best_mib, best_ms)
    tuner = Autotuner()  # the defaults: 3 warm-up, 5 per candidate, 20 candidates
    windows = drive(tuner, throughput)
    threshold, cycle_ms, score = tuner.best()
    assert (threshold, cycle_ms) == (best_mib * MiB, best_ms)
    assert score == pytest.approx(throughput(threshold, cycle_ms), rel=1e-6)
    assert tuner.current() == (threshold, cycle_ms)
    # 3 warm-up windows, then per candidate 1 settling (not the first) + 5 measured.
    assert windows <= 3 + 20 * 6


def test_noisy_windows_still_land_within_a_few_percent_of_the_optimum():
    throughput = peaked(8, 2.0)
    for seed in range(5):
        tuner = Autotuner(samples_per_candidate=7)
        drive(tuner, throughput, noise=0.15, seed=seed)
        threshold, cycle_ms, _ = tuner.best()
        assert throughput(threshold, cycle_ms) >= 0.97 * grid_optimum(throughput), seed


def test_after_freezing_records_change_nothing(tmp_path):
    log = tmp_path / "autotune.csv"
    tuner = Autotuner(log_file=log)
    drive(tuner, peaked(16, 2.0))
    frozen, best, rows = tuner.current(), tuner.best(), log.read_text()
    for _ in range(50):
        assert tuner.record(10**12, 0.01) is False  # a window far better than anything seen
    assert (tuner.current(), tuner.best(), log.read_text()) == (frozen, best, rows)
    assert tuner.done()


def test_budget_is_the_number_of_settings_measured():
    tuner = Autotuner(warmup_samples=2, samples_per_candidate=3, max_candidates=4)
    windows = drive(tuner, peaked(1, 10.0))  # far from the start: still improving at 4
    assert windows == 2 + 3 + 3 * (1 + 3)
    # The first line walks the thresholds outward from 128 MiB at 0 ms.
    assert tuner.best()[:2] == (16 * MiB, 0.0)


def test_warmup_and_settling_windows_are_discarded():
    throughput = peaked(16, 2.0)
    tuner = Autotuner(warmup_samples=3, samples_per_candidate=2, max_candidates=2)
    for _ in range(3):  # start-up windows, wildly fast: must not count
        assert tuner.record(10**15, 0.001) is False
    first = tuner.current()
    rate = throughput(*first)
    tuner.record(int(rate), 1.0)
    assert tuner.record(int(rate), 1.0) is True  # scored; moved to the next setting
    second = tuner.current()
    assert second != first
    assert tuner.record(10**15, 0.001) is False  # the window in which the setting changed
    tuner.record(int(throughput(*second)), 1.0)
    tuner.record(int(throughput(*second)), 1.0)
    assert tuner.done()
    expected = max(rate, throughput(*second))
    assert tuner.best()[2] == pytest.approx(expected, rel=1e-6)


def test_one_slow_window_per_setting_does_not_mislead_the_median():
    throughput = peaked(32, 1.0)
    tuner = Autotuner(samples_per_candidate=5)
    windows = 0
    while not tuner.done():
        threshold, cycle_ms = tuner.current()
        rate = throughput(threshold, cycle_ms)
        if windows % 6 == 4:
            rate /= 100  # a checkpoint or data-loader stall
        tuner.record(int(rate * WINDOW_S), WINDOW_S)
        windows += 1
    assert tuner.best()[:2] == (32 * MiB, 1.0)


def test_log_file_has_a_row_per_measured_setting_and_marks_the_best(tmp_path):
    log = tmp_path / "autotune.csv"
    tuner = Autotuner(log_file=log, clock=itertools.count(1000).__next__)
    assert log.read_text().splitlines() == [",".join(LOG_COLUMNS)]
    throughput = peaked(16, 2.0)
    drive(tuner, throughput)
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == list(LOG_COLUMNS)
    settings = [(int(r["fusion_threshold_bytes"]), float(r["cycle_time_ms"])) for r in rows]
    assert len(set(settings)) == len(settings)  # each setting measured once
    assert settings[0] == (128 * MiB, 0.0)  # hora's defaults first
    assert [float(r["timestamp"]) for r in rows] == sorted(float(r["timestamp"]) for r in rows)
    for (threshold, cycle_ms), row in zip(settings, rows, strict=True):
        assert float(row["score"]) == pytest.approx(throughput(threshold, cycle_ms), rel=1e-5)
    best_rows = [s for s, r in zip(settings, rows, strict=True) if r["best"] == "1"]
    assert best_rows[-1] == tuner.best()[:2]
    assert rows[0]["best"] == "1"  # the first score is the best so far


def test_same_inputs_same_decisions(tmp_path):
    logs = []
    for i in range(2):
        log = tmp_path / f"run{i}.csv"
        tuner = Autotuner(log_file=log, clock=itertools.count().__next__)
        drive(tuner, peaked(4, 5.0), noise=0.1, seed=7)
        logs.append(log.read_text())
    assert logs[0] == logs[1]


def test_initial_setting_snaps_to_the_grid_and_custom_grids_work():
    tuner = Autotuner(initial=(20 * MiB, 1.7), fusion_thresholds=[8 * MiB, 16 * MiB, 32 * MiB])
    assert tuner.current() == (16 * MiB, 2.0)
    assert tuner.best() == (16 * MiB, 2.0, 0.0)  # nothing scored yet
    drive(tuner, peaked(32, 0.5))
    assert tuner.best()[:2] == (32 * MiB, 0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"warmup_samples": -1},
        {"samples_per_candidate": 0},
        {"max_candidates": 0},
        {"settle_samples": -1},
        {"fusion_thresholds": []},
        {"cycle_times_ms": ()},
    ],
)
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        Autotuner(**kwargs)


def test_bad_windows_are_refused():
    tuner = Autotuner()
    with pytest.raises(ValueError, match="seconds"):
        tuner.record(100, 0.0)
    with pytest.raises(ValueError, match="bytes_reduced"):
        tuner.record(-1, 1.0)
