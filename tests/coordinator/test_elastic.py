"""Unit tests of elastic jobs: new generations instead of failure (pure transitions, fake clock)."""

from __future__ import annotations

import pytest
from coordinator_transitions import admits, events_to, form, jreq, responses_to, submit, treq

from hora_coordinator import state, wire
from hora_coordinator.errors import (
    InvalidRequestError,
    JobFailedError,
    StaleGenerationError,
)
from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

LEASE = 2.0
ELASTIC = {"min_size": 2, "max_size": 3, "elastic_timeout_ms": 10_000}


def elastic_job(size: int = 3, hosts=None, **bounds) -> state.Job:
    """A running elastic job of ``size`` members w0..w{size-1}, ranked by worker number."""
    config = {**ELASTIC, **bounds}
    return form(size, hosts=hosts, hints=list(range(size)), **config)


def rejoin(job: state.Job, worker: str, now: float, host: str = "h", **config):
    """A member's elastic reset: Leave(rejoin=True), then Join (any rank, same worker id)."""
    state.leave(job, worker, "reset", now, rejoin=True)
    return state.join(job, jreq(worker, 3, host, **{**ELASTIC, **config}), now)


def kinds(job: state.Job) -> list[str]:
    return [e.kind for e in job.events]


def ranks(views) -> dict[str, int]:
    return {worker: view.rank for worker, view in views.items()}


def failure_of(effects) -> str:
    (reject,) = [e for e in effects if isinstance(e, state.Reject)]
    assert isinstance(reject.error, JobFailedError)
    return str(reject.error)


# ---- loss opens a new generation ---------------------------------------------------------


def test_loss_tells_survivors_and_the_next_round_keeps_them_in_old_rank_order():
    # Hosts sort the other way round, so only the old ranks explain the new order.
    job = elastic_job(3, hosts=["z", "y", "x"])
    effects = state.stream_closed(job, "w1", 1, 1.0)
    for worker in ("w0", "w2"):
        (lost,) = events_to(effects, worker)  # MEMBER_LOST and no JOB_FAILED
        assert (lost.type, lost.rank, lost.message) == (
            npb.EVENT_TYPE_MEMBER_LOST,
            1,
            "stream closed",
        )
    assert job.phase is state.JobPhase.GATHERING
    assert job.members[1].state is state.MemberState.LOST
    assert job.round is not None and job.round.expected == {"w0", "w2"}
    # A survivor leaves the ended generation, then closes its stream: no loss.
    state.leave(job, "w0", "reset", 1.1, rejoin=True)
    assert state.stream_closed(job, "w0", 1, 1.1) == []
    assert state.join(job, jreq("w2", 3, "x", **ELASTIC), 2.0) == []
    views = admits(rejoin(job, "w0", 2.5, "z"))
    assert ranks(views) == {"w0": 0, "w2": 1}
    assert {(v.generation, v.size, v.store_prefix) for v in views.values()} == {
        (2, 2, "job/gen-2/")
    }
    assert [m.worker_id for m in views["w0"].members] == ["w0", "w2"]
    assert job.phase is state.JobPhase.RUNNING and job.reset_count == 1
    assert job.failure == ""


def test_a_member_whose_stream_closes_before_it_re_joined_is_lost_at_once():
    # A peer's data plane noticed w1's death first: w2 reset, ending generation 1,
    # before w1's stream closed. w1 is lost then, not a lease later, and the round
    # forms without it as soon as the others are back.
    job = elastic_job(3)
    state.leave(job, "w2", "reset", 1.0, rejoin=True)
    assert job.phase is state.JobPhase.GATHERING and job.round.expected == {"w0", "w1", "w2"}
    state.join(job, jreq("w2", 3, **ELASTIC), 1.1)
    assert state.stream_closed(job, "w1", 1, 1.2) != []
    assert (job.members[1].state, job.members[1].cause) == (state.MemberState.LOST,
                                                            "stream closed")
    assert job.round.expected == {"w0", "w2"}
    assert kinds(job)[-1] == "lost" and job.events[-1].pid == job.members[1].pid
    # A survivor's old stream closing after it re-joined is no loss either.
    assert state.stream_closed(job, "w2", 1, 1.3) == []
    views = admits(rejoin(job, "w0", 1.4))
    assert ranks(views) == {"w0": 0, "w2": 1} and job.generation == 2


