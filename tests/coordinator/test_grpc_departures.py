"""Many members leaving at once over real gRPC: departure notices stay O(members)."""

from __future__ import annotations

import time

import httpx
import pytest
from coordinator_clients import Client, open_world
from prometheus_client.parser import text_string_to_metric_families

from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

N = 200


def samples(proc, job: str) -> dict[str, float]:
    text = httpx.get(f"{proc.http_url}/metrics", timeout=5).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("job_id") == job
    }


def test_every_member_leaving_queues_o_n_messages_and_no_queue_outlives_its_stream(
    coordinator_factory,
):
    proc = coordinator_factory("--lease-s", "60", "--stall-check-interval-s", "1")
    client = Client(proc.grpc_address, proc.token)
    try:
        job, workers, streams = open_world(client, N)
        for worker, stream in zip(workers, streams, strict=True):
            client.leave(job, worker)
            stream.close()
        for stream in streams:  # every stream ends cleanly, whatever it heard first
            with pytest.raises(AssertionError, match="ended the stream"):
                while True:
                    message = stream.recv(timeout=10)
                    assert message.event.type == npb.EVENT_TYPE_MEMBER_LEFT, message
        deadline = time.monotonic() + 10
        while samples(proc, job).get("hora_stream_outboxes") != 0:
            assert time.monotonic() < deadline, samples(proc, job)
            time.sleep(0.1)
        counted = samples(proc, job)
        assert counted["hora_stream_messages_total"] <= 4 * N, counted
        assert counted["hora_stream_queued_messages"] == 0, counted
        detail = httpx.get(f"{proc.http_url}/api/v1/jobs/{job}", timeout=5).json()
        assert detail["state"] == "finished"
    finally:
        client.close()
