"""Unit tests of process sets and hvd.join() in the pure transitions (fake clock)."""

from __future__ import annotations

import pytest
from coordinator_transitions import events_to, form, responses_to, sends, submit, treq

from hora_coordinator import state
from hora_coordinator.errors import (
    InvalidRequestError,
    JobFailedError,
    PreconditionError,
    StaleGenerationError,
)
from hora_negotiation import NegotiationTable
from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ALLGATHER, ALLTOALL = npb.OP_TYPE_ALLGATHER, npb.OP_TYPE_ALLTOALL


def add_set(job: state.Job, set_id: int, ranks, worker: str = "w0"):
    return state.add_process_set(job, worker, job.generation, set_id, list(ranks))


def join_req(name: str = "join.0", process_set_id: int = 0) -> npb.TensorRequest:
    return npb.TensorRequest(name=name, op_type=npb.OP_TYPE_JOIN, process_set_id=process_set_id)


def recipients(effects) -> list[tuple[str, ...]]:
    return [s.worker_ids for s in sends(effects)]


# ---- process set registration -----------------------------------------------------------


def test_every_rank_adding_the_same_set_is_idempotent():
    job = form(3)
    effects = add_set(job, 1, [0, 2], "w0")
    assert any(isinstance(e, state.Log) for e in effects)
    assert add_set(job, 1, [0, 2], "w1") == []  # confirmation: nothing new
    assert add_set(job, 1, [0, 2], "w2") == []
    assert job.table.process_sets[1].ranks == (0, 2)


@pytest.mark.parametrize(
    ("set_id", "ranks", "text"),
    [
        (0, [0, 1], "at least 1"),
        (-1, [0], "at least 1"),
        (1, [], "has no ranks"),
        (1, [0, 3], r"must lie in \[0, 3\)"),
        (1, [-1, 0], r"must lie in \[0, 3\)"),
        (1, [2, 0], "ascending and distinct"),
        (1, [0, 0, 1], "ascending and distinct"),
    ],
)
def test_bad_process_sets_are_invalid(set_id, ranks, text):
    job = form(3)
    with pytest.raises(InvalidRequestError, match=text):
        add_set(job, set_id, ranks)
    assert set(job.table.process_sets) == {0}


def test_same_id_with_other_ranks_is_invalid():
    job = form(3)
    add_set(job, 1, [0, 2])
    with pytest.raises(InvalidRequestError, match=r"registered with ranks \[0, 2\], not \[0, 1\]"):
        add_set(job, 1, [0, 1], "w1")


def test_add_needs_an_active_member_of_the_running_generation():
    job = form(3)
    with pytest.raises(StaleGenerationError):
        state.add_process_set(job, "w0", job.generation + 1, 1, [0, 1])
    with pytest.raises(PreconditionError, match="not an active member"):
        state.add_process_set(job, "stranger", job.generation, 1, [0, 1])
    state.stream_closed(job, "w2", job.generation, 1.0)  # the job fails
    with pytest.raises(JobFailedError):
        state.add_process_set(job, "w0", job.generation, 1, [0, 1])


def test_removed_id_stays_removed_against_a_late_confirmation():
    job = form(2)
    add_set(job, 1, [0, 1], "w0")
    state.remove_process_set(job, "w0", job.generation, 1)
    assert add_set(job, 1, [0, 1], "w1") == []  # w1 confirms late: the set stays removed
    assert 1 not in job.table.process_sets
    with pytest.raises(InvalidRequestError, match="was removed in this generation"):
        add_set(job, 1, [1], "w1")
    assert state.remove_process_set(job, "w1", job.generation, 1) == []  # idempotent
    with pytest.raises(InvalidRequestError, match="cannot be removed"):
        state.remove_process_set(job, "w0", job.generation, 0)


# ---- collectives on a set of ranks (0, 2) of a world of 3 ---------------------------------