def test_lease_expiry_in_a_running_elastic_generation_opens_a_round():
    job = elastic_job(3)
    state.heartbeat(job, "w0", 2.0, LEASE)
    state.heartbeat(job, "w1", 2.0, LEASE)
    effects = state.check(job, 2.5, LEASE)
    assert job.members[2].state is state.MemberState.LOST
    assert job.members[2].cause == "lease expired (no heartbeat for 2.5 s)"
    assert [e.type for e in events_to(effects, "w0")] == [npb.EVENT_TYPE_MEMBER_LOST]
    assert job.phase is state.JobPhase.GATHERING


def test_old_generation_is_refused_after_the_loss():
    job = elastic_job(3)
    submit(job, 0, treq("a"))
    state.stream_closed(job, "w1", 1, 1.0)
    assert job.table.pending == {}
    late = submit(job, 0, treq("b"), now=1.5)
    assert "generation 1 of job 'job' is over" in responses_to(late, "w0")[0].error_message
    with pytest.raises(StaleGenerationError):
        state.open_stream(job, "w0", 1, 1.5)


# ---- leave with rejoin --------------------------------------------------------------------


def test_leave_with_rejoin_ends_the_generation_without_a_loss():
    job = elastic_job(2, min_size=1)
    submit(job, 0, treq("a"))
    effects = state.leave(job, "w1", "reset", 1.0, rejoin=True)
    (error,) = responses_to(effects, "w0")
    assert error.error_message == (
        "tensor 'a' cannot complete: rank 1 (host h, pid 102) left for an elastic reset"
    )
    assert [e.type for e in events_to(effects, "w0")] == [npb.EVENT_TYPE_MEMBER_LEFT]
    leaver = job.members[1]
    assert (leaver.state, leaver.rejoin) == (state.MemberState.LEFT, True)
    assert job.phase is state.JobPhase.GATHERING
    assert state.stream_closed(job, "w1", 1, 1.1) == []
    assert state.leave(job, "w0", "reset", 1.2, rejoin=True) == []
    assert state.join(job, jreq("w1", 2, **ELASTIC, hint=-1), 1.5) == []
    views = admits(state.join(job, jreq("w0", 2, **ELASTIC), 1.6))
    assert ranks(views) == {"w0": 0, "w1": 1}
    assert kinds(job)[-5:] == ["reset", "reset", "join", "join", "generation"]


def test_leave_with_rejoin_in_a_non_elastic_job_is_a_plain_leave():
    job = form(2)
    effects = state.leave(job, "w1", "reset", 1.0, rejoin=True)
    assert [e.type for e in events_to(effects, "w0")] == [npb.EVENT_TYPE_MEMBER_LEFT]
    assert job.phase is state.JobPhase.RUNNING and not job.members[1].rejoin


def test_every_member_leaving_without_rejoin_finishes_an_elastic_job():
    job = elastic_job(2, min_size=1)
    state.leave(job, "w0", "done", 1.0)
    assert job.phase is state.JobPhase.RUNNING  # w1 trains on alone
    state.leave(job, "w1", "done", 2.0)
    assert job.phase is state.JobPhase.FINISHED
    assert kinds(job)[-3:] == ["left", "left", "finished"]


def test_a_survivor_leaving_for_good_between_generations_is_no_longer_expected():
    job = elastic_job(3, min_size=1)
    state.stream_closed(job, "w1", 1, 1.0)
    state.leave(job, "w2", "done", 1.1)
    views = admits(rejoin(job, "w0", 1.2))
    assert ranks(views) == {"w0": 0}
    state.leave(job, "w0", "done", 2.0)
    assert job.phase is state.JobPhase.FINISHED


# ---- min_size, elastic timeout, leases between generations -----------------------------


def test_round_waits_for_min_size_then_a_newcomer_completes_it():
    job = elastic_job(3)
    state.stream_closed(job, "w1", 1, 1.0)
    state.leave(job, "w2", "done", 1.0)  # finishes on purpose: not expected any more
    assert rejoin(job, "w0", 1.5) == []  # 1 < min_size 2
    assert state.check(job, 5.0, LEASE) == []
    views = admits(state.join(job, jreq("n", 3, host="a", **ELASTIC), 6.0))
    assert ranks(views) == {"w0": 0, "n": 1}  # the newcomer after the survivor


