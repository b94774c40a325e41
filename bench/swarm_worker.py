"""One simulated worker of bench/load_swarm.py: its channel, its stream, its cadence.

What it does to the coordinator, step by step, is in load_swarm.py's docstring.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from hora_proto.v1 import (
    negotiation_pb2,
    negotiation_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

if TYPE_CHECKING:
    from load_swarm import Swarm

__all__ = ["FIRST_STEP_TENSORS", "LEGACY_HEARTBEAT_S", "WORKERS_PER_HOST", "Worker"]

# As many workers per simulated host (local ranks) as a large GPU node has.
WORKERS_PER_HOST = 8
FIRST_STEP_TENSORS = 8
LEGACY_HEARTBEAT_S = 1.0  # the client's fixed cadence before heartbeats moved to the stream


class Worker:
    """One simulated worker: its channel, its stream, its cadence (see the module docstring)."""

    def __init__(self, swarm: Swarm, job: int, rank: int) -> None:
        self.swarm = swarm
        self.job_id = f"{swarm.o.prefix}-{job}"
        self.rank = rank
        self.worker_id = f"{self.job_id}-w{rank}"
        self.task: asyncio.Future[None] | None = None
        self._stopping = asyncio.Event()
        self._sent_beats: dict[int, float] = {}
        self._sent_tensors: dict[str, float] = {}
        self._interval = LEGACY_HEARTBEAT_S
        self._outgoing: asyncio.Queue[negotiation_pb2.WorkerMessage | None] = asyncio.Queue()
        self._first_step: asyncio.Event = asyncio.Event()
        self._pending_first = FIRST_STEP_TENSORS
        self._job = job
        self._stream_open = False

    def stop(self) -> None:
        self._stopping.set()

    async def live(self, job_start: float) -> None:
        sw = self.swarm
        channel = sw.channel(self._job, self.rank // WORKERS_PER_HOST)
        rendezvous = rendezvous_pb2_grpc.RendezvousStub(channel)
        try:
            world = await self._join(rendezvous)
            if world is None:
                return
            sw.joined(self._job, time.perf_counter() - job_start)
            # As hora's engine: heartbeats from the moment it joined (one call, then
            # on the stream once it is open), the data plane's bootstrap meanwhile.
            reply = await self._heartbeat_call(rendezvous, world.generation, timed=False)
            if reply is not None and reply.interval_ms > 0 and sw.o.heartbeat == "stream":
                self._interval = reply.interval_ms / 1000
            beats = asyncio.ensure_future(self._beat(rendezvous, world.generation))
            await self._bootstrap(store_pb2_grpc.StoreStub(channel), world)
            call = negotiation_pb2_grpc.NegotiationStub(channel).Negotiate(
                self._requests(world.generation), metadata=sw.metadata)
            self._stream_open = True
            reader = asyncio.ensure_future(self._read(call))
            self.send_requests([f"first.{i}" for i in range(FIRST_STEP_TENSORS)])
            await self._first_step.wait()
            sw.first_step_done(self._job, time.perf_counter() - job_start)
            await self._stopping.wait()
            beats.cancel()
            await self._leave(rendezvous)
            self._outgoing.put_nowait(None)  # half-close, as hvd.shutdown() does
            call.cancel()
            reader.cancel()
        except grpc.aio.AioRpcError as exc:
            sw.record("worker", 0.0, f"{exc.code().name}: {exc.details()}"[:120])
        except asyncio.CancelledError:
            raise

    async def _join(self, rendezvous: Any) -> rendezvous_pb2.WorldView | None:
        sw = self.swarm
        request = rendezvous_pb2.JoinRequest(
            job_id=self.job_id, worker_id=self.worker_id,
            host=f"host{self.rank // WORKERS_PER_HOST}", pid=10_000 + self.rank,
            expected_size=sw.job_size, rank_hint=self.rank, data_plane_address="127.0.0.1",
            fusion_threshold_bytes=128 << 20, stall_warning_ms=60_000,
            stall_shutdown_ms=1_800_000)
        start = time.perf_counter()
        try:
            response = await rendezvous.Join(request, metadata=sw.metadata, timeout=300)
        except grpc.aio.AioRpcError as exc:
            sw.record("join", time.perf_counter() - start, exc.code().name)
            return None
        sw.record("join", time.perf_counter() - start)
        return response.world

    async def _heartbeat_call(self, rendezvous: Any, generation: int,
                              timed: bool = True) -> rendezvous_pb2.HeartbeatResponse | None:
        sw = self.swarm
        start = time.perf_counter()
        try:
            reply = await rendezvous.Heartbeat(
                rendezvous_pb2.HeartbeatRequest(job_id=self.job_id, worker_id=self.worker_id,
                                                generation=generation),
                metadata=sw.metadata, timeout=30)
        except grpc.aio.AioRpcError as exc:
            sw.record("heartbeat", time.perf_counter() - start, exc.code().name)
            return None
        if timed:
            sw.record("heartbeat", time.perf_counter() - start)
        return reply

    async def _bootstrap(self, store: Any, world: rendezvous_pb2.WorldView) -> None:
        """The data plane's bootstrap: publish an address, read the ring neighbours'."""
        sw, prefix, size = self.swarm, world.store_prefix, world.size
        md = sw.metadata
        start = time.perf_counter()
        await store.Set(store_pb2.StoreSetRequest(job_id=self.job_id, key=f"{prefix}addr/{self.rank}",
                                                  value=f"127.0.0.1:{20_000 + self.rank}".encode()),
                        metadata=md, timeout=60)
        for peer in {(self.rank - 1) % size, (self.rank + 1) % size} - {self.rank}:
            await store.Get(store_pb2.StoreGetRequest(job_id=self.job_id,
                                                      key=f"{prefix}addr/{peer}", timeout_ms=60_000),
                            metadata=md, timeout=90)
        await store.Add(store_pb2.StoreAddRequest(job_id=self.job_id, key=f"{prefix}ready",
                                                  amount=1), metadata=md, timeout=60)
        sw.record("store", time.perf_counter() - start)

    async def _requests(self, generation: int) -> Any:
        yield negotiation_pb2.WorkerMessage(open=negotiation_pb2.StreamOpen(
            job_id=self.job_id, worker_id=self.worker_id, generation=generation))
        while True:
            message = await self._outgoing.get()
            if message is None:
                return
            yield message

    def send_requests(self, names: list[str]) -> None:
        """Submits new tensors on the stream (one request list)."""
        now = time.perf_counter()
        requests = []
        for name in names:
            self._sent_tensors[name] = now
            requests.append(negotiation_pb2.TensorRequest(
                name=name, op_type=negotiation_pb2.OP_TYPE_ALLREDUCE, dtype="float32",
                shape=[1024], device="cpu", reduce_op=negotiation_pb2.REDUCE_OP_AVERAGE,
                prescale_factor=1.0, postscale_factor=1.0))
        self._outgoing.put_nowait(negotiation_pb2.WorkerMessage(
            requests=negotiation_pb2.RequestList(requests=requests)))

    async def _read(self, call: Any) -> None:
        sw = self.swarm
        try:
            async for message in call:
                kind = message.WhichOneof("kind")
                now = time.perf_counter()
                if kind == "heartbeat":
                    sent = self._sent_beats.pop(message.heartbeat.sequence, None)
                    if sent is not None:
                        sw.record("heartbeat", now - sent)
                    interval = message.heartbeat.state.interval_ms
                    if interval > 0:
                        self._interval = interval / 1000
                elif kind == "responses":
                    for response in message.responses.responses:
                        if response.type == negotiation_pb2.RESPONSE_TYPE_ERROR:
                            sw.record("negotiation", 0.0, response.error_message[:80])
                        for name in response.tensor_names:
                            sent = self._sent_tensors.pop(name, None)
                            if name.startswith("first."):
                                self._pending_first -= 1
                                if self._pending_first == 0:
                                    self._first_step.set()
                            elif sent is not None:
                                sw.record("negotiation", now - sent)
                elif kind == "event" and message.event.type in (
                        negotiation_pb2.EVENT_TYPE_MEMBER_LOST,
                        negotiation_pb2.EVENT_TYPE_JOB_FAILED):
                    sw.record("event", 0.0, negotiation_pb2.EventType.Name(message.event.type))
        except grpc.aio.AioRpcError as exc:
            if not self._stopping.is_set():
                sw.record("stream", 0.0, exc.code().name + " " + exc.details()[:60] + " " + (exc.debug_error_string() or "")[:160])

    async def _beat(self, rendezvous: Any, generation: int) -> None:
        """Heartbeats from the moment the worker joined: calls until its stream is open,
        then on the stream at the coordinator's interval (as hora.engine.liveness); or
        calls at the old fixed cadence."""
        unary = self.swarm.o.heartbeat == "unary"
        if unary:
            self._interval = LEGACY_HEARTBEAT_S
        # Out of phase, as hora.engine.liveness starts them.
        await asyncio.sleep(random.uniform(0.5, 1.0) * self._interval)
        sequence = 0
        while True:
            if unary or not self._stream_open:
                await self._heartbeat_call(rendezvous, generation)
                await asyncio.sleep(self._interval)
                continue
            sequence += 1
            self._sent_beats[sequence] = time.perf_counter()
            self._outgoing.put_nowait(negotiation_pb2.WorkerMessage(
                heartbeat=negotiation_pb2.StreamHeartbeat(sequence=sequence)))
            await asyncio.sleep(self._interval)

    async def _leave(self, rendezvous: Any) -> None:
        sw = self.swarm
        start = time.perf_counter()
        try:
            await rendezvous.Leave(rendezvous_pb2.LeaveRequest(
                job_id=self.job_id, worker_id=self.worker_id, reason="shutdown"),
                metadata=sw.metadata, timeout=60)
        except grpc.aio.AioRpcError as exc:
            sw.record("leave", time.perf_counter() - start, exc.code().name)
            return
        sw.record("leave", time.perf_counter() - start)
