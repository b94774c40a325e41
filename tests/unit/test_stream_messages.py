"""What a worker puts on its negotiation stream: request batches and whole messages in order."""

from __future__ import annotations

import queue

import pytest

from hora._client import _CLOSE, stream_messages
from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_heartbeat_queued_amid_requests_goes_out_whole_and_in_its_place():
    items: queue.SimpleQueue[object] = queue.SimpleQueue()
    beat = npb.WorkerMessage(heartbeat=npb.StreamHeartbeat(sequence=1))
    for item in (npb.TensorRequest(name="a"), npb.TensorRequest(name="b"), beat,
                 npb.TensorRequest(name="c"), _CLOSE):
        items.put(item)
    sent = list(stream_messages(items))
    assert [m.WhichOneof("kind") for m in sent] == ["requests", "heartbeat", "requests"]
    assert [r.name for r in sent[0].requests.requests] == ["a", "b"]
    assert sent[1] == beat
    assert [r.name for r in sent[2].requests.requests] == ["c"]


def test_requests_queued_before_the_end_still_go_out():
    items: queue.SimpleQueue[object] = queue.SimpleQueue()
    for item in (npb.TensorRequest(name="a"), _CLOSE, npb.TensorRequest(name="late")):
        items.put(item)
    sent = list(stream_messages(items))
    assert [[r.name for r in m.requests.requests] for m in sent] == [["a"]]