def test_elastic_timeout_fails_the_job_naming_expected_and_joined_counts():
    job = elastic_job(3)
    state.stream_closed(job, "w1", 1, 1.0)
    state.leave(job, "w2", "done", 1.0)
    rejoin(job, "w0", 1.5)
    assert state.check(job, 10.9, 100.0) == []
    effects = state.check(job, 11.1, 100.0)
    message = (
        "elastic job 'job': only 1 worker(s) joined within 10 s; at least 2 required (min_size)"
    )
    assert job.phase is state.JobPhase.FAILED and job.failure == message
    assert message in failure_of(effects)
    assert kinds(job)[-1] == "failed"
    with pytest.raises(JobFailedError, match="only 1 worker"):
        state.join(job, jreq("late", 3, **ELASTIC), 12.0)


def test_member_dying_between_generations_is_dropped_from_the_expectation():
    job = elastic_job(3, min_size=1)
    state.stream_closed(job, "w1", 1, 1.0)
    state.leave(job, "w2", "reset", 1.2, rejoin=True)  # a fresh lease from 1.2
    assert state.join(job, jreq("w0", 3, **ELASTIC), 1.5) == []
    assert state.check(job, 3.0, LEASE) == []  # w2 silent for 1.8 s: still awaited
    dying = job.members[2]
    effects = state.check(job, 3.3, LEASE)
    assert dying.state is state.MemberState.LOST
    assert dying.cause == "lease expired (no heartbeat for 2.1 s)"
    views = admits(effects)
    assert ranks(views) == {"w0": 0} and views["w0"].generation == 2
    lost = [e for e in job.events if e.kind == "lost"]
    assert [(e.rank, e.message.split(" (")[0]) for e in lost] == [
        (1, "stream closed"),
        (2, "lease expired"),
    ]


def test_heartbeats_between_generations_keep_a_resetting_member_alive():
    job = elastic_job(2, min_size=1)
    state.leave(job, "w1", "reset", 1.0, rejoin=True)
    state.leave(job, "w0", "reset", 1.0, rejoin=True)
    state.join(job, jreq("w0", 2, **ELASTIC), 1.5)
    beat = state.heartbeat(job, "w1", 2.5, LEASE)
    assert beat.job_state == rpb.JOB_STATE_GATHERING and beat.generation == 1
    assert state.check(job, 4.0, LEASE) == []  # silent 1.5 s since its heartbeat
    assert ranks(admits(state.join(job, jreq("w1", 2, **ELASTIC), 4.1))) == {"w0": 0, "w1": 1}


def test_cancelled_join_of_a_survivor_keeps_it_expected_for_a_lease():
    job = elastic_job(3)
    state.stream_closed(job, "w2", 1, 1.0)
    state.join(job, jreq("w0", 3, **ELASTIC), 1.5)
    state.cancel_join(job, "w0", 5.0)  # its Join deadline passed; the round waits on
    assert job.round is not None and job.round.expected == {"w0", "w1"}
    state.heartbeat(job, "w1", 6.0, LEASE)
    assert state.check(job, 6.9, LEASE) == []
    state.check(job, 7.1, LEASE)
    assert job.members[0].state is state.MemberState.LOST
    assert job.round.expected == {"w1"}


# ---- growing -------------------------------------------------------------------------------


def test_newcomer_while_running_bumps_the_epoch_and_joins_after_the_survivors():
    job = elastic_job(2, hosts=["b", "b"], min_size=1)
    assert admits(state.join(job, jreq("n", 2, host="a", **ELASTIC), 1.0)) == {}
    beat = state.heartbeat(job, "w0", 1.1, LEASE)
    assert (beat.host_update_epoch, beat.removals_only) == (1, False)
    assert beat.job_state == rpb.JOB_STATE_RUNNING
    assert state.join(job, jreq("n", 2, host="a", **ELASTIC), 1.2) == []  # a retry: no bump
    assert job.host_update_epoch == 1
    effects = state.leave(job, "w0", "reset", 2.0, rejoin=True)
    assert [e.type for e in events_to(effects, "w1")] == [npb.EVENT_TYPE_MEMBER_LEFT]
    assert rejoin(job, "w1", 2.1, "b") == []
    views = admits(state.join(job, jreq("w0", 2, host="b", **ELASTIC), 2.2))
    assert ranks(views) == {"w0": 0, "w1": 1, "n": 2}
    assert views["n"].size == 3 and views["n"].generation == 2
    assert [(m.host, m.local_rank) for m in views["n"].members] == [("b", 0), ("b", 1), ("a", 0)]
    assert kinds(job).count("join_waiting") == 1 and job.reset_count == 1