def test_a_set_is_ready_when_its_ranks_submitted_and_answers_only_them():
    job = form(3)
    add_set(job, 1, [0, 2])
    assert sends(submit(job, 2, treq("x", process_set_id=1))) == []
    effects = submit(job, 0, treq("x", process_set_id=1))
    assert recipients(effects) == [("w0", "w2")]
    (resp,) = responses_to(effects, "w0")
    assert (resp.type, list(resp.tensor_names), resp.process_set_id) == (
        npb.RESPONSE_TYPE_ALLREDUCE,
        ["x"],
        1,
    )
    effects = submit(job, 1, treq("y", process_set_id=1))
    assert responses_to(effects, "w1")[0].error_message == (
        "tensor 'y': rank 1 is not in process set 1"
    )


def test_allgather_first_dims_are_set_wide_and_in_set_order():
    job = form(3)
    add_set(job, 1, [0, 2])
    submit(job, 2, treq("g", op=ALLGATHER, shape=(5, 3), process_set_id=1))
    effects = submit(job, 0, treq("g", op=ALLGATHER, shape=(2, 3), process_set_id=1))
    (resp,) = responses_to(effects, "w2")
    assert list(resp.first_dims) == [2, 5]  # position 0 is rank 0, position 1 is rank 2
    assert responses_to(effects, "w1") == []


def test_alltoall_matrix_is_set_wide_and_in_set_order():
    job = form(3)
    add_set(job, 1, [0, 2])
    submit(job, 2, treq("a", op=ALLTOALL, shape=(4, 2), splits=[3, 1], process_set_id=1))
    effects = submit(job, 0, treq("a", op=ALLTOALL, shape=(2, 2), process_set_id=1))
    (resp,) = responses_to(effects, "w0")
    assert list(resp.splits) == [1, 1, 3, 1]  # rank 0's row (even split), then rank 2's
    submit(job, 0, treq("b", op=ALLTOALL, shape=(3,), splits=[1, 1, 1], process_set_id=1))
    effects = submit(job, 2, treq("b", op=ALLTOALL, shape=(3,), splits=[1, 2], process_set_id=1))
    assert "rank 0 sent 3 splits for a process set of 2 ranks" in (
        responses_to(effects, "w2")[0].error_message
    )


def test_mismatch_in_a_set_names_global_ranks():
    job = form(3)
    add_set(job, 1, [1, 2])
    submit(job, 1, treq("t", dtype="float32", process_set_id=1))
    effects = submit(job, 2, treq("t", dtype="float64", process_set_id=1))
    assert responses_to(effects, "w1")[0].error_message == (
        "tensor 't': mismatched dtype: rank 1 float32, rank 2 float64"
    )


def test_a_call_invalid_on_one_rank_fails_on_every_rank_of_its_set_naming_why():
    job = form(3)
    add_set(job, 1, [0, 2])
    assert submit(job, 0, treq("t", shape=(), process_set_id=1)) == []
    effects = submit(
        job, 2, treq("t", shape=(), process_set_id=1, invalid="needs at least one dimension")
    )
    for worker in ("w0", "w2"):
        (response,) = responses_to(effects, worker)
        assert response.type == npb.RESPONSE_TYPE_ERROR
        assert response.error_kind == npb.ERROR_KIND_INVALID
        assert response.error_message == (
            "tensor 't': invalid call on rank 2: needs at least one dimension"
        )
    assert responses_to(effects, "w1") == []


def test_an_invalid_call_wins_over_a_mismatch_and_fails_a_whole_group():
    job = form(2)
    group = {"group_id": 7, "group_size": 2}
    submit(job, 0, treq("g.0", **group), treq("g.1", dtype="float64", **group))
    effects = submit(
        job, 1, treq("g.0", **group), treq("g.1", invalid="op Adasum on int32", **group)
    )
    (response,) = responses_to(effects, "w0")
    assert list(response.tensor_names) == ["g.0", "g.1"]
    assert response.error_kind == npb.ERROR_KIND_INVALID
    assert "rank 1: op Adasum on int32" in response.error_message


