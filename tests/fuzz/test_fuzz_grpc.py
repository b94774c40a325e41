"""Fuzzing every RPC of every hora.v1 service against a real coordinator.

Two fuzzers (the draws are in :mod:`grpc_fuzzing`):

- Hypothesis-made messages, wild or aimed at a live job: empty, negative and
  huge numbers, unknown enum values, duplicate ranks, wrong job ids, long
  strings; unary calls from one to three callers at once (collectives need
  every rank), negotiation streams from both workers of the job.
- Raw bytes: noise, blobs over the message limit, and valid requests with
  bytes flipped, inserted, dropped or cut off (a length that runs past the
  end, a string that is not UTF-8, a varint that never ends); with the
  token, a wrong one and none.

Each call must end OK or with a planned refusal
(:data:`fuzz_target.ALLOWED_CODES`) whose details reach the caller whole,
and every error a stream answers must stay a few KiB. After both, the coordinator must still
serve, train a fresh 2-rank job, have stayed small, and have logged no
traceback (the last test of the module).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from fuzz_target import RESPONSE_ERROR_LIMIT, FuzzTarget, assert_refusal_ok, fuzz_settings
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_fuzzing import (
    CALL_TIMEOUT_S,
    METHODS,
    STREAM_TIMEOUT_S,
    STREAMING,
    UNARY,
    WORLDS,
    code_of,
    encode,
    gather_world,
    path,
    payloads,
    stream_calls,
    substitute,
    unary_calls,
)
from hypothesis import given
from hypothesis import strategies as st

pytestmark = [pytest.mark.multiprocess, pytest.mark.fuzz, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def channel(fuzz_target: FuzzTarget) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", 8 * 1024 * 1024)]
    with grpc.insecure_channel(fuzz_target.proc.grpc_address, options=options) as ch:
        yield ch


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


@pytest.mark.parametrize("method", UNARY, ids=path)
def test_unary_methods_refuse_what_they_cannot_serve(method, fuzz_target, channel, pool):
    out_cls = GetMessageClass(method.output_type)
    stub = channel.unary_unary(path(method), request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=out_cls.FromString)
    metadata = fuzz_target.proc.metadata

    @fuzz_settings(max_examples=20)
    @given(requests=unary_calls(method), world=WORLDS)
    def fuzz(requests: list[Message], world: dict[str, int]) -> None:
        names = gather_world(channel, metadata, world)
        sent = [substitute(r, names) for r in requests]
        calls = [
            pool.submit(code_of, lambda r=r: stub(r, metadata=metadata, timeout=CALL_TIMEOUT_S))
            for r in sent
        ]
        for request, call in zip(sent, calls, strict=True):
            code, details = call.result(timeout=30)
            assert_refusal_ok(code, details, request)

    fuzz()


def assert_errors_short(message: Message) -> None:
    """Every ``error_message`` field in ``message``, at any depth, is a few KiB at most."""
    for field, value in message.ListFields():
        if field.message_type is not None:
            for item in [value] if isinstance(value, Message) else value:
                assert_errors_short(item)
        elif field.name == "error_message":
            assert len(value) <= RESPONSE_ERROR_LIMIT, (len(value), value[:300])


@pytest.mark.parametrize("method", STREAMING, ids=path)
def test_streams_refuse_what_they_cannot_serve(method, fuzz_target, channel, pool):
    out_cls = GetMessageClass(method.output_type)
    kind = {(True, True): channel.stream_stream, (True, False): channel.stream_unary,
            (False, True): channel.unary_stream}[(method.client_streaming, method.server_streaming)]
    stub = kind(path(method), request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=out_cls.FromString)
    metadata = fuzz_target.proc.metadata

    def run(messages: list[Message], all_sent: threading.Barrier) -> None:
        try:
            if method.client_streaming:
                def sending() -> Iterator[Message]:
                    yield from messages
                    # Every worker's messages are in before any stream half-closes
                    # (which loses its member): they meet in the table together.
                    with contextlib.suppress(threading.BrokenBarrierError):
                        all_sent.wait(timeout=STREAM_TIMEOUT_S / 2)
                    time.sleep(0.02)

                answer = stub(sending(), metadata=metadata, timeout=STREAM_TIMEOUT_S)
            else:
                request = messages[0] if messages else GetMessageClass(method.input_type)()
                answer = stub(request, metadata=metadata, timeout=STREAM_TIMEOUT_S)
            if method.server_streaming:
                for message in answer:
                    assert_errors_short(message)
        finally:
            all_sent.abort()  # a stream refused early never gets there: nobody waits for it

    @fuzz_settings(max_examples=80)
    @given(streams=stream_calls(method), world=WORLDS)
    def fuzz(streams: list[list[Message]], world: dict[str, int]) -> None:
        names = gather_world(channel, metadata, world)
        sent = [[substitute(m, names) for m in messages] for messages in streams]
        all_sent = threading.Barrier(len(sent))
        calls = [pool.submit(code_of, lambda s=s: run(s, all_sent)) for s in sent]
        for messages, call in zip(sent, calls, strict=True):
            code, details = call.result(timeout=30)
            assert_refusal_ok(code, details, messages)

    fuzz()


@pytest.mark.parametrize("method", METHODS, ids=path)
def test_raw_bytes_are_refused_or_served(method, fuzz_target, channel):
    streaming_in, streaming_out = method.client_streaming, method.server_streaming
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    stub = kind[(streaming_in, streaming_out)](path(method), request_serializer=None,
                                               response_deserializer=None)
    tokens = st.sampled_from([fuzz_target.proc.metadata] * 4 + [(), (("hora-token", "x"),)])

    def call(requests: list[bytes], metadata: Any) -> None:
        arg = iter(requests) if streaming_in else requests[0]
        answer = stub(arg, metadata=metadata, timeout=CALL_TIMEOUT_S)
        if streaming_out:
            list(answer)

    @fuzz_settings(max_examples=30 if streaming_in else 12)
    @given(requests=st.lists(payloads(method), min_size=1, max_size=3 if streaming_in else 1),
           metadata=tokens)
    def fuzz(requests: list[tuple[str, Any]], metadata: Any) -> None:
        names = gather_world(channel, fuzz_target.proc.metadata)
        sent = [encode(r, names) for r in requests]
        code, details = code_of(lambda: call(sent, metadata))
        assert_refusal_ok(code, details, [s[:200] for s in sent])

    fuzz()


def test_many_garbage_calls_at_once_are_refused_alike(fuzz_target, channel):
    """A burst from many threads: the refusals do not interfere with each other."""
    join = channel.unary_unary("/hora.v1.Rendezvous/Join", request_serializer=None,
                               response_deserializer=None)
    metadata = fuzz_target.proc.metadata
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(
            lambda i: code_of(lambda: join(bytes([0xFF, i % 256]) * 8, metadata=metadata,
                                           timeout=5))[0],
            range(200),
        ))
    assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}


def test_after_fuzzing_the_coordinator_serves_and_trains(fuzz_target, tmp_path):
    fuzz_target.assert_survived(tmp_path)
