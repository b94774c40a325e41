"""Unit tests of process set calls as collectives, in the pure transitions (fake clock).

Every rank of the generation calls AddProcessSet (RemoveProcessSet); the
transition gathers the calls and, once all are in, decides once: every
caller gets the same :class:`state.Answer`.
"""

from __future__ import annotations

import pytest
from coordinator_transitions import form, responses_to, submit, treq

from hora_coordinator import state
from hora_coordinator.errors import (
    CallTimeoutError,
    InvalidRequestError,
    PreconditionError,
    RankGoneError,
)
from hora_coordinator.messages import AddProcessSetRequest, RemoveProcessSetRequest
from hora_negotiation import SetCallKind
from hora_negotiation.solo import LocalNegotiation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

FOREVER = 1e9  # a lease that never expires in these tests


def add(job: state.Job, rank: int, set_id: int, ranks, invalid: str = "", now: float = 0.0):
    request = AddProcessSetRequest("job", f"w{rank}", job.generation, set_id, tuple(ranks), invalid)
    return state.call_add_process_set(job, request, now)


def remove(job: state.Job, rank: int, set_id: int, invalid: str = "", now: float = 0.0):
    request = RemoveProcessSetRequest("job", f"w{rank}", job.generation, set_id, invalid)
    return state.call_remove_process_set(job, request, now)


def answers(effects) -> list[state.Answer]:
    return [e for e in effects if isinstance(e, state.Answer)]


def the_answer(effects) -> state.Answer:
    (answer,) = answers(effects)
    return answer


def error_text(answer: state.Answer) -> str:
    assert answer.error is not None, answer
    return str(answer.error)


# ---- gathering and deciding ---------------------------------------------------------------


def test_calls_wait_for_every_rank_then_all_succeed():
    job = form(3)
    assert answers(add(job, 0, 1, [0, 2])) == []
    assert answers(add(job, 2, 1, [0, 2])) == []
    assert 1 not in job.table.process_sets  # nothing happens before every rank called
    effects = add(job, 1, 1, [0, 2])
    answer = the_answer(effects)
    assert (answer.worker_ids, answer.kind, answer.error) == (
        ("w0", "w1", "w2"),
        SetCallKind.ADD,
        None,
    )
    assert job.table.process_sets[1].ranks == (0, 2)
    assert any(isinstance(e, state.Log) and "process set 1 added" in e.message for e in effects)


def test_one_ranks_problem_fails_every_call_and_registers_nothing():
    job = form(2)
    add(job, 0, 1, [0, 1])
    answer = the_answer(add(job, 1, 1, [0, 1], "ProcessSet([0, 1]) has already been added"))
    assert answer.worker_ids == ("w0", "w1")
    assert isinstance(answer.error, InvalidRequestError)
    assert error_text(answer) == (
        "add_process_set failed on every rank because of rank 1: "
        "ProcessSet([0, 1]) has already been added"
    )
    assert set(job.table.process_sets) == {0}


def test_different_sets_fail_every_call_naming_each_ranks_set():
    job = form(3)
    add(job, 0, 1, [0, 1])
    add(job, 1, 1, [0, 2])
    answer = the_answer(add(job, 2, 1, [0, 1]))
    assert error_text(answer) == (
        "ranks called add_process_set with different sets: rank 0: [0, 1]; rank 1: [0, 2]; "
        "rank 2: [0, 1]"
    )
    assert set(job.table.process_sets) == {0}


def test_different_ids_are_different_sets():
    job = form(2)
    add(job, 0, 1, [0, 1])
    answer = the_answer(add(job, 1, 2, [0, 1]))
    assert error_text(answer) == (
        "ranks called add_process_set with different sets: rank 0: process set 1 [0, 1]; "
        "rank 1: process set 2 [0, 1]"
    )


def test_a_set_the_table_refuses_fails_every_call():
    job = form(2)
    add(job, 0, 0, [0, 1])
    answer = the_answer(add(job, 1, 0, [0, 1]))
    assert isinstance(answer.error, InvalidRequestError)
    assert error_text(answer).startswith("add_process_set failed on every rank: process set id")
    assert "at least 1" in error_text(answer)