def test_world_views_carry_the_epoch_of_their_forming_so_a_prompt_newcomer_is_not_missed():
    # A container that starts just after a generation formed joins before the members'
    # first heartbeat: the members must still see its epoch as new.
    job = elastic_job(2, min_size=1, max_size=4)
    bounds = {"min_size": 1, "max_size": 4}
    state.join(job, jreq("n1", 2, **ELASTIC | bounds), 1.0)
    state.leave(job, "w0", "reset", 2.0, rejoin=True)
    state.join(job, jreq("w0", 2, **ELASTIC | bounds), 2.1)
    state.leave(job, "w1", "reset", 2.0, rejoin=True)
    views = admits(state.join(job, jreq("w1", 2, **ELASTIC | bounds), 2.2))
    assert {v.host_update_epoch for v in views.values()} == {1}  # n1's change is in
    assert wire.world_view_pb(views["n1"]).host_update_epoch == 1
    state.join(job, jreq("n2", 2, **ELASTIC | bounds), 2.25)  # before any heartbeat
    beat = state.heartbeat(job, "w0", 2.3, LEASE)
    assert beat.host_update_epoch == 2 > views["w0"].host_update_epoch


def test_newcomer_at_max_size_waits_without_an_epoch_bump_and_joins_a_later_round():
    job = elastic_job(2, min_size=1, max_size=2)
    bounds = {"min_size": 1, "max_size": 2}
    state.join(job, jreq("n1", 2, **ELASTIC | bounds), 1.0)
    state.join(job, jreq("n2", 2, **ELASTIC | bounds), 1.1)
    assert job.host_update_epoch == 0
    state.stream_closed(job, "w1", 1, 2.0)
    views = admits(state.join(job, jreq("w0", 2, **ELASTIC | bounds), 2.5))
    assert ranks(views) == {"w0": 0, "n1": 1}  # max_size 2: survivors first, then by arrival
    assert job.round is not None and set(job.round.joiners) == {"n2"}
    state.stream_closed(job, "n1", 2, 3.0)
    views = admits(state.join(job, jreq("w0", 2, **ELASTIC | bounds), 3.5))
    assert ranks(views) == {"w0": 0, "n2": 1} and views["w0"].generation == 3
    assert job.reset_count == 2 and job.round is None


def test_worker_joining_while_the_round_forms_just_joins_it():
    job = elastic_job(3)
    state.stream_closed(job, "w2", 1, 1.0)
    state.join(job, jreq("w1", 3, **ELASTIC), 1.1)
    assert state.join(job, jreq("n", 3, **ELASTIC), 1.2) == []
    assert job.host_update_epoch == 0
    views = admits(state.join(job, jreq("w0", 3, **ELASTIC), 1.3))
    assert ranks(views) == {"w0": 0, "w1": 1, "n": 2}


# ---- the first round ---------------------------------------------------------------------


def test_first_round_waits_for_the_launched_size_then_settles_when_arrivals_stop():
    job = state.new_job("job", 0.0)
    state.join(job, jreq("a", 3, **ELASTIC), 0.0)
    assert state.join(job, jreq("b", 3, **ELASTIC), 0.5) == []  # min_size there, 3 launched
    assert state.check(job, 1.9, LEASE) == []
    # Workers launched together may arrive seconds apart on a busy machine:
    # the round settles once none has come for NEWCOMER_GATHER_LEASES leases.
    settle = 0.5 + state.NEWCOMER_GATHER_LEASES * LEASE
    assert state.check(job, settle - 0.1, LEASE) == []
    views = admits(state.check(job, settle + 0.1, LEASE))
    assert ranks(views) == {"a": 0, "b": 1} and job.reset_count == 0


def test_first_round_forms_at_once_with_the_launched_size_and_honours_hints_as_order():
    job = state.new_job("job", 0.0)
    state.join(job, jreq("a", 2, host="a", hint=1, **ELASTIC), 0.0)
    views = admits(state.join(job, jreq("b", 2, host="b", hint=0, **ELASTIC), 0.1))
    assert ranks(views) == {"b": 0, "a": 1}


