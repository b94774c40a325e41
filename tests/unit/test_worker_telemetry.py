"""The worker's telemetry: step rates, lateness from the rounds' MIN, the summary."""

from __future__ import annotations

import time

import pytest

from hora.engine.agreement import ControlVector
from hora.engine.telemetry import LAST_SPREAD_US, ROUNDS_KEPT, Telemetry


def test_waits_agreed_by_min_give_each_rank_its_lateness_behind_the_first():
    # Rank 0 arrived first (waited 40 ms), rank 2 last (waited 0.1 ms).
    waits = [40_000, 25_000, 100]
    vectors = [ControlVector.of([2, 1], 0, True, wait_us=w, minus_wait_us=-w).encode()
               for w in waits]
    agreed = ControlVector.decode(ControlVector.agree(vectors))
    assert (agreed.wait_us, -agreed.minus_wait_us) == (100, 40_000)
    assert agreed.slots == [2, 1]
    per_rank = [Telemetry() for _ in waits]
    for t, own in zip(per_rank, waits, strict=True):
        t.round(own, -agreed.minus_wait_us, agreed.wait_us)
    summaries = [t.summary() for t in per_rank]
    assert [s.lateness_p50_ms for s in summaries] == [0.0, 15.0, 39.9]
    assert [s.last_arrivals for s in summaries] == [0, 0, 1]
    assert all(s.rounds == 1 for s in summaries)


def test_ranks_that_came_together_count_nobody_last():
    t = Telemetry()
    t.round(50, 50 + LAST_SPREAD_US - 1, 50)
    assert t.summary().last_arrivals == 0


def test_lateness_covers_the_last_rounds_only_and_resets_with_the_world():
    t = Telemetry()
    for _ in range(ROUNDS_KEPT):
        t.round(0, 10_000, 0)  # 10 ms late, last
    for _ in range(ROUNDS_KEPT):
        t.round(0, 0, 0)
    summary = t.summary()
    assert (summary.rounds, summary.lateness_p95_ms, summary.last_arrivals) == (ROUNDS_KEPT, 0, 0)
    t.new_world()
    assert t.summary().rounds == 0


def test_steps_rate_and_samples():
    t = Telemetry()
    assert t.summary().steps_per_s == 0
    for _ in range(11):
        t.step()
        time.sleep(0.02)
    summary = t.summary()
    assert summary.steps == 11
    assert 10 < summary.steps_per_s < 60, summary
    assert 0.015 < summary.last_step_s < 0.2
    t.set_batch_size(64)
    t.cache(3, 1)
    summary = t.summary()
    assert (summary.batch_size, summary.cache_hits, summary.cache_misses) == (64, 3, 1)


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_a_bad_batch_size_is_refused_and_the_old_one_kept(bad):
    t = Telemetry()
    t.set_batch_size(16)
    with pytest.raises(ValueError, match="batch size"):
        t.set_batch_size(bad)
    assert t.summary().batch_size == 16