def test_a_group_of_several_dtypes_goes_out_whole_as_one_response_per_dtype():
    job = form(2)
    group = {"group_id": 3, "group_size": 3}
    reqs = [treq("g.0", **group), treq("g.1", dtype="float64", **group), treq("g.2", **group)]
    assert submit(job, 0, *reqs) == []
    effects = submit(job, 1, *reqs)
    for worker in ("w0", "w1"):
        got = [(r.type, list(r.tensor_names)) for r in responses_to(effects, worker)]
        assert got == [(npb.RESPONSE_TYPE_ALLREDUCE, ["g.0", "g.2"]),
                       (npb.RESPONSE_TYPE_ALLREDUCE, ["g.1"])]


def test_a_group_of_several_dtypes_is_filled_for_a_joined_rank_per_dtype():
    job = form(2)
    group = {"group_id": 3, "group_size": 2}
    assert submit(job, 1, join_req()) == []
    effects = submit(job, 0, treq("g.0", **group), treq("g.1", dtype="float64", **group))
    got = [(list(r.tensor_names), [f.dtype for f in r.join_fill])
           for r in responses_to(effects, "w1") if r.type == npb.RESPONSE_TYPE_ALLREDUCE]
    assert got == [(["g.0"], ["float32"]), (["g.1"], ["float64"])]


def test_removing_a_set_fails_its_pending_tensors_on_their_submitters():
    job = form(3, fusion_threshold_bytes=1024)
    add_set(job, 1, [0, 2])
    submit(
        job, 0, treq("p", process_set_id=1), treq("g", process_set_id=1, group_id=4, group_size=2)
    )
    submit(job, 2, treq("g", process_set_id=1, group_id=4, group_size=2))  # held for its sibling
    submit(job, 1, treq("p"))  # same name in set 0: untouched
    effects = state.remove_process_set(job, "w1", job.generation, 1)
    got = {
        w: [(list(r.tensor_names), r.error_message) for r in responses_to(effects, w)]
        for w in ("w0", "w1", "w2")
    }
    assert got == {
        "w0": [
            (["p"], "tensor 'p': process set 1 was removed"),
            (["g"], "tensor 'g': process set 1 was removed"),
        ],
        "w1": [],
        "w2": [(["g"], "tensor 'g': process set 1 was removed")],
    }
    assert all(r.type == npb.RESPONSE_TYPE_ERROR for r in responses_to(effects, "w0"))
    assert responses_to(effects, "w0")[0].error_kind == npb.ERROR_KIND_MISMATCH
    assert list(job.table.pending) == [(0, "p")]
    later = submit(job, 0, treq("q", process_set_id=1))
    assert "unknown process set 1" in responses_to(later, "w0")[0].error_message


def test_a_set_added_after_a_rank_left_fails_at_once():
    job = form(3)
    state.leave(job, "w1", "shutdown", 1.0)
    add_set(job, 1, [0, 1])
    add_set(job, 2, [0, 2])
    effects = submit(job, 0, treq("x", process_set_id=1))
    assert responses_to(effects, "w0")[0].error_kind == npb.ERROR_KIND_RANK_GONE
    assert sends(submit(job, 0, treq("y", process_set_id=2))) == []  # waits on rank 2


# ---- join ----------------------------------------------------------------------------


def test_allreduce_completes_without_a_joined_rank_and_carries_join_fill():
    job = form(3)
    assert sends(submit(job, 1, join_req("join.1"))) == []
    submit(job, 0, treq("x", shape=(2, 3)))
    effects = submit(job, 2, treq("x", shape=(2, 3)))
    assert recipients(effects) == [("w0", "w1", "w2")]  # the joined rank runs it too
    (resp,) = responses_to(effects, "w1")
    assert list(resp.tensor_names) == ["x"]
    (fill,) = resp.join_fill
    assert (fill.name, fill.dtype, list(fill.shape), fill.op_type) == (
        "x",
        "float32",
        [2, 3],
        npb.OP_TYPE_ALLREDUCE,
    )
    assert job.negotiated_tensors == 1


