"""A real coordinator process under a burst of calls, as when every rank of a large job
starts at once."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from hora_proto.v1 import rendezvous_pb2 as rpb
from hora_proto.v1 import rendezvous_pb2_grpc

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_a_burst_of_thousands_of_calls_is_served_not_refused(coordinator_factory):
    # gRPC core refuses calls waiting for the event loop past 1,000 by default
    # (RESOURCE_EXHAUSTED: "too many pending requests"); every rank of a job of
    # a few thousand calls Join at once.
    proc = coordinator_factory()
    calls = 6000

    async def burst() -> Counter[str]:
        channels = [grpc.aio.insecure_channel(proc.grpc_address) for _ in range(20)]
        stubs = [rendezvous_pb2_grpc.RendezvousStub(c) for c in channels]

        async def one(i: int) -> str:
            try:
                await stubs[i % len(stubs)].Heartbeat(
                    rpb.HeartbeatRequest(job_id="nobody", worker_id=f"w{i}"),
                    metadata=proc.metadata, timeout=90)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "OK"

        try:
            return Counter(await asyncio.gather(*(one(i) for i in range(calls))))
        finally:
            for channel in channels:
                await channel.close()

    outcomes = asyncio.run(burst())
    assert outcomes == Counter({"NOT_FOUND": calls}), outcomes  # the job is unknown
