"""The job's event log at the coordinator: what the launcher records and reads.

Best effort by design: an event that cannot be recorded (the coordinator is
unreachable, or does not implement ``ReportEvent`` yet) must never slow
down or fail the job. Calls go out on a thread of their own with a short
deadline; the first failure is said once and later ones are dropped quietly.
Reading (:meth:`EventReporter.last_generation_ms`,
:meth:`EventReporter.generation`) answers None when the log cannot be read,
and the caller falls back to not knowing. :class:`GenerationWatch` reads
the job's generation on a thread of its own, for the elastic driver's
reset limit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import grpc

from hora_proto.auth import TOKEN_METADATA_KEY
from hora_proto.v1 import rendezvous_pb2, rendezvous_pb2_grpc

from .._tls import coordinator_channel

__all__ = ["EVENT_DEADLINE", "EventReporter", "GenerationWatch"]

# Seconds one ReportEvent call may take.
EVENT_DEADLINE = 2.0
# Seconds between two reads of the job's generation.
GENERATION_INTERVAL = 0.25


class EventReporter:
    """Sends ``ReportEvent`` calls to the coordinator in the background, and
    reads the job's event log.

    Args:
        address: coordinator gRPC address ``HOST:PORT``.
        job_id: the job the events belong to.
        token: the job token (sent as ``hora-token`` metadata).
        tls_ca: CA bundle (path or PEM text) for a coordinator serving TLS; empty
            for plaintext.
        say: prints a launcher message; called from the reporter's thread.
        deadline: seconds each call may take.
    """

    def __init__(self, address: str, job_id: str, token: str, *, tls_ca: str = "",
                 say: Callable[[str], None] = lambda message: None,
                 deadline: float = EVENT_DEADLINE) -> None:
        self._address = address
        self._job_id = job_id
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._say = say
        self._deadline = deadline
        self._queue: queue.Queue[tuple[str, str, str] | None] = queue.Queue()
        self._warned = False
        # Channels are thread-safe: the sender thread and last_generation_ms
        # share this one.
        self._channel = coordinator_channel(address, tls_ca)
        self._stub: Any = rendezvous_pb2_grpc.RendezvousStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="horarun-events", daemon=True)
        self._thread.start()

    def report(self, kind: str, host: str, message: str) -> None:
        """Queues one event; returns at once."""
        self._queue.put((kind, host, message))

    def last_generation_ms(self) -> int | None:
        """When the job's latest generation formed (ms since the Unix epoch).

        Returns:
            The time of the log's last ``generation`` event, or None when the
            log cannot be read or holds none.
        """
        request = rendezvous_pb2.ListEventsRequest(job_id=self._job_id)
        try:
            response = self._stub.ListEvents(request, timeout=self._deadline,
                                             metadata=self._metadata)
        except grpc.RpcError:
            return None
        times = [e.unix_ms for e in response.events if e.kind == "generation"]
        return max(times) if times else None

    def generation(self) -> int | None:
        """The job's latest generation (0: none formed yet), None when unreadable."""
        request = rendezvous_pb2.ListEventsRequest(job_id=self._job_id)
        try:
            response = self._stub.ListEvents(request, timeout=self._deadline,
                                             metadata=self._metadata)
        except grpc.RpcError:
            return None
        return max((e.generation for e in response.events), default=0)

    def close(self, timeout: float = 2 * EVENT_DEADLINE) -> None:
        """Sends what is queued (waiting at most ``timeout`` s) and stops."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._channel.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, host, message = item
            request = rendezvous_pb2.ReportEventRequest(
                job_id=self._job_id, kind=kind, host=host, message=message)
            try:
                self._stub.ReportEvent(request, timeout=self._deadline,
                                       metadata=self._metadata)
            except grpc.RpcError as exc:
                self._warn(kind, exc)
            except ValueError:
                return  # the channel was closed under us: close() gave up waiting

    def _warn(self, kind: str, exc: Any) -> None:
        if self._warned:
            return
        self._warned = True
        code = exc.code().name if hasattr(exc, "code") and exc.code() else "error"
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        self._say(f"could not record a {kind!r} event at the coordinator {self._address} "
                  f"({code}: {detail}); events are best effort, the job goes on")


class GenerationWatch:
    """Reads the job's generation every ``interval`` seconds on a daemon thread.

    Args:
        read: returns the generation now, or None when it cannot tell
            (:meth:`EventReporter.generation`).
        interval: seconds between reads.
    """

    def __init__(self, read: Callable[[], int | None], *,
                 interval: float = GENERATION_INTERVAL) -> None:
        self._read = read
        self._interval = interval
        self._latest = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="horarun-generations",
                                        daemon=True)

    def start(self) -> None:
        """Starts reading."""
        self._thread.start()

    def stop(self) -> None:
        """Stops reading (a read in flight ends within its deadline)."""
        self._stop.set()

    def latest(self) -> int:
        """The highest generation read so far (0: none)."""
        return self._latest

    def read_now(self) -> int:
        """Reads once, on the caller's thread; returns the highest generation seen."""
        value = self._read()
        if value is not None and value > self._latest:
            self._latest = value  # an int store: atomic under the GIL
        return self._latest

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read_now()
            self._stop.wait(self._interval)