def test_join_fill_follows_the_names_of_a_fused_response():
    job = form(2, fusion_threshold_bytes=1024)
    submit(job, 1, treq("a", shape=(2,)))  # rank 1 submitted 'a' before joining
    submit(job, 1, join_req())
    effects = submit(
        job, 0, treq("a", shape=(2,)), treq("b", shape=(3,)), treq("c", dtype="float64")
    )
    responses = responses_to(effects, "w1")
    assert [list(r.tensor_names) for r in responses] == [["a", "b"], ["c"]]
    assert [(f.name, list(f.shape)) for f in responses[0].join_fill] == [("a", [2]), ("b", [3])]
    assert [(f.name, f.dtype) for f in responses[1].join_fill] == [("c", "float64")]


def test_join_fill_covers_a_grouped_allreduce():
    job = form(2)
    submit(job, 1, join_req())
    group = [treq(f"g{i}", group_id=3, group_size=2, shape=(i + 1,)) for i in range(2)]
    effects = submit(job, 0, *group)
    (resp,) = responses_to(effects, "w1")
    assert list(resp.tensor_names) == ["g0", "g1"]
    assert [list(f.shape) for f in resp.join_fill] == [[1], [2]]


def test_response_without_joined_ranks_has_no_join_fill():
    job = form(3)
    add_set(job, 1, [0, 2])
    submit(job, 1, join_req())  # rank 1 is not in set 1
    submit(job, 0, treq("s", process_set_id=1))
    effects = submit(job, 2, treq("s", process_set_id=1))
    (resp,) = responses_to(effects, "w0")
    assert resp.type == npb.RESPONSE_TYPE_ALLREDUCE and len(resp.join_fill) == 0
    assert recipients(effects) == [("w0", "w2")]


@pytest.mark.parametrize(
    ("op", "extra", "label"),
    [
        (ALLGATHER, {"shape": (2, 3)}, "allgather"),
        (npb.OP_TYPE_BROADCAST, {"root_rank": 0}, "broadcast"),
        (ALLTOALL, {"shape": (4,)}, "alltoall"),
        (npb.OP_TYPE_REDUCESCATTER, {}, "reducescatter"),
        (npb.OP_TYPE_BARRIER, {"shape": ()}, "barrier"),
    ],
)
def test_other_collectives_fail_on_their_submitters_while_a_rank_is_joined(op, extra, label):
    job = form(3)
    submit(job, 1, join_req())
    submit(job, 0, treq("t", op=op, **extra))
    effects = submit(job, 2, treq("t", op=op, **extra))
    assert responses_to(effects, "w1") == []
    for worker in ("w0", "w2"):
        (resp,) = responses_to(effects, worker)
        assert resp.type == npb.RESPONSE_TYPE_ERROR
        assert resp.error_kind == npb.ERROR_KIND_MISMATCH
        assert resp.error_message == (
            f"tensor 't' ({label}) cannot run while rank(s) 1 have joined: "
            "hvd.join() supports allreduce only"
        )
    assert job.table.pending == {} and job.errors == 1


def test_a_join_makes_pending_tensors_ready_before_anything_else():
    job = form(3, fusion_threshold_bytes=1024)
    submit(job, 0, treq("x"), treq("g", op=ALLGATHER))
    submit(job, 2, treq("x"), treq("g", op=ALLGATHER))
    effects = submit(job, 1, join_req(), treq("after"))
    first = sends(effects)[0]
    assert first.worker_ids == ("w0", "w1", "w2")
    (resp,) = first.message.responses.responses
    assert list(resp.tensor_names) == ["x"] and [f.name for f in resp.join_fill] == ["x"]
    assert "(allgather) cannot run while rank(s) 1 have joined" in (
        responses_to(effects, "w0")[-1].error_message
    )
    assert len(responses_to(effects, "w1")) == 1  # the allgather fails on submitters only
    assert list(job.table.pending) == [(0, "after")]  # an ordinary submission, waiting


