"""Numbered response lists and their re-sending to a rank that missed some (issue 28).

Pure transitions: a job formed in memory stands for the restarted
coordinator's (a fresh negotiation table); the members' reports are what a
stream's open carries.
"""

from __future__ import annotations

import logging

import pytest
from coordinator_transitions import form, sends, submit, treq

from hora_coordinator import state, wire
from hora_coordinator.messages import CoordinatorMessage, ReceivedLists, ResponseList
from hora_negotiation.deliveries import HISTORY
from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def lists_to(effects, worker: str) -> list[ResponseList]:
    return [s.message.responses for s in sends(effects)
            if worker in s.worker_ids and s.message.responses is not None]


def reopen(job: state.Job, rank: int, *received: ReceivedLists) -> list[state.Effect]:
    member = state.open_stream(job, f"w{rank}", job.generation, 0.0)
    return state.redeliver(job, member, received)


def resent(name: str, received_list: int):
    return treq(name, resent=True, received_list=received_list)


def answered_list(job: state.Job, name: str) -> ResponseList:
    """List 1 of the global set as the dead coordinator sent it: answers ``name``."""
    submit(job, 0, treq(name))
    (sent,) = lists_to(submit(job, 1, treq(name)), "w0")
    return sent


def test_lists_to_a_set_are_numbered_from_1_the_same_for_every_rank():
    job = form(2)
    for step, name in enumerate(["a", "b", "c"], start=1):
        submit(job, 0, treq(name))
        effects = submit(job, 1, treq(name))
        (send,) = sends(effects)
        assert set(send.worker_ids) == {"w0", "w1"}
        assert send.message.responses.number == step
    # A set of its own counts its own lists.
    job.table.add_process_set(1, [0, 1])
    submit(job, 0, treq("s", process_set_id=1))
    (numbered,) = lists_to(submit(job, 1, treq("s", process_set_id=1)), "w1")
    assert numbered.number == 1


def test_a_list_rank_0_got_is_re_sent_to_rank_1_and_its_stale_request_dropped():
    sent = answered_list(form(2), "a")
    job = form(2)  # the restarted coordinator: nothing in flight, no numbers
    assert reopen(job, 0, ReceivedLists(0, sent.number, (sent,))) == []
    effects = reopen(job, 1)  # rank 1 received nothing
    assert lists_to(effects, "w1") == [sent]
    assert lists_to(effects, "w0") == []
    # Rank 1 sent "a" again before the re-sent list reached it: not negotiated again.
    assert submit(job, 1, resent("a", 0)) == []
    assert job.table.pending == {}
    # The next step's "a" is a new tensor, numbered after the re-sent list.
    submit(job, 0, treq("a"))
    (nxt,) = lists_to(submit(job, 1, treq("a")), "w1")
    assert nxt.number == sent.number + 1
    assert nxt.responses[0].tensor_names == ("a",)


def test_a_request_sent_again_before_the_holder_reported_is_withdrawn():
    sent = answered_list(form(2), "a")
    job = form(2)
    assert reopen(job, 1) == []  # nobody has reported list 1 yet
    assert submit(job, 1, resent("a", 0)) == []
    assert (0, "a") in job.table.pending
    effects = reopen(job, 0, ReceivedLists(0, 1, (sent,)))
    assert lists_to(effects, "w1") == [sent]
    assert lists_to(effects, "w0") == []
    assert job.table.pending == {}, "rank 1's stale request must not wait for rank 0"
    submit(job, 0, treq("a"))
    (nxt,) = lists_to(submit(job, 1, treq("a")), "w0")
    assert nxt.number == 2


def test_a_rank_that_holds_every_list_gets_nothing_again():
    sent = answered_list(form(2), "a")
    job = form(2)
    report = ReceivedLists(0, 1, (sent,))
    assert reopen(job, 0, report) == []
    assert reopen(job, 1, report) == []
    assert not job.table.deliveries.watching


def test_a_coordinator_that_never_went_away_re_sends_from_its_own_record():
    job = form(2)
    sent = answered_list(job, "a")
    # List 1 never left rank 1's outbox, and rank 1 opens another stream (a
    # partition the coordinator did not see as a closed stream).
    assert lists_to(reopen(job, 1), "w1") == [sent]


def test_lists_no_member_holds_any_more_are_named_not_sent():
    job = form(2)
    old = [answered_list(job, f"t{i}") for i in range(HISTORY + 2)]
    restarted = form(2)
    # Rank 0 reports what it keeps (the newest lists only); rank 1 has none of them.
    reopen(restarted, 0, ReceivedLists(0, old[-1].number, tuple(old[2:])))
    effects = reopen(restarted, 1)
    assert lists_to(effects, "w1") == []
    (warning,) = [e for e in effects if isinstance(e, state.Log)]
    assert warning.level == logging.WARNING
    assert "missed response list(s) [1, 2], which no member holds" in warning.message


def test_a_list_of_another_set_in_a_report_is_ignored():
    job = form(2)
    sent = answered_list(job, "a")
    restarted = form(2)
    # Claimed for set 3, but its responses are the global set's: not kept.
    reopen(restarted, 0, ReceivedLists(3, 1, (sent,)))
    assert lists_to(reopen(restarted, 1, ReceivedLists(3, 0)), "w1") == []


def test_a_list_survives_the_round_trip_through_a_worker_report():
    job = form(2)
    job.table.add_process_set(1, [0, 1])
    submit(job, 0, treq("g", process_set_id=1, group_id=7, group_size=1))
    (sent,) = lists_to(submit(job, 1, treq("g", process_set_id=1, group_id=7, group_size=1)),
                       "w0")
    on_the_wire = wire.coordinator_message_pb(CoordinatorMessage(responses=sent)).responses
    assert on_the_wire.number == 1
    opened = npb.StreamOpen(received=[npb.ReceivedLists(
        process_set_id=1, last_number=1, recent=[on_the_wire])])
    assert wire.received_lists(opened) == (ReceivedLists(1, 1, (sent,)),)
