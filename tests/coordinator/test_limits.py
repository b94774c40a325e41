"""Unit tests of the coordinator's size limits (pure, no servers)."""

from __future__ import annotations

import dataclasses

import pytest
from coordinator_transitions import form, jreq

from hora_coordinator import CoordinatorSettings, state
from hora_coordinator.errors import InvalidRequestError
from hora_coordinator.limits import (
    check_event_limits,
    check_join_limits,
    split_long_tensor_names,
)
from hora_coordinator.messages import ErrorKind, ResponseType
from hora_coordinator.settings import parse_command_line
from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_an_overlong_id_is_refused_naming_the_job_cut_to_64_characters():
    settings = CoordinatorSettings(max_id_length=100)
    long_job = dataclasses.replace(jreq("w", 1), job_id="j" * 101)
    with pytest.raises(InvalidRequestError) as info:
        check_join_limits(settings, None, long_job)
    assert str(info.value) == (
        f"job_id of 101 characters is longer than the limit of 100 (job '{'j' * 64}…')"
    )
    with pytest.raises(InvalidRequestError) as info:
        check_join_limits(settings, None, jreq("w" * 101, 1))
    assert str(info.value) == (
        "worker_id of 101 characters is longer than the limit of 100 (job 'job')"
    )


def test_a_tensor_name_at_the_limit_passes_and_a_longer_one_fails_alone():
    settings = CoordinatorSettings(max_tensor_name_length=100)
    fine = [npb.TensorRequest(name="a" * 100), npb.TensorRequest(name="b")]
    kept, refused = split_long_tensor_names(settings, fine)
    assert kept is fine and refused == []
    long = npb.TensorRequest(name="x" * 101, process_set_id=3)
    kept, refused = split_long_tensor_names(settings, [fine[0], long, fine[1]])
    assert [r.name for r in kept] == ["a" * 100, "b"]
    (error,) = refused
    assert error.type is ResponseType.ERROR and error.error_kind is ErrorKind.INVALID
    assert error.tensor_names == ("x" * 101,) and error.process_set_id == 3
    assert error.error_message == (
        f"tensor '{'x' * 64}…': a name of 101 characters is longer than this "
        "coordinator's limit of 100 (max_tensor_name_length)"
    )


def test_the_event_log_keeps_the_newest_events_and_counts_the_dropped():
    job = state.new_job("job", 0.0, max_events=3)
    for i in range(5):
        state.report_event(job, "tick", "", str(i), float(i))
    assert [e.message for e in job.events] == ["2", "3", "4"]
    assert job.events_dropped == 2


def test_the_message_limit_leaves_room_for_a_compare_set_of_two_values():
    settings = CoordinatorSettings()
    assert settings.max_message_bytes == 4 * 1024 * 1024  # gRPC's default, now on purpose
    with pytest.raises(ValueError, match="max_message_bytes 1000 is too small"):
        CoordinatorSettings(max_message_bytes=1000)
    CoordinatorSettings(max_message_bytes=2 * 16 + 8 + 4 * 16 + 64, max_store_value_bytes=16,
                        max_store_key_bytes=8, max_id_length=16)
    parsed = parse_command_line(
        ["--max-message-bytes", "5000000", "--max-tensor-name-length", "7",
         "--max-events-per-job", "9"], environ={}
    ).settings
    assert (parsed.max_message_bytes, parsed.max_tensor_name_length,
            parsed.max_events_per_job) == (5_000_000, 7, 9)


def test_status_details_are_cut_to_fit_a_trailer_once_percent_encoded():
    from urllib.parse import quote

    from hora_coordinator.servicer import DETAILS_BUDGET_BYTES, status_details

    def encoded(text: str) -> int:  # grpc-message keeps printable ASCII but '%'
        return len(quote(text, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"))

    assert status_details("short and plain") == "short and plain"
    for text in ("x" * 10_000, "é" * 10_000, "🙂" * 10_000, "%" * 10_000, "a🙂%" * 3_000):
        cut = status_details(text)
        assert cut.endswith("…") and text.startswith(cut[:-1])
        assert encoded(cut) <= DETAILS_BUDGET_BYTES
        assert encoded(cut) > DETAILS_BUDGET_BYTES - 40  # cut near the budget, not far below


@pytest.mark.parametrize(
    ("field", "values"),
    [
        ("invalid", ["x" * 100_000, "y" * 100_000]),  # each rank's own complaint
        ("dtype", ["a" * 100_000, "b" * 100_000]),  # a mismatch quotes every value
        ("device", ["🙂" * 50_000, "c" * 100_000]),
    ],
)
def test_a_tensor_error_stays_a_few_kib_whatever_the_ranks_sent(field, values):
    from hora_negotiation import NegotiationTable

    size = 64
    table = NegotiationTable(size, 0)
    errors = []
    for rank in range(size):
        request = npb.TensorRequest(name="t", op_type=npb.OP_TYPE_ALLREDUCE, dtype="float32",
                                    shape=[4], device="cpu", reduce_op=npb.REDUCE_OP_SUM)
        setattr(request, field, values[rank % 2])
        outcome = table.submit(rank, [request], 0.0)
        errors += [r for _, answer in outcome.broadcasts for r in answer.responses]
    (error,) = errors
    assert error.type is ResponseType.ERROR and error.tensor_names == ("t",)
    assert len(error.error_message) <= 4096, len(error.error_message)
    assert error.error_message.startswith("tensor 't': ")


def test_a_host_or_address_longer_than_an_id_is_refused():
    settings = CoordinatorSettings(max_id_length=16)
    for field in ("host", "data_plane_address"):
        request = dataclasses.replace(jreq("w", 1), **{field: "h" * 17})
        with pytest.raises(InvalidRequestError, match=f"{field} of 17 characters .* limit of 16"):
            check_join_limits(settings, None, request)
        check_join_limits(settings, None, dataclasses.replace(jreq("w", 1), **{field: "h" * 16}))


def test_what_a_job_keeps_of_an_event_or_a_leave_is_bounded():
    settings = CoordinatorSettings(max_id_length=16)
    job = state.new_job("job", 0.0)
    for field in ("kind", "host"):
        fields = {"kind": "blacklist", "host": "h", "message": "", field: "k" * 17}
        with pytest.raises(InvalidRequestError, match=f"{field} of 17 characters"):
            check_event_limits(settings, **fields)
    check_event_limits(settings, "k" * 16, "h" * 16, "m" * 100_000)
    state.report_event(job, "tick", "h", "m" * 100_000, 1.0)
    (event,) = job.events
    assert len(event.message) == state.TEXT_LIMIT + 1 and event.message.endswith("…")
    left = form(2)
    state.leave(left, "w0", "r" * 100_000, 2.0)
    assert left.members[0].cause == "r" * state.TEXT_LIMIT + "…"
    assert left.events[-1].message == left.members[0].cause