def test_messages_of_many_ranks_stay_a_few_kib_and_name_the_first_ranks():
    # The message travels in a gRPC trailer (some 8 KiB): long texts are cut and
    # ranks past a budget only counted.
    size = 1000
    job = form(size)
    for rank in range(size):
        effects = add(job, rank, 1, range(size), f"problem of rank {rank}: " + "x" * 500)
    text = error_text(the_answer(effects))
    assert len(text.encode()) < 4096
    assert text.startswith("add_process_set failed on every rank because of rank 0: problem")
    assert "; rank 1: problem of rank 1: xxx" in text
    assert text.endswith(" more ranks")
    for rank in range(size):
        effects = add(job, rank, 1 + rank % 2, range(size))
    text = error_text(the_answer(effects))
    assert len(text.encode()) < 4096
    assert text.startswith("ranks called add_process_set with different sets: "
                           "rank 0: process set 1 [0, 1, 2, ")
    assert "; rank 1: process set 2 [0, 1, 2, " in text
    assert text.endswith(" more ranks")
    for rank in range(size):
        effects = add(job, rank, 1, [*range(size), 0])
    text = error_text(the_answer(effects))
    assert len(text.encode()) < 4096
    assert text.endswith("must be ascending and distinct")


def test_a_valid_call_after_an_invalid_one_works():
    job = form(2)
    add(job, 0, 1, [0])
    assert the_answer(add(job, 1, 1, [1])).error is not None
    add(job, 0, 1, [0, 1])
    assert the_answer(add(job, 1, 1, [0, 1])).error is None
    assert job.table.process_sets[1].ranks == (0, 1)


def test_adding_a_registered_set_again_alike_succeeds():
    job = form(2)
    for _ in range(2):
        add(job, 0, 1, [0, 1])
        assert the_answer(add(job, 1, 1, [0, 1])).error is None


def test_a_second_call_of_a_waiting_rank_replaces_its_first():
    job = form(2)
    add(job, 0, 1, [0])
    add(job, 0, 1, [0, 1])  # the caller gave up on its first call and called again
    assert the_answer(add(job, 1, 1, [0, 1])).error is None


def test_a_withdrawn_call_no_longer_counts():
    job = form(2)
    add(job, 0, 1, [0, 1])
    assert state.withdraw_set_call(job, "w0", job.generation, SetCallKind.ADD) == []
    assert answers(add(job, 1, 1, [0, 1])) == []  # waits for rank 0 again
    assert the_answer(add(job, 0, 1, [0, 1])).worker_ids == ("w0", "w1")


def test_only_active_members_of_the_running_generation_may_call():
    job = form(2)
    with pytest.raises(PreconditionError, match="not an active member"):
        state.call_add_process_set(
            job, AddProcessSetRequest("job", "stranger", job.generation, 1, (0,)), 0.0
        )
    with pytest.raises(PreconditionError, match="is not running"):
        state.call_add_process_set(
            job, AddProcessSetRequest("job", "w0", job.generation + 1, 1, (0,)), 0.0
        )


# ---- remove -------------------------------------------------------------------------------


def test_remove_gathers_decides_and_fails_the_sets_pending_tensors():
    job = form(2)
    add(job, 0, 1, [0, 1])
    add(job, 1, 1, [0, 1])
    submit(job, 0, treq("p", process_set_id=1))
    assert answers(remove(job, 1, 1)) == []
    effects = remove(job, 0, 1)
    assert the_answer(effects).error is None
    assert 1 not in job.table.process_sets
    assert [r.error_message for r in responses_to(effects, "w0")] == [
        "tensor 'p': process set 1 was removed"
    ]


def test_remove_problems_and_differences_fail_every_call():
    job = form(2)
    add(job, 0, 1, [0, 1])
    add(job, 1, 1, [0, 1])
    remove(job, 0, 1)
    answer = the_answer(remove(job, 1, 0, "the global process set cannot be removed"))
    assert error_text(answer) == (
        "remove_process_set failed on every rank because of rank 1: "
        "the global process set cannot be removed"
    )
    remove(job, 0, 1)
    answer = the_answer(remove(job, 1, -1))
    assert error_text(answer) == (
        "ranks called remove_process_set with different sets: rank 0: process set 1; "
        "rank 1: a set it never added"
    )
    remove(job, 0, 0)
    assert "cannot be removed" in error_text(the_answer(remove(job, 1, 0)))
    assert 1 in job.table.process_sets  # still there after every failed call


def test_removing_a_set_nobody_added_succeeds():
    job = form(2)
    remove(job, 0, -1)
    assert the_answer(remove(job, 1, -1)).error is None
    remove(job, 0, 7)
    assert the_answer(remove(job, 1, 7)).error is None  # unknown id: idempotent


def test_add_and_remove_gather_apart():
    job = form(2)
    add(job, 0, 1, [0, 1])
    assert answers(remove(job, 1, -1)) == []  # a different call: each waits for its own
    assert the_answer(add(job, 1, 1, [0, 1])).kind is SetCallKind.ADD
    assert the_answer(remove(job, 0, -1)).kind is SetCallKind.REMOVE


