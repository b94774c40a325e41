"""What the gRPC fuzzers draw and send: methods, aims, live worlds, mangled bytes.

Methods are found from the service descriptors of ``hora.v1`` and requests
are built from the message descriptors (:mod:`proto_strategies`), so a new
RPC or field is fuzzed without touching this file. Every example first
gathers a fresh 2-member job (:func:`gather_world`, with settings drawn from
:data:`WORLDS`); placeholders in the drawn messages ("@job", "@w0", "@w1")
become its ids (:func:`substitute`), so that many calls reach the code behind
"unknown job".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st
from proto_strategies import message_strategy

from hora_proto.v1 import negotiation_pb2, rendezvous_pb2, store_pb2

__all__ = [
    "AIM", "CALL_TIMEOUT_S", "METHODS", "STREAMING", "STREAM_TIMEOUT_S", "UNARY", "WORLDS",
    "code_of", "encode", "gather_world", "path", "payloads", "stream_calls", "substitute",
    "unary_calls",
]

METHODS: list[MethodDescriptor] = [
    method
    for module in (rendezvous_pb2, store_pb2, negotiation_pb2)
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]
UNARY = [m for m in METHODS if not (m.client_streaming or m.server_streaming)]
STREAMING = [m for m in METHODS if m.client_streaming or m.server_streaming]

JOB, WORKERS = "@job", ("@w0", "@w1")
# Where aimed draws aim (by field name, wherever it occurs): the example's
# live job and workers, and values its ranks can agree on.
AIM = {
    "job_id": st.just(JOB),
    "worker_id": st.sampled_from(WORKERS),
    "generation": st.just(1),
    "expected_size": st.sampled_from([1, 2]),
    "rank_hint": st.integers(-1, 1),
    "ranks": st.sampled_from([[0, 1], [0], [1]]),
    "process_set_id": st.sampled_from([0, 0, 0, 1]),
    "key": st.sampled_from(["k", "n"]),
    "keys": st.sampled_from([["k"], ["k", "n"]]),
    "timeout_ms": st.integers(0, 100),
    "name": st.sampled_from(["a", "b", "c"]),
    "op_type": st.sampled_from([1, 2, 3, 4, 5, 6, 7]),
    "reduce_op": st.sampled_from([1, 2]),
    "prescale_factor": st.just(1.0),
    "postscale_factor": st.just(1.0),
    "dtype": st.sampled_from(["float32", "int64"]),
    "device": st.just("cpu"),
    "shape": st.sampled_from([[4], [2, 2], []]),
    "splits": st.sampled_from([[2, 2], [4, 0]]),
    "kind": st.sampled_from(["blacklist", "worker_started"]),
}
# Client-streaming methods: a valid first message, put first in most examples.
VALID_FIRST: dict[str, Callable[[str], Message]] = {
    "hora.v1.Negotiation.Negotiate": lambda worker: negotiation_pb2.WorkerMessage(
        open=negotiation_pb2.StreamOpen(job_id=JOB, worker_id=worker, generation=1)
    ),
}
# After the valid first message, aimed stream messages carry requests.
STREAM_AIM = {"oneof:kind": st.just("requests")}
CALL_TIMEOUT_S = 0.3
STREAM_TIMEOUT_S = 3.0
_jobs = itertools.count()


def path(method: MethodDescriptor) -> str:
    """``/hora.v1.Service/Method``, as gRPC names a method on the wire."""
    return f"/{method.containing_service.full_name}/{method.name}"


def substitute(message: Message, names: dict[str, str]) -> Message:
    """A copy of ``message`` with every string field equal to a placeholder replaced.

    A copy: Hypothesis may hand the same drawn object to later examples.
    """
    copy = type(message)()
    copy.CopyFrom(message)
    _substitute(copy, names)
    return copy


def _substitute(message: Message, names: dict[str, str]) -> None:
    for field, value in message.ListFields():
        repeated = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            continue  # a map of option names to values (JoinRequest.job_options): no ids
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value if repeated else [value]:
                _substitute(item, names)
        elif field.type == FieldDescriptor.TYPE_STRING:
            if repeated:
                value[:] = [names.get(v, v) for v in value]
            elif value in names:
                setattr(message, field.name, names[value])


#: Settings of the live job each example gathers (what its first joiner sends):
#: fusion, stall warnings and shutdowns that fire within the example, elastic bounds.
WORLDS = st.fixed_dictionaries({
    # Both ends of the accepted range (a negative or larger one is refused: see
    # tests/security/test_job_isolation.py::test_values_that_would_overflow_later_are_refused).
    "fusion_threshold_bytes": st.sampled_from([0, 16, 1 << 20, 2**53]),
    "stall_warning_ms": st.sampled_from([0, 0, 1, 30]),
    "stall_shutdown_ms": st.sampled_from([0, 0, 0, 1, 200]),
    "min_size": st.sampled_from([0, 0, 1, 2]),
    "max_size": st.sampled_from([0, 2, 3]),
    "elastic_timeout_ms": st.sampled_from([0, 10_000]),
})


def gather_world(channel: grpc.Channel, metadata: Any,
                 config: dict[str, int] | None = None) -> dict[str, str]:
    """A fresh running 2-member job (with ``config`` from :data:`WORLDS`); placeholder -> id."""
    config = dict(config or {})
    if not config.get("min_size"):
        config.pop("max_size", None)  # not elastic: a max size alone is refused
        config.pop("elastic_timeout_ms", None)
    job = f"fz-{next(_jobs)}"
    join = channel.unary_unary("/hora.v1.Rendezvous/Join",
                               request_serializer=rendezvous_pb2.JoinRequest.SerializeToString,
                               response_deserializer=rendezvous_pb2.JoinResponse.FromString)
    futures = [
        join.future(rendezvous_pb2.JoinRequest(job_id=job, worker_id=f"{job}-w{i}", host="h",
                                               pid=i + 1, expected_size=2, rank_hint=i,
                                               **config),
                    metadata=metadata, timeout=10)
        for i in range(2)
    ]
    for future in futures:
        future.result()
    return {JOB: job, WORKERS[0]: f"{job}-w0", WORKERS[1]: f"{job}-w1"}


def code_of(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """The status code and details ``call`` ended with."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def unary_calls(method: MethodDescriptor) -> st.SearchStrategy[list[Message]]:
    """One to three requests of ``method``, sent at once (collectives need every rank)."""
    return st.lists(message_strategy(method.input_type, AIM), min_size=1, max_size=3)


