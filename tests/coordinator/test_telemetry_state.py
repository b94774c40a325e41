"""The coordinator's side of telemetry: series, messages per step, stragglers, clamping."""

from __future__ import annotations

import math

from hora_coordinator import wire
from hora_coordinator.state.telemetry import RankTelemetry, Series, is_straggler, stragglers
from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb


def test_messages_per_step_over_the_window_reach_zero_in_steady_state():
    series = Series()
    ranks = [RankTelemetry(steps=0, steps_per_s=10.0, batch_size=8)]
    first = series.sample(100.0, 1, 1, ranks, negotiation_messages=5)
    assert first.messages_per_step is None  # no step yet
    # 10 steps, 5 more messages: the first steps negotiate.
    s = series.sample(101.0, 1, 1, [RankTelemetry(steps=10, steps_per_s=10.0)], 10)
    assert s.messages_per_step == 0.5
    # Then 11 s of cached steps: the window no longer holds the negotiating ones.
    for second in range(2, 14):
        s = series.sample(100.0 + second, 1, 1,
                          [RankTelemetry(steps=10 * second, steps_per_s=10.0)], 10)
    assert s.messages_per_step == 0.0
    assert s.samples_per_s is None and s.steps_per_s == 10.0


def test_job_rates_take_the_median_step_rate_and_sum_samples():
    series = Series()
    ranks = [RankTelemetry(steps_per_s=r, batch_size=b) for r, b in ((9, 4), (10, 4), (30, 0))]
    s = series.sample(1.0, 1, 3, ranks, 0)
    assert s.steps_per_s == 10
    assert s.samples_per_s == 9 * 4 + 10 * 4


def test_the_rank_most_often_last_and_late_is_the_straggler():
    calm = RankTelemetry(rounds=100, last_arrivals=20, lateness_p50_ms=0.2, lateness_p95_ms=1)
    slow = RankTelemetry(rounds=100, last_arrivals=70, lateness_p50_ms=2, lateness_p95_ms=50)
    summary = stragglers({0: calm, 1: calm, 2: slow}, 3)
    assert (summary.slowest_rank, summary.is_straggler) == (2, True)
    # Last as often as chance, or last but never late: nobody is a straggler.
    assert not is_straggler(RankTelemetry(rounds=100, last_arrivals=34,
                                          lateness_p95_ms=50), 3)
    assert not is_straggler(RankTelemetry(rounds=100, last_arrivals=90,
                                          lateness_p95_ms=0.5), 3)
    assert stragglers({}, 3).slowest_rank is None


def test_telemetry_off_the_wire_is_clamped():
    request = rpb.HeartbeatRequest(telemetry=rpb.RankTelemetry(
        steps=-5, steps_per_s=math.nan, last_step_s=-1, lateness_p95_ms=math.inf,
        rounds=10, last_arrivals=99, batch_size=1 << 62))
    t = wire.rank_telemetry(request)
    assert t is not None
    assert (t.steps, t.steps_per_s, t.last_step_s) == (0, 0.0, 0.0)
    assert t.lateness_p95_ms == 1e12 and t.last_arrivals == 10 and t.batch_size == 1 << 53
    assert wire.rank_telemetry(rpb.HeartbeatRequest()) is None
    assert wire.rank_telemetry(npb.StreamHeartbeat(sequence=1)) is None
