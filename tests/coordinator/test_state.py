"""Unit tests of the coordinator's pure transitions (no servers, a fake clock)."""

from __future__ import annotations

import logging

import pytest
from coordinator_transitions import (
    admits,
    events_to,
    form,
    jreq,
    responses_to,
    sends,
    submit,
    treq,
)

from hora_coordinator import state
from hora_coordinator.errors import (
    InvalidRequestError,
    JobFailedError,
    RoundFullError,
    StaleGenerationError,
)
from hora_negotiation import NegotiationTable, format_ranks, request_nbytes
from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

# ---- rendezvous ------------------------------------------------------------------------


def test_world_forms_when_expected_size_joined():
    job = state.new_job("job", 0.0)
    assert state.join(job, jreq("a", 2), 0.0) == []
    views = admits(state.join(job, jreq("b", 2), 1.0))
    assert set(views) == {"a", "b"}
    assert {v.generation for v in views.values()} == {1}
    assert views["a"].members == views["b"].members
    assert views["a"].store_prefix == "job/gen-1/"
    assert job.phase is state.JobPhase.RUNNING


def test_rank_hints_are_honoured_and_the_rest_ordered_by_host_then_arrival():
    job = state.new_job("job", 0.0)
    state.join(job, jreq("z1", 4, host="zeta"), 0.0)
    state.join(job, jreq("a1", 4, host="alpha"), 0.0)
    state.join(job, jreq("h0", 4, host="zeta", hint=0), 0.0)
    views = admits(state.join(job, jreq("a2", 4, host="alpha"), 0.0))
    assert {w: v.rank for w, v in views.items()} == {"h0": 0, "a1": 1, "a2": 2, "z1": 3}


@pytest.mark.parametrize("hint", [2, -2, 5])
def test_rank_hint_out_of_range_is_invalid(hint):
    job = state.new_job("job", 0.0)
    with pytest.raises(InvalidRequestError, match="rank hint"):
        state.join(job, jreq("a", 2, hint=hint), 0.0)


def test_duplicate_rank_hint_is_invalid_and_names_the_holder():
    job = state.new_job("job", 0.0)
    state.join(job, jreq("a", 3, hint=1), 0.0)
    with pytest.raises(InvalidRequestError, match="already taken by worker a"):
        state.join(job, jreq("b", 3, hint=1), 0.0)


def test_size_disagreement_is_invalid():
    job = state.new_job("job", 0.0)
    state.join(job, jreq("a", 3), 0.0)
    with pytest.raises(InvalidRequestError, match="size 3"):
        state.join(job, jreq("b", 2), 0.0)


def test_local_and_cross_ranks_on_an_inhomogeneous_cluster():
    # hosts by rank: A A B C C C
    job = form(6, hosts=["A", "A", "B", "C", "C", "C"], hints=[0, 1, 2, 3, 4, 5])
    got = [(m.local_rank, m.local_size, m.cross_rank, m.cross_size) for m in job.members]
    assert got == [
        (0, 2, 0, 3),
        (1, 2, 0, 2),
        (0, 1, 1, 3),
        (0, 3, 2, 3),
        (1, 3, 1, 2),
        (2, 3, 0, 1),
    ]
    assert job.is_homogeneous is False
    view = state.get_world(job, "w4")
    assert (view.local_rank, view.local_size, view.cross_rank, view.cross_size) == (1, 3, 1, 2)


def test_homogeneous_two_by_two():
    job = form(4, hosts=["A", "B", "A", "B"], hints=[0, 1, 2, 3])
    got = [(m.local_rank, m.cross_rank, m.cross_size) for m in job.members]
    assert got == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert job.is_homogeneous is True


def test_cancelled_joiner_is_forgotten_and_an_empty_round_resets_the_size():
    job = state.new_job("job", 0.0)
    state.join(job, jreq("a", 3), 0.0)
    state.cancel_join(job, "a")
    assert job.round is None
    assert len(admits(state.join(job, jreq("b", 1), 0.0))) == 1


