"""Fake workers for coordinator tests, written directly against the gRPC stubs."""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from hora_proto.v1 import (
    negotiation_pb2,
    negotiation_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    store_pb2_grpc,
)

__all__ = ["Client", "FakeStream", "new_job_id", "open_world", "tensor", "together"]


def new_job_id() -> str:
    """A job id no other test uses (tests share one coordinator)."""
    return f"job-{uuid.uuid4().hex[:8]}"


def tensor(
    name: str,
    op: int = negotiation_pb2.OP_TYPE_ALLREDUCE,
    dtype: str = "float32",
    shape: Sequence[int] = (4,),
    **kw,
) -> negotiation_pb2.TensorRequest:
    """A TensorRequest with everyday defaults (cpu, SUM, scale factors 1)."""
    kw.setdefault("device", "cpu")
    kw.setdefault("reduce_op", negotiation_pb2.REDUCE_OP_SUM)
    kw.setdefault("prescale_factor", 1.0)
    kw.setdefault("postscale_factor", 1.0)
    return negotiation_pb2.TensorRequest(
        name=name, op_type=op, dtype=dtype, shape=list(shape), **kw
    )


def together(*calls: Callable[[], Any], timeout: float = 30.0) -> list[Any]:
    """Runs the calls at once, as the ranks of a job do; each one's result or RpcError."""
    outcomes = []
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        for future in futures:
            error = future.exception(timeout=timeout)
            if error is not None and not isinstance(error, grpc.RpcError):
                raise error
            outcomes.append(future.result() if error is None else error)
    return outcomes


