"""A worker's burst of tensor requests goes out in messages the coordinator accepts."""

from __future__ import annotations

import queue

import pytest

from hora._client import _CLOSE, NegotiationStream
from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

# The coordinator's default --max-message-bytes.
COORDINATOR_LIMIT = 4 * 1024 * 1024


def test_a_burst_is_split_into_messages_below_the_coordinators_limit():
    # A stream only drains its queue here; no channel is needed to test that.
    stream = NegotiationStream.__new__(NegotiationStream)
    stream._queue = queue.SimpleQueue()
    sent = [
        npb.TensorRequest(name=f"model.block{i}.attention.weight.grad", op_type=1,
                          dtype="float32", shape=[1024, 1024], device="cpu", reduce_op=1,
                          prescale_factor=1.0, postscale_factor=1.0)
        for i in range(60_000)  # about 6 MiB of requests queued at once
    ]
    for request in sent:
        stream._queue.put(request)
    stream._queue.put(_CLOSE)
    messages = list(stream._requests())
    assert len(messages) > 1
    assert all(m.ByteSize() < COORDINATOR_LIMIT for m in messages)
    got = [r.name for m in messages for r in m.requests.requests]
    assert got == [r.name for r in sent]  # none lost, none reordered