def test_join_retry_of_an_active_member_returns_the_same_view():
    job = form(2)
    again = admits(state.join(job, jreq("w1", 2), 5.0))
    assert again["w1"].rank == 1 and again["w1"].generation == 1


def test_next_round_waits_for_the_running_generation_to_finish():
    job = form(2)
    assert state.join(job, jreq("x0", 2), 1.0) == []
    assert state.join(job, jreq("x1", 2), 1.0) == []  # generation 1 still running
    with pytest.raises(RoundFullError):
        state.join(job, jreq("x2", 2), 1.0)
    state.leave(job, "w0", "shutdown", 2.0)
    effects = state.leave(job, "w1", "shutdown", 2.0)
    views = admits(effects)
    assert set(views) == {"x0", "x1"}
    assert {v.generation for v in views.values()} == {2}
    assert views["x0"].store_prefix == "job/gen-2/"


def test_failed_job_refuses_joins():
    job = form(2)
    state.stream_closed(job, "w1", 1, 1.0)
    with pytest.raises(JobFailedError, match="rank 1 .* was lost: stream closed"):
        state.join(job, jreq("n", 2), 2.0)


# ---- loss, leave, lease --------------------------------------------------------------


def test_lost_member_fails_the_job_and_tells_the_others():
    job = form(3)
    effects = state.stream_closed(job, "w1", 1, 1.0)
    assert job.phase is state.JobPhase.FAILED
    assert job.members[1].state is state.MemberState.LOST
    for worker in ("w0", "w2"):
        kinds = [e.type for e in events_to(effects, worker)]
        assert kinds == [npb.EVENT_TYPE_MEMBER_LOST, npb.EVENT_TYPE_JOB_FAILED]
    lost = events_to(effects, "w0")[0]
    assert (lost.rank, lost.message) == (1, "stream closed")
    assert "rank 1" in events_to(effects, "w0")[1].message
    assert any(isinstance(e, state.Log) and e.level == logging.ERROR for e in effects)
    assert events_to(effects, "w1") == []


def test_stream_closed_after_leave_is_not_a_loss():
    job = form(2)
    state.leave(job, "w1", "shutdown", 1.0)
    assert state.stream_closed(job, "w1", 1, 1.0) == []
    assert job.phase is state.JobPhase.RUNNING


def test_lease_expiry_loses_the_silent_member():
    job = form(2, now=0.0)
    state.heartbeat(job, "w0", 1.5, lease_s=2.0)
    assert state.check(job, 2.0, lease_s=2.0) == []
    effects = state.check(job, 2.6, lease_s=2.0)
    assert job.members[1].state is state.MemberState.LOST
    assert job.members[1].cause == "lease expired (no heartbeat for 2.6 s)"
    assert job.phase is state.JobPhase.FAILED
    assert [e.type for e in events_to(effects, "w0")] == [
        npb.EVENT_TYPE_MEMBER_LOST,
        npb.EVENT_TYPE_JOB_FAILED,
    ]


def test_leave_fails_pending_tensors_it_never_submitted():
    job = form(3)
    submit(job, 0, treq("a"))
    submit(job, 1, treq("a"))
    submit(job, 2, treq("b"))
    effects = state.leave(job, "w2", "shutdown", 1.0)
    for worker in ("w0", "w1"):
        errors = responses_to(effects, worker)
        assert [(r.type, list(r.tensor_names)) for r in errors] == [
            (npb.RESPONSE_TYPE_ERROR, ["a"])
        ]
        assert errors[0].error_message == (
            "tensor 'a' cannot complete: rank 2 (host h, pid 102) has shut down"
        )
        assert [e.type for e in events_to(effects, worker)] == [npb.EVENT_TYPE_MEMBER_LEFT]
    # 'b' was submitted by the leaver and waits on the others; a later new name fails at once.
    later = submit(job, 0, treq("c"))
    assert responses_to(later, "w0")[0].error_message.startswith("tensor 'c' cannot complete")