class Client:
    """Stubs on one channel to a coordinator, sending its token (over TLS with ``credentials``)."""

    def __init__(
        self, address: str, token: str | None, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        self.channel = (
            grpc.insecure_channel(address)
            if credentials is None
            else grpc.secure_channel(address, credentials)
        )
        self.metadata = (("hora-token", token),) if token is not None else ()
        self.rendezvous = rendezvous_pb2_grpc.RendezvousStub(self.channel)
        self.store = store_pb2_grpc.StoreStub(self.channel)
        self.negotiation = negotiation_pb2_grpc.NegotiationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def join(
        self,
        job_id: str,
        worker_id: str,
        size: int,
        *,
        host: str = "localhost",
        hint: int = -1,
        timeout: float = 10.0,
        **config,
    ) -> rendezvous_pb2.WorldView:
        request = rendezvous_pb2.JoinRequest(
            job_id=job_id,
            worker_id=worker_id,
            host=host,
            pid=1000 + hash(worker_id) % 1000,
            expected_size=size,
            rank_hint=hint,
            data_plane_address="127.0.0.1",
            **config,
        )
        return self.rendezvous.Join(request, metadata=self.metadata, timeout=timeout).world

    def join_all(
        self, job_id: str, size: int, hosts: Sequence[str] | None = None, **config
    ) -> list[rendezvous_pb2.WorldView]:
        """``size`` workers join concurrently; their views, by rank."""
        hosts = list(hosts or ["localhost"] * size)
        with ThreadPoolExecutor(size) as pool:
            futures = [
                pool.submit(self.join, job_id, f"w{i}", size, host=hosts[i], **config)
                for i in range(size)
            ]
            views = [f.result(timeout=15) for f in futures]
        return sorted(views, key=lambda v: v.rank)

    def leave(
        self, job_id: str, worker_id: str, reason: str = "shutdown", *, rejoin: bool = False
    ) -> None:
        self.rendezvous.Leave(
            rendezvous_pb2.LeaveRequest(
                job_id=job_id, worker_id=worker_id, reason=reason, rejoin=rejoin
            ),
            metadata=self.metadata,
            timeout=5,
        )

    def heartbeat(
        self, job_id: str, worker_id: str, generation: int = 0
    ) -> rendezvous_pb2.HeartbeatResponse:
        return self.rendezvous.Heartbeat(
            rendezvous_pb2.HeartbeatRequest(
                job_id=job_id, worker_id=worker_id, generation=generation
            ),
            metadata=self.metadata,
            timeout=5,
        )

    def report_event(self, job_id: str, kind: str, host: str = "", message: str = "") -> None:
        self.rendezvous.ReportEvent(
            rendezvous_pb2.ReportEventRequest(job_id=job_id, kind=kind, host=host, message=message),
            metadata=self.metadata,
            timeout=5,
        )

    def list_events(self, job_id: str) -> list[rendezvous_pb2.JobEvent]:
        return list(
            self.rendezvous.ListEvents(
                rendezvous_pb2.ListEventsRequest(job_id=job_id), metadata=self.metadata, timeout=5
            ).events
        )

    def stream(self, job_id: str, worker_id: str, generation: int) -> FakeStream:
        return FakeStream(self, job_id, worker_id, generation)

    def add_process_set(
        self,
        job_id: str,
        worker_id: str,
        set_id: int,
        ranks: Sequence[int],
        invalid: str = "",
        generation: int = 1,
        timeout: float = 10.0,
    ) -> negotiation_pb2.AddProcessSetResponse:
        request = negotiation_pb2.AddProcessSetRequest(
            job_id=job_id,
            worker_id=worker_id,
            generation=generation,
            process_set_id=set_id,
            ranks=list(ranks),
            invalid=invalid,
        )
        return self.negotiation.AddProcessSet(request, metadata=self.metadata, timeout=timeout)

    def remove_process_set(
        self,
        job_id: str,
        worker_id: str,
        set_id: int,
        invalid: str = "",
        generation: int = 1,
        timeout: float = 10.0,
    ) -> negotiation_pb2.RemoveProcessSetResponse:
        request = negotiation_pb2.RemoveProcessSetRequest(
            job_id=job_id,
            worker_id=worker_id,
            generation=generation,
            process_set_id=set_id,
            invalid=invalid,
        )
        return self.negotiation.RemoveProcessSet(request, metadata=self.metadata, timeout=timeout)


def open_world(client: Client, size: int, **config) -> tuple[str, list[str], list[FakeStream]]:
    """Joins ``size`` workers and opens their streams; job id, worker ids and streams by rank."""
    job = new_job_id()
    views = client.join_all(job, size, **config)
    workers = [m.worker_id for m in views[0].members]
    streams = [client.stream(job, worker, views[0].generation) for worker in workers]
    return job, workers, streams


class FakeStream:
    """A worker's negotiation stream: send request lists, receive messages with a deadline."""

    _END = object()

    def __init__(self, client: Client, job_id: str, worker_id: str, generation: int) -> None:
        self._outgoing: queue.Queue[object] = queue.Queue()
        self._incoming: queue.Queue[object] = queue.Queue()
        self._outgoing.put(
            negotiation_pb2.WorkerMessage(
                open=negotiation_pb2.StreamOpen(
                    job_id=job_id, worker_id=worker_id, generation=generation
                )
            )
        )
        self.call = client.negotiation.Negotiate(
            self._requests(), metadata=client.metadata, timeout=60
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self):
        while True:
            item = self._outgoing.get()
            if item is self._END:
                return
            yield item

    def _read(self) -> None:
        try:
            for message in self.call:
                self._incoming.put(message)
        except grpc.RpcError as exc:
            self._incoming.put(exc)
        self._incoming.put(self._END)

    def send(self, *requests: negotiation_pb2.TensorRequest) -> None:
        self._outgoing.put(
            negotiation_pb2.WorkerMessage(
                requests=negotiation_pb2.RequestList(requests=list(requests))
            )
        )

    def heartbeat(self, sequence: int) -> None:
        """Renews the member's lease on the stream."""
        self._outgoing.put(
            negotiation_pb2.WorkerMessage(
                heartbeat=negotiation_pb2.StreamHeartbeat(sequence=sequence)
            )
        )

    def recv(self, timeout: float = 5.0) -> negotiation_pb2.CoordinatorMessage:
        """The next message; raises the stream's RpcError, or AssertionError at its end."""
        item = self._incoming.get(timeout=timeout)
        if isinstance(item, grpc.RpcError):
            raise item
        if item is self._END:
            raise AssertionError("the coordinator ended the stream")
        return item

    def responses(self, timeout: float = 5.0) -> list[negotiation_pb2.Response]:
        message = self.recv(timeout)
        assert message.WhichOneof("kind") == "responses", message
        return list(message.responses.responses)

    def event(self, timeout: float = 5.0) -> negotiation_pb2.Event:
        message = self.recv(timeout)
        assert message.WhichOneof("kind") == "event", message
        return message.event

    def heartbeat_answer(self, timeout: float = 5.0) -> negotiation_pb2.StreamHeartbeatAnswer:
        message = self.recv(timeout)
        assert message.WhichOneof("kind") == "heartbeat", message
        return message.heartbeat

    def assert_silent(self, wait: float = 0.3) -> None:
        try:
            item = self._incoming.get(timeout=wait)
        except queue.Empty:
            return
        raise AssertionError(f"expected nothing, got {item}")

    def close(self) -> None:
        """Half-closes our side, as a worker does after Leave."""
        self._outgoing.put(self._END)

    def cancel(self) -> None:
        """Breaks the stream, as a crashing worker does."""
        self.call.cancel()


def code_of(call: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The gRPC error that ``call(*args, **kwargs)`` raises (the test fails if none)."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value
