"""What a rank keeps of the numbered response lists it received (issue 28)."""

from __future__ import annotations

import pytest

from hora.engine.received import HISTORY, REPORT_BYTES, ReceivedLog
from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def numbered(number: int, *names: str, set_id: int = 0) -> npb.ResponseList:
    return npb.ResponseList(number=number, responses=[npb.Response(
        type=npb.RESPONSE_TYPE_ALLREDUCE, tensor_names=list(names), process_set_id=set_id)])


def test_a_list_received_again_is_not_run_again():
    log = ReceivedLog()
    assert log.first_time(numbered(1, "a"))
    assert log.first_time(numbered(2, "b"))
    assert not log.first_time(numbered(2, "b"))
    assert not log.first_time(numbered(1, "a"))
    # Sets count apart; a list for one rank only (errors) is not numbered.
    assert log.first_time(numbered(1, "s", set_id=3))
    unnumbered = npb.ResponseList(responses=[npb.Response(type=npb.RESPONSE_TYPE_ERROR)])
    assert log.first_time(unnumbered) and log.first_time(unnumbered)


def test_the_report_names_each_sets_last_list_and_its_newest_lists():
    log = ReceivedLog()
    for n in range(1, HISTORY + 11):
        log.first_time(numbered(n, f"t{n}"))
    log.first_time(numbered(1, "s", set_id=2))
    reports = {r.process_set_id: r for r in log.report()}
    assert reports[0].last_number == HISTORY + 10
    assert [lst.number for lst in reports[0].recent] == list(range(11, HISTORY + 11))
    assert reports[2].last_number == 1 and reports[2].recent[0].responses[0].tensor_names == ["s"]


def test_the_report_stays_under_its_byte_budget_keeping_the_newest():
    log = ReceivedLog()
    names = [f"layer{i}.weight" + "x" * 200 for i in range(200)]
    for n in range(1, HISTORY + 1):
        log.first_time(numbered(n, *names))
    (report,) = log.report()
    assert report.last_number == HISTORY
    assert sum(lst.ByteSize() for lst in report.recent) <= REPORT_BYTES
    assert 0 < len(report.recent) < HISTORY
    assert report.recent[-1].number == HISTORY


def test_a_request_sent_again_carries_the_last_list_of_its_set():
    log = ReceivedLog()
    log.first_time(numbered(5, "a"))
    original = npb.TensorRequest(name="b", op_type=npb.OP_TYPE_ALLREDUCE, dtype="float32")
    again = log.resent(original)
    assert again.resent and again.received_list == 5
    assert again.name == "b" and not original.resent  # the original is left as it was
    other = log.resent(npb.TensorRequest(name="c", process_set_id=4))
    assert other.resent and other.received_list == 0