def test_all_members_leaving_finishes_the_job():
    job = form(2)
    state.leave(job, "w0", "", 1.0)
    state.leave(job, "w0", "", 1.0)  # idempotent
    state.leave(job, "w1", "", 1.0)
    assert job.phase is state.JobPhase.FINISHED


def test_stream_for_an_old_generation_is_refused():
    job = form(1)
    with pytest.raises(StaleGenerationError):
        state.open_stream(job, "w0", 7, 0.0)


# ---- negotiation -----------------------------------------------------------------------


def test_tensor_is_answered_when_every_rank_submitted_in_the_same_order():
    job = form(2, fusion_threshold_bytes=1024)
    assert sends(submit(job, 0, treq("x"), treq("y"))) == []
    effects = submit(job, 1, treq("y"), treq("x"))
    r0, r1 = responses_to(effects, "w0"), responses_to(effects, "w1")
    assert r0 == r1
    assert [list(r.tensor_names) for r in r0] == [["y", "x"]]  # fused, in readiness order
    assert job.negotiated_tensors == 2 and job.negotiation_messages == 2


def test_mismatched_dtype_names_tensor_field_and_ranks():
    job = form(2)
    submit(job, 0, treq("grad.w", dtype="float32"))
    effects = submit(job, 1, treq("grad.w", dtype="float64"))
    (resp,) = responses_to(effects, "w0")
    assert resp.type == npb.RESPONSE_TYPE_ERROR
    assert resp.error_message == (
        "tensor 'grad.w': mismatched dtype: rank 0 float32, rank 1 float64"
    )
    assert job.errors == 1


def test_mismatch_groups_ranks_by_value():
    job = form(5)
    for rank in range(5):
        effects = submit(job, rank, treq("t", shape=(3,) if rank == 3 else (2,)))
    (resp,) = responses_to(effects, "w0")
    assert resp.error_message == "tensor 't': mismatched shape: ranks 0-2,4 [2], rank 3 [3]"


@pytest.mark.parametrize(
    ("field", "a", "b", "text"),
    [
        (
            "op_type",
            npb.OP_TYPE_ALLREDUCE,
            npb.OP_TYPE_BROADCAST,
            "mismatched op_type: rank 0 ALLREDUCE, rank 1 BROADCAST",
        ),
        ("reduce_op", npb.REDUCE_OP_SUM, npb.REDUCE_OP_MAX, "mismatched reduce_op: rank 0 SUM"),
        ("device", "cpu", "cuda", "mismatched device: rank 0 cpu, rank 1 cuda"),
        ("prescale_factor", 1.0, 2.0, "mismatched prescale_factor: rank 0 1.0, rank 1 2.0"),
    ],
)
def test_each_agreed_field_is_checked(field, a, b, text):
    job = form(2)
    if field == "op_type":
        submit(job, 0, treq("t", op=a))
        effects = submit(job, 1, treq("t", op=b))
    else:
        submit(job, 0, treq("t", **{field: a}))
        effects = submit(job, 1, treq("t", **{field: b}))
    assert text in responses_to(effects, "w1")[0].error_message


def test_allgather_allows_a_ragged_first_dimension_and_reports_first_dims():
    job = form(3)
    submit(job, 0, treq("g", op=npb.OP_TYPE_ALLGATHER, shape=(1, 5)))
    submit(job, 1, treq("g", op=npb.OP_TYPE_ALLGATHER, shape=(4, 5)))
    effects = submit(job, 2, treq("g", op=npb.OP_TYPE_ALLGATHER, shape=(2, 5)))
    (resp,) = responses_to(effects, "w2")
    assert resp.type == npb.RESPONSE_TYPE_ALLGATHER and list(resp.first_dims) == [1, 4, 2]