def test_first_round_without_min_size_fails_after_the_elastic_timeout():
    job = state.new_job("job", 0.0)
    state.join(job, jreq("a", 3, **ELASTIC), 0.0)
    effects = state.check(job, 10.5, LEASE)
    assert "only 1 worker(s) joined within 10 s; at least 2 required" in failure_of(effects)


def test_elastic_bounds_are_checked_and_fixed_by_the_first_joiner():
    job = state.new_job("job", 0.0)
    with pytest.raises(InvalidRequestError, match="max_size 1 is below min_size 2"):
        state.join(job, jreq("a", 2, min_size=2, max_size=1), 0.0)
    state.join(job, jreq("a", 2, **ELASTIC), 0.0)
    with pytest.raises(InvalidRequestError, match="is elastic"):
        state.join(job, jreq("b", 2), 0.0)
    state.join(job, jreq("b", 4, min_size=1, max_size=9), 0.1)  # other bounds: the job's win
    assert job.elastic == state.ElasticBounds(2, 3, 10.0)
    assert job.phase is state.JobPhase.RUNNING and job.size == 2
    plain = form(1)
    with pytest.raises(InvalidRequestError, match="is not elastic"):
        state.join(plain, jreq("c", 1, **ELASTIC), 0.0)


# ---- events --------------------------------------------------------------------------------


def test_events_tell_the_story_with_timestamps_and_members():
    job = elastic_job(2, min_size=1)
    state.stream_closed(job, "w1", 1, 1.25)
    rejoin(job, "w0", 2.0)
    state.report_event(job, "blacklist", "h9", "too many failures", 3.0)
    events = state.event_log(job)
    assert [e.kind for e in events] == [
        "join",
        "join",
        "generation",
        "lost",
        "reset",
        "join",
        "generation",
        "blacklist",
    ]
    lost = events[3]
    assert (lost.unix_ms, lost.rank, lost.host, lost.pid, lost.generation) == (
        1250,
        1,
        "h",
        102,
        1,
    )
    assert events[6].generation == 2 and "1 kept, 0 new" in events[6].message
    assert (events[7].host, events[7].message, events[7].rank) == ("h9", "too many failures", -1)
    with pytest.raises(InvalidRequestError, match="kind"):
        state.report_event(job, "", "h", "", 4.0)


def test_non_elastic_jobs_log_events_too():
    job = form(2)
    state.stream_closed(job, "w0", 1, 1.0)
    assert kinds(job) == ["join", "join", "generation", "lost", "failed"]
    assert job.reset_count == 0 and job.elastic is None


def test_event_log_is_bounded():
    # Budget test: the log never holds more than EVENT_LOG_LIMIT entries.
    job = form(1)
    for i in range(state.EVENT_LOG_LIMIT + 5):
        state.report_event(job, "tick", "", str(i), float(i))
    assert len(job.events) == state.EVENT_LOG_LIMIT
    assert job.events[0].message == "5"


# ---- newcomers launched together ------------------------------------------------------


def test_newcomers_launched_together_join_one_generation_ordered_by_start_rank():
    # horarun starts a new host's two workers for a world of 4 (expected_size 4,
    # their start ranks as hints): the running pair is told once both are here.
    job = elastic_job(2, max_size=4)
    assert state.join(job, jreq("n3", 4, "b", hint=3, **{**ELASTIC, "max_size": 4}), 1.0) == []
    assert job.host_update_epoch == 0  # its companion is still on its way
    state.join(job, jreq("n2", 4, "b", hint=2, **{**ELASTIC, "max_size": 4}), 1.5)
    assert job.host_update_epoch == 1 and kinds(job).count("join_waiting") == 1
    rejoin(job, "w0", 2.0, max_size=4)
    views = admits(rejoin(job, "w1", 2.1, max_size=4))
    assert ranks(views) == {"w0": 0, "w1": 1, "n2": 2, "n3": 3}
    assert job.reset_count == 1


def test_a_newcomer_whose_companions_never_come_is_announced_after_a_while():
    job = elastic_job(2, max_size=4)
    state.join(job, jreq("n", 4, "b", **{**ELASTIC, "max_size": 4}), 1.0)
    for now in (1.0 + 5 * LEASE - 0.1, 1.0 + 5 * LEASE):
        for member in job.members:  # the running pair keeps heartbeating
            member.last_heartbeat = now
        state.check(job, now, LEASE)
        assert job.host_update_epoch == (now >= 1.0 + 5 * LEASE)
    assert job.phase is state.JobPhase.RUNNING