def test_the_last_join_answers_every_rank_and_clears_the_joined_state():
    job = form(3)
    submit(job, 2, join_req("j2"))
    submit(job, 0, join_req("j0"))
    effects = submit(job, 1, join_req("j1"))
    assert recipients(effects) == [("w0", "w1", "w2")]
    (resp,) = responses_to(effects, "w0")
    assert resp.type == npb.RESPONSE_TYPE_JOIN
    assert resp.last_joined_rank == 1 and list(resp.tensor_names) == []
    assert job.table.joined == {} and job.negotiated_tensors == 1
    # Training goes on: a tensor needs every rank again, and a later epoch may join again.
    submit(job, 0, treq("x"))
    assert sends(submit(job, 1, treq("x"))) == []
    assert len(responses_to(submit(job, 2, treq("x")), "w0")) == 1
    submit(job, 0, join_req("k0"))
    assert sends(submit(job, 2, join_req("k2"))) == []


def test_the_last_join_first_runs_what_the_joined_ranks_left_pending():
    job = form(2)
    submit(job, 0, treq("x"))  # rank 0 submits x, then joins; x waits for rank 1
    submit(job, 0, join_req("j0"))
    effects = submit(job, 1, join_req("j1"))
    (send,) = sends(effects)
    assert [r.type for r in send.message.responses.responses] == [
        npb.RESPONSE_TYPE_ALLREDUCE,
        npb.RESPONSE_TYPE_JOIN,
    ]
    assert send.message.responses.responses[0].join_fill[0].name == "x"


def test_a_world_of_one_joins_at_once():
    job = form(1)
    (resp,) = responses_to(submit(job, 0, join_req()), "w0")
    assert resp.type == npb.RESPONSE_TYPE_JOIN and resp.last_joined_rank == 0


def test_join_errors_go_to_the_sender():
    job = form(2)
    effects = submit(job, 0, join_req("j", process_set_id=1))
    assert "join runs on process set 0 only" in responses_to(effects, "w0")[0].error_message
    submit(job, 0, join_req("j"))
    effects = submit(job, 0, join_req("j.again"))
    assert responses_to(effects, "w1") == []
    (resp,) = responses_to(effects, "w0")
    assert list(resp.tensor_names) == ["j.again"]
    assert resp.error_message == (
        "tensor 'j.again': rank 0 submitted join twice (it joined as 'j')"
    )


def test_joined_ranks_are_not_missing_for_stall_detection():
    job = form(3, stall_warning_ms=1000)
    submit(job, 2, join_req())
    submit(job, 0, treq("slow"), now=0.0)
    (warning,) = events_to(state.check(job, 1.5, 100.0), "w0")
    assert list(warning.missing_ranks) == [1]


def test_a_departure_fails_the_pending_joins_of_the_others():
    job = form(3)
    submit(job, 0, join_req("j0"))
    submit(job, 2, join_req("j2"))
    submit(job, 0, treq("x"))  # joined ranks never submit more; a stand-in for a pending tensor
    effects = state.leave(job, "w1", "shutdown", 1.0)
    for worker, name in (("w0", "j0"), ("w2", "j2")):
        resp = responses_to(effects, worker)[-1]
        assert resp.type == npb.RESPONSE_TYPE_ERROR
        assert resp.error_kind == npb.ERROR_KIND_RANK_GONE
        assert list(resp.tensor_names) == [name]
        assert resp.error_message == (
            f"tensor '{name}' (join) cannot complete: rank 1 (host h, pid 102) has shut down"
        )
    assert job.table.joined == {}
    later = responses_to(submit(job, 0, join_req("j0.b")), "w0")
    assert later[0].error_kind == npb.ERROR_KIND_RANK_GONE


@pytest.mark.parametrize("pending", [10, 100, 1000])
def test_submit_cost_while_joined_does_not_grow_with_pending_tensors(pending):
    # Budget test: with a rank joined, a message still touches only its own tensors.
    table = NegotiationTable(3, 1 << 20)
    for i in range(pending):
        table.submit(0, [treq(f"p{i}")], 0.0)
    table.submit(2, [join_req()], 0.0)
    outcome = table.submit(1, [treq("p0")], 0.0)
    assert [list(r.tensor_names) for _, rl in outcome.broadcasts for r in rl.responses] == [["p0"]]
    assert len(table.pending) == pending - 1