# ---- deadlines and departures -------------------------------------------------------------


def test_calls_fail_at_the_stall_shutdown_time_naming_the_missing_ranks():
    job = form(4, stall_shutdown_ms=2000)
    add(job, 0, 1, [0, 1], now=10.0)
    add(job, 2, 1, [0, 1], now=11.0)
    assert answers(state.check(job, 12.0, FOREVER)) == []
    answer = the_answer(state.check(job, 12.1, FOREVER))
    assert answer.worker_ids == ("w0", "w2")
    assert isinstance(answer.error, CallTimeoutError)
    assert error_text(answer) == (
        "add_process_set did not complete: rank(s) 1,3 did not call it within 2 s "
        "(the job's stall shutdown time)"
    )
    assert job.phase is state.JobPhase.RUNNING  # only the call failed
    assert answers(state.check(job, 20.0, FOREVER)) == []
    for rank in range(4):  # the next call starts afresh
        effects = add(job, rank, 1, [0, 1], now=30.0)
    assert the_answer(effects).error is None


def test_without_a_stall_shutdown_time_calls_wait():
    job = form(2, stall_shutdown_ms=0, stall_warning_ms=0)
    add(job, 0, 1, [0, 1], now=0.0)
    assert answers(state.check(job, 1e6, FOREVER)) == []


def test_a_coordinator_stall_does_not_count_against_waiting_calls():
    job = form(4, stall_shutdown_ms=2000)
    add(job, 0, 1, [0, 1], now=10.0)
    state.forgive_stall(job, 5.0)  # the coordinator stood still from 10.5 to 15.5
    assert answers(state.check(job, 16.0, FOREVER)) == []
    answer = the_answer(state.check(job, 17.1, FOREVER))  # 2 s of running time waited
    assert isinstance(answer.error, CallTimeoutError)


def test_a_leaving_rank_fails_waiting_calls_and_later_ones_at_once():
    job = form(3)
    add(job, 0, 1, [0, 1])
    remove(job, 1, -1)
    effects = state.leave(job, "w2", "shutdown", 1.0)
    got = {a.kind: (a.worker_ids, a.error) for a in answers(effects)}
    assert set(got) == {SetCallKind.ADD, SetCallKind.REMOVE}
    assert got[SetCallKind.ADD][0] == ("w0",) and got[SetCallKind.REMOVE][0] == ("w1",)
    for _workers, error in got.values():
        assert isinstance(error, RankGoneError)
    text = str(got[SetCallKind.ADD][1])
    assert text.startswith("add_process_set cannot complete: rank 2 (host h, pid ")
    assert text.endswith(") has shut down")
    answer = the_answer(add(job, 1, 1, [0, 1]))
    assert answer.worker_ids == ("w1",) and isinstance(answer.error, RankGoneError)


def test_a_lost_rank_fails_waiting_calls():
    job = form(2)
    add(job, 0, 1, [0, 1])
    answer = the_answer(state.stream_closed(job, "w1", job.generation, 1.0))
    assert answer.worker_ids == ("w0",) and isinstance(answer.error, RankGoneError)
    assert "rank 1 (host h, pid " in error_text(answer)
    assert error_text(answer).endswith("was lost: stream closed")


def test_an_elastic_reset_fails_waiting_calls():
    job = form(2, min_size=1)
    add(job, 0, 1, [0, 1])
    answer = the_answer(state.leave(job, "w1", "reset", 1.0, rejoin=True))
    assert answer.worker_ids == ("w0",) and isinstance(answer.error, RankGoneError)
    assert "left for an elastic reset" in error_text(answer)


# ---- a world of one -----------------------------------------------------------------------


def test_a_world_of_one_decides_each_call_alone_with_the_same_messages():
    local = LocalNegotiation(0)
    local.add_process_set(1, [0])
    with pytest.raises(InvalidRequestError) as info:
        local.add_process_set(2, [0], "ProcessSet([0]) has already been added")
    assert str(info.value) == (
        "add_process_set failed on every rank because of rank 0: "
        "ProcessSet([0]) has already been added"
    )
    with pytest.raises(InvalidRequestError, match=r"must lie in \[0, 1\)"):
        local.add_process_set(2, [0, 1])
    with pytest.raises(InvalidRequestError, match="because of rank 0: the global process set"):
        local.remove_process_set(0, "the global process set cannot be removed")
    assert local.remove_process_set(-1) == []
    assert local.remove_process_set(1) == []
