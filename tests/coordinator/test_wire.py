"""Unit tests of the wire adapter: the domain twins match hora.v1, and convert both ways."""

from __future__ import annotations

import dataclasses
import enum

import pytest
from coordinator_transitions import admits, form, jreq, responses_to

from hora_coordinator import messages, state, wire
from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.mark.parametrize(
    ("twin", "wire_enum", "prefix"),
    [
        (messages.OpType, npb.OpType, "OP_TYPE_"),
        (messages.ReduceOp, npb.ReduceOp, "REDUCE_OP_"),
        (messages.ResponseType, npb.ResponseType, "RESPONSE_TYPE_"),
        (messages.ErrorKind, npb.ErrorKind, "ERROR_KIND_"),
        (messages.EventType, npb.EventType, "EVENT_TYPE_"),
        (messages.JobState, rpb.JobState, "JOB_STATE_"),
    ],
)
def test_enum_twins_have_the_proto_names_and_numbers(twin: type[enum.IntEnum], wire_enum, prefix):
    on_wire = {name.removeprefix(prefix): number for name, number in wire_enum.items()}
    assert {m.name: m.value for m in twin} == on_wire


@pytest.mark.parametrize(
    ("twin", "message"),
    [
        (messages.JoinRequest, rpb.JoinRequest),
        (messages.PlainTensorRequest, npb.TensorRequest),
        (messages.Response, npb.Response),
        (messages.ResponseList, npb.ResponseList),
        (messages.Event, npb.Event),
        (messages.CoordinatorMessage, npb.CoordinatorMessage),
        (state.WorldView, rpb.WorldView),
        (state.WorldMember, rpb.Member),
        (state.HeartbeatReply, rpb.HeartbeatResponse),
        (state.StreamHeartbeatAnswer, npb.StreamHeartbeatAnswer),
        (state.JobEvent, rpb.JobEvent),
    ],
)
def test_dataclass_twins_have_the_proto_field_names(twin, message):
    assert [f.name for f in dataclasses.fields(twin)] == [
        f.name for f in message.DESCRIPTOR.fields
    ]


def test_join_request_copies_every_field():
    message = rpb.JoinRequest(
        job_id="j", worker_id="w", host="h", pid=7, expected_size=4, rank_hint=2,
        data_plane_address="10.0.0.1", fusion_threshold_bytes=64, stall_warning_ms=5,
        stall_shutdown_ms=9, min_size=1, max_size=8, elastic_timeout_ms=1000,
    )
    twin = wire.join_request(message)
    assert dataclasses.asdict(twin) == {
        f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields
    }


def test_views_of_one_world_share_one_encoded_member_list_and_match_one_by_one():
    job = state.new_job("job", 0.0)
    state.join(job, jreq("a", 3, host="x"), 0.0)
    state.join(job, jreq("b", 3, host="y"), 0.0)
    views = admits(state.join(job, jreq("c", 3, host="x"), 1.5))
    templates: wire.ViewTemplates = {}
    shared = {w: wire.world_view_pb(v, templates) for w, v in views.items()}
    assert len(templates) == 1
    alone = {w: wire.world_view_pb(v) for w, v in views.items()}
    assert shared == alone
    encoded = shared["c"]
    assert (encoded.rank, encoded.local_rank, encoded.local_size, encoded.cross_rank) == (
        views["c"].rank, views["c"].local_rank, views["c"].local_size, views["c"].cross_rank
    )
    assert encoded.store_prefix == "job/gen-1/" and encoded.size == 3
    assert [m.state for m in encoded.members] == [rpb.MEMBER_STATE_ACTIVE] * 3
    assert [m.last_heartbeat_unix_ms for m in encoded.members] == [1500] * 3


