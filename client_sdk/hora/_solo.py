"""A world of one: what the engine asks of a coordinator, answered in this process.

A script started without ``horarun`` (and without ``HORA_COORDINATOR``) runs
as a world of one, as under Horovod. No coordinator is started: the world
view is made here, heartbeats always find the job running, and requests are
answered by the coordinator's negotiation table run in process
(:class:`hora_negotiation.solo.LocalNegotiation`: the table's own package,
with no server, grpc or asyncio in it), so a world of one checks and orders
its collectives exactly as a larger one does.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence

from hora_negotiation.errors import InvalidRequestError
from hora_negotiation.solo import LocalNegotiation
from hora_proto.v1 import negotiation_pb2, rendezvous_pb2

from ._client import PROCESS_WORKER_ID
from .errors import InvalidCallError
from .settings import Settings

__all__ = ["SoloClient"]

_CLOSE = object()


class SoloClient:
    """The coordinator client of a world of one (the engine does not know the difference)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.job_id = settings.job_id
        self.worker_id = PROCESS_WORKER_ID
        self._lock = threading.Lock()
        self._negotiation = LocalNegotiation(settings.fusion_threshold)
        self._stream: SoloStream | None = None

    def wait_reachable(self) -> None:
        """Nothing to reach."""

    def join(self) -> rendezvous_pb2.WorldView:
        member = rendezvous_pb2.Member(
            rank=0, worker_id=self.worker_id, host=self.settings.hostname, pid=os.getpid(),
            state=rendezvous_pb2.MEMBER_STATE_ACTIVE,
            data_plane_address=self.settings.data_plane_address, local_rank=0)
        return rendezvous_pb2.WorldView(
            job_id=self.job_id, generation=1, size=1, rank=0, local_rank=0, local_size=1,
            cross_rank=0, cross_size=1, is_homogeneous=True, members=[member],
            store_prefix=f"{self.job_id}/gen-1/")

    def heartbeat(self, generation: int, telemetry: rendezvous_pb2.RankTelemetry | None = None
                  ) -> rendezvous_pb2.HeartbeatResponse:
        return rendezvous_pb2.HeartbeatResponse(generation=generation,
                                                job_state=rendezvous_pb2.JOB_STATE_RUNNING)

    def leave(self, reason: str = "shutdown", rejoin: bool = False) -> None:
        """Nobody to tell."""

    def reattach(self, world: rendezvous_pb2.WorldView,
                 process_sets: dict[int, tuple[int, ...]], host_update_epoch: int) -> bool:
        """Never needed: the in-process table cannot be lost."""
        return False

    def outage_started(self) -> float:
        return time.monotonic()

    def outage_over(self) -> None:
        """No outage to end."""

    def add_process_set(self, generation: int, process_set_id: int, ranks: list[int],
                        invalid: str = "") -> None:
        """Decided at once (every rank has called); a refusal raises the coordinator's text."""
        with self._lock, refused_call():
            self._negotiation.add_process_set(process_set_id, ranks, invalid)

    def remove_process_set(self, generation: int, process_set_id: int, invalid: str = "") -> None:
        with self._lock, refused_call():
            messages = self._negotiation.remove_process_set(process_set_id, invalid)
        if self._stream is not None:
            self._stream.deliver(messages)

    def open_stream(self, generation: int,
                    received: Sequence[negotiation_pb2.ReceivedLists] = ()) -> SoloStream:
        self._stream = SoloStream(self)
        return self._stream

    def submit(self, request: negotiation_pb2.TensorRequest
               ) -> list[negotiation_pb2.CoordinatorMessage]:
        with self._lock:
            return self._negotiation.submit([request])

    def close(self) -> None:
        """Nothing to release."""


@contextlib.contextmanager
def refused_call() -> Iterator[None]:
    """Turns the local table's refusal of a call into the trainer's InvalidCallError.

    Only a refusal: any other exception is a bug and goes up as it is.
    """
    try:
        yield
    except InvalidRequestError as exc:
        raise InvalidCallError(str(exc)) from exc


class SoloStream:
    """The negotiation stream of a world of one: each request is answered as it is sent."""

    def __init__(self, client: SoloClient) -> None:
        self._client = client
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()

    def send(self, request: negotiation_pb2.TensorRequest) -> None:
        self.deliver(self._client.submit(request))

    def heartbeat(self, sequence: int,
                  telemetry: rendezvous_pb2.RankTelemetry | None = None) -> None:
        """Answered at once: the job of one runs as long as this process does."""
        self.deliver([negotiation_pb2.CoordinatorMessage(
            heartbeat=negotiation_pb2.StreamHeartbeatAnswer(
                sequence=sequence, state=self._client.heartbeat(1)))])

    def deliver(self, messages: list[negotiation_pb2.CoordinatorMessage]) -> None:
        for message in messages:
            self._queue.put(message)

    def __iter__(self) -> Iterator[negotiation_pb2.CoordinatorMessage]:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            assert isinstance(item, negotiation_pb2.CoordinatorMessage)
            yield item

    def close(self) -> None:
        self._queue.put(_CLOSE)