def stream_calls(method: MethodDescriptor) -> st.SearchStrategy[list[list[Message]]]:
    """Per live worker, the messages of its stream: a valid first one in most examples,
    and in half of them the same body on every stream, as the ranks of a job send."""
    body = st.lists(message_strategy(method.input_type, {**AIM, **STREAM_AIM}), max_size=4)
    first = VALID_FIRST.get(method.full_name)

    def lead(worker: str) -> st.SearchStrategy[list[Message]]:
        if first is None:
            return st.just([])
        return st.sampled_from([[first(worker)]] * 3 + [[]])

    leads = st.tuples(*(lead(w) for w in WORKERS))
    same = st.builds(lambda heads, shared: [h + shared for h in heads], leads, body)
    apart = st.builds(lambda heads, bodies: [h + b for h, b in zip(heads, bodies, strict=True)],
                      leads, st.tuples(*(body for _ in WORKERS)))
    return st.one_of(same, apart)


# (position, byte, operation): a position past the end wraps around.
Mutation = tuple[int, int, str]
mutations = st.lists(
    st.tuples(st.integers(0, 2**16), st.integers(0, 255),
              st.sampled_from(["flip", "set", "insert", "delete", "truncate"])),
    min_size=1, max_size=4,
)


def mutate(data: bytes, changes: list[Mutation]) -> bytes:
    """``data`` with each change applied in turn."""
    out = bytearray(data)
    for position, byte, operation in changes:
        if operation == "insert":
            out.insert(position % (len(out) + 1), byte)
            continue
        if not out:
            continue
        i = position % len(out)
        if operation == "flip":
            out[i] ^= 1 << (byte % 8)
        elif operation == "set":
            out[i] = byte
        elif operation == "delete":
            del out[i]
        else:
            del out[i:]
    return bytes(out)


def payloads(method: MethodDescriptor) -> st.SearchStrategy[tuple[str, Any]]:
    """What one request is made of: noise, an oversized blob, or a valid request to mutate."""
    return st.one_of(
        st.tuples(st.just("mutated"),
                  st.tuples(message_strategy(method.input_type, AIM), mutations)),
        st.tuples(st.just("raw"), st.binary(max_size=64)),
        st.tuples(st.just("raw"), st.builds(lambda n: b"\x0a" + b"\xff" * n,
                                            st.integers(262_144, 400_000))),
    )


def encode(payload: tuple[str, Any], names: dict[str, str]) -> bytes:
    """The bytes to send for a drawn payload, aimed at the live job ``names`` names."""
    kind, value = payload
    if kind == "raw":
        return value
    message, changes = value
    return mutate(substitute(message, names).SerializeToString(), changes)