def test_heartbeat_and_events_encode_field_by_field():
    job = form(2)
    reply = wire.heartbeat_pb(state.heartbeat(job, "w0", 2.0, lease_s=3.0))
    assert (reply.generation, reply.job_state, reply.lease_ms) == (1, rpb.JOB_STATE_RUNNING, 3000)
    state.report_event(job, "blacklist", "h9", "too many failures", 4.0)
    events = wire.list_events_response_pb(state.event_log(job)).events
    assert [e.kind for e in events] == ["join", "join", "generation", "blacklist"]
    assert (events[-1].unix_ms, events[-1].host, events[-1].rank) == (4000, "h9", -1)


def test_a_stream_heartbeat_answer_carries_its_sequence_and_the_lease():
    job = form(2)
    reply = state.heartbeat(job, "w0", 2.0, lease_s=8.0, interval_s=2.0)
    encoded = wire.coordinator_message_pb(
        messages.CoordinatorMessage(heartbeat=state.StreamHeartbeatAnswer(7, reply))
    )
    assert encoded.WhichOneof("kind") == "heartbeat"
    assert encoded.heartbeat.sequence == 7
    assert (encoded.heartbeat.state.lease_ms, encoded.heartbeat.state.interval_ms) == (8000, 2000)
    assert encoded.heartbeat.state.job_state == rpb.JOB_STATE_RUNNING


def test_the_transitions_negotiate_plain_requests_without_protobuf():
    job = form(2)
    fill = messages.PlainTensorRequest(
        name="x", op_type=messages.OpType.ALLREDUCE, dtype="float32", shape=(2,),
        device="cpu", reduce_op=messages.ReduceOp.SUM, prescale_factor=1.0,
        postscale_factor=1.0,
    )
    join = messages.PlainTensorRequest(name="join.1", op_type=messages.OpType.JOIN)
    state.handle_requests(job, "w1", 1, [join], 0.0)
    effects = state.handle_requests(job, "w0", 1, [fill], 0.0)
    (response,) = responses_to(effects, "w1")
    assert response == messages.Response(
        type=messages.ResponseType.ALLREDUCE, tensor_names=("x",), join_fill=(fill,)
    )
    (send,) = [e for e in effects if isinstance(e, state.Send)]
    encoded = wire.coordinator_message_pb(send.message)
    assert encoded.WhichOneof("kind") == "responses"
    (on_wire,) = encoded.responses.responses
    assert (on_wire.type, list(on_wire.tensor_names)) == (npb.RESPONSE_TYPE_ALLREDUCE, ["x"])
    assert on_wire.join_fill[0] == npb.TensorRequest(
        name="x", op_type=npb.OP_TYPE_ALLREDUCE, dtype="float32", shape=[2], device="cpu",
        reduce_op=npb.REDUCE_OP_SUM, prescale_factor=1.0, postscale_factor=1.0,
    )


def test_an_event_message_encodes_as_the_event_kind():
    job = form(3)
    effects = state.stream_closed(job, "w1", 1, 1.25)
    first = next(e for e in effects if isinstance(e, state.Send))
    encoded = wire.coordinator_message_pb(first.message)
    assert encoded.WhichOneof("kind") == "event"
    assert (encoded.event.type, encoded.event.rank, encoded.event.unix_ms) == (
        npb.EVENT_TYPE_MEMBER_LOST, 1, 1250
    )
    assert encoded.event.message == "stream closed"


def test_only_the_adapters_import_protobuf():
    # The state machine stays readable and testable without the stubs: it must
    # not import them (the hora_proto policy modules are plain Python).
    import ast
    from pathlib import Path

    import hora_coordinator

    root = Path(hora_coordinator.__file__).parent
    pure = [root / "messages.py", *sorted((root / "state").glob("*.py")),
            *sorted((root / "negotiation").glob("*.py"))]
    offenders = []
    for path in pure:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [
                f"{path.relative_to(root)}: {name}"
                for name in names
                if name.startswith(("hora_proto.v1", "google.protobuf", "grpc"))
            ]
    assert offenders == []