def test_allgather_trailing_dimensions_must_agree():
    job = form(2)
    submit(job, 0, treq("g", op=npb.OP_TYPE_ALLGATHER, shape=(1, 5)))
    effects = submit(job, 1, treq("g", op=npb.OP_TYPE_ALLGATHER, shape=(1, 6)))
    assert (
        "mismatched shape[1:]: rank 0 [5], rank 1 [6]"
        in responses_to(effects, "w0")[0].error_message
    )


def test_alltoall_split_matrix_is_sender_major_and_checked():
    job = form(2)
    submit(job, 0, treq("a", op=npb.OP_TYPE_ALLTOALL, shape=(3, 2), splits=[1, 2]))
    effects = submit(job, 1, treq("a", op=npb.OP_TYPE_ALLTOALL, shape=(4, 2)))  # even: [2, 2]
    (resp,) = responses_to(effects, "w0")
    assert list(resp.splits) == [1, 2, 2, 2]
    submit(job, 0, treq("b", op=npb.OP_TYPE_ALLTOALL, shape=(3,), splits=[1, 1]))
    effects = submit(job, 1, treq("b", op=npb.OP_TYPE_ALLTOALL, shape=(2,), splits=[1, 1]))
    assert (
        "rank 0 splits [1, 1] sum to 2 but its first dimension is 3"
        in responses_to(effects, "w0")[0].error_message
    )


def test_fusion_respects_threshold_and_fusion_key():
    job = form(2, fusion_threshold_bytes=64)
    reqs = [
        treq("a", shape=(4,)),  # 16 B
        treq("b", shape=(8,)),  # 32 B -> a+b = 48
        treq("c", shape=(8,)),  # would be 80 > 64: new response
        treq("d", shape=(2,), dtype="float64"),  # other dtype: new response
        treq("big", shape=(100,)),  # 400 B > threshold: alone
        treq("e", shape=(1,), dtype="float64"),
    ]  # same key as d but big came between
    submit(job, 0, *reqs)
    effects = submit(job, 1, *reqs)
    names = [list(r.tensor_names) for r in responses_to(effects, "w0")]
    assert names == [["a", "b"], ["c"], ["d"], ["big"], ["e"]]
    assert request_nbytes(reqs[4]) == 400


def test_zero_threshold_never_fuses():
    job = form(2, fusion_threshold_bytes=0)
    submit(job, 0, treq("a"), treq("b"))
    effects = submit(job, 1, treq("a"), treq("b"))
    assert [list(r.tensor_names) for r in responses_to(effects, "w0")] == [["a"], ["b"]]


def test_grouped_allreduce_waits_for_the_whole_group_and_is_never_split():
    job = form(2, fusion_threshold_bytes=8)  # smaller than any tensor of the group
    group = [treq(f"g{i}", shape=(16,), group_id=7, group_size=3) for i in range(3)]
    submit(job, 0, *group)
    assert sends(submit(job, 1, group[0], group[1])) == []  # g2 not ready on rank 1 yet
    effects = submit(job, 1, group[2])
    (resp,) = responses_to(effects, "w0")
    assert list(resp.tensor_names) == ["g0", "g1", "g2"]
    assert job.negotiated_tensors == 3


def test_duplicate_submission_is_an_error_for_the_whole_set():
    job = form(2)
    submit(job, 0, treq("x"))
    effects = submit(job, 0, treq("x"))
    for worker in ("w0", "w1"):
        (resp,) = responses_to(effects, worker)
        assert resp.type == npb.RESPONSE_TYPE_ERROR
        assert resp.error_message == "tensor 'x': rank 0 submitted it twice"


def test_unknown_process_set_is_an_error_for_the_sender_only():
    job = form(2)
    effects = submit(job, 0, treq("x", process_set_id=5))
    assert responses_to(effects, "w1") == []
    assert "unknown process set 5" in responses_to(effects, "w0")[0].error_message


def test_stall_warning_timing_and_shutdown():
    job = form(3, now=0.0, stall_warning_ms=1000, stall_shutdown_ms=5000)
    submit(job, 0, treq("slow"), now=0.0)
    submit(job, 2, treq("slow"), now=0.2)
    lease = 100.0
    assert state.check(job, 0.9, lease) == []
    effects = state.check(job, 1.1, lease)
    (warning,) = events_to(effects, "w0")
    assert warning.type == npb.EVENT_TYPE_STALL_WARNING
    assert list(warning.tensor_names) == ["slow"] and list(warning.missing_ranks) == [1]
    assert events_to(effects, "w1") == []  # the missing rank is not told
    assert any(isinstance(e, state.Log) and e.level == logging.WARNING for e in effects)
    assert state.check(job, 1.8, lease) == []  # at most once per warning interval
    assert len(events_to(state.check(job, 2.2, lease), "w2")) == 1
    effects = state.check(job, 5.1, lease)
    assert job.phase is state.JobPhase.FAILED
    (failed,) = events_to(effects, "w1")
    assert failed.type == npb.EVENT_TYPE_JOB_FAILED
    assert "tensor 'slow'" in failed.message and "missing ranks: 1" in failed.message


def test_stall_warning_and_failure_say_what_each_missing_rank_is_waiting_in():
    job = form(3, now=0.0, stall_warning_ms=1000, stall_shutdown_ms=5000)
    submit(job, 0, treq("a"), now=0.0)
    submit(job, 1, treq("b", op=npb.OP_TYPE_ALLGATHER), now=0.0)
    submit(job, 2, treq("b", op=npb.OP_TYPE_ALLGATHER), now=0.0)
    effects = state.check(job, 1.1, 100.0)
    (warning,) = events_to(effects, "w0")
    assert "tensor 'a'" in warning.message and "missing ranks: 1-2" in warning.message
    assert "rank 1 is waiting in allgather 'b'; rank 2 is waiting in allgather 'b'" \
        in warning.message, warning.message
    (warning,) = events_to(effects, "w1")
    assert "rank 0 is waiting in allreduce 'a'" in warning.message, warning.message
    (failed,) = events_to(state.check(job, 5.1, 100.0), "w0")
    assert "rank 1 is waiting in allgather 'b'" in failed.message, failed.message


def test_format_ranks():
    assert format_ranks([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_ranks([]) == ""


@pytest.mark.parametrize("members", [10, 100, 1000])
def test_submit_cost_does_not_grow_with_pending_tensors(members):
    # Budget test: a message touches only its own tensors, whatever the table holds.
    table = NegotiationTable(2, 1 << 20)
    for i in range(members):
        table.submit(0, [treq(f"p{i}")], 0.0)
    outcome = table.submit(1, [treq("p0")], 0.0)
    assert [list(r.tensor_names) for _, rl in outcome.broadcasts for r in rl.responses] == [["p0"]]
    assert len(table.pending) == members - 1


@pytest.mark.parametrize("size", [10, 100, 1000])
def test_world_of_size_forms_and_negotiates(size):
    # Budget test: state stays proportional to the world, and a tensor submitted by
    # every rank leaves nothing behind in the table.
    job = form(size, hosts=[f"host{i % 8}" for i in range(size)], fusion_threshold_bytes=1024)
    assert len(job.members) == len(job.by_worker) == size
    assert job.round is None
    effects = []
    for rank in range(size):
        effects = submit(job, rank, treq("w"))
    (send,) = sends(effects)
    assert len(send.worker_ids) == size
    assert job.table.pending == {} and job.negotiated_tensors == 1
    assert job.members[0].cross_size == 8  # every host has a local rank 0
    assert sum(m.local_size for m in job.members if m.local_rank == 0) == size


def test_public_surface_is_importable():
    import hora_coordinator
    import hora_negotiation as negotiation
    from hora_coordinator import errors, server, settings, store

    for module in (hora_coordinator, errors, negotiation, server, settings, state, store):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    assert {"EmbeddedCoordinator", "CoordinatorSettings"} <= set(hora_coordinator.__all__)
