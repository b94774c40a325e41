"""The worker's side of the gRPC contract: join, leave, heartbeat, store, stream.

This is the one boundary where gRPC errors become hora errors: every call
goes through :meth:`CoordinatorClient._call`, which maps status codes to the
error tree in :mod:`hora.errors`, and every call has a deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, NoReturn, Protocol

import grpc

from hora_proto.auth import TOKEN_METADATA_KEY, WORKER_SECRET_METADATA_KEY
from hora_proto.error_kinds import UNKNOWN_JOB, error_kind
from hora_proto.options import legacy_join_fields
from hora_proto.v1 import (
    negotiation_pb2,
    negotiation_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

from ._negotiation_stream import _CLOSE as _CLOSE  # re-exported for tests
from ._negotiation_stream import NegotiationStream, stream_messages
from ._tls import coordinator_channel
from .errors import (
    AuthenticationError,
    CoordinatorError,
    CoordinatorUnavailableError,
    InvalidCallError,
    RankLostError,
    RendezvousError,
    RendezvousTimeoutError,
    StallError,
)
from .settings import Settings

__all__ = ["CoordinatorClient", "NegotiationStream", "StoreKeyError", "stream_messages"]

log = logging.getLogger("hora.client")




# Where a worker's token comes from, for the error that refuses it.
_TOKEN_HINT = (
    "A worker sends the token in HORA_TOKEN: horarun passes its --token, else $HORA_TOKEN, "
    "else a random one that only its own embedded coordinator knows. It must equal the "
    "coordinator's: the --token or $HORA_TOKEN it was started with, the token it printed at "
    "start when it made one up, or the contents of its --token-file")


def _tls_hint(settings: Settings) -> str:
    if settings.tls_ca:
        return ("The channel uses TLS (HORA_TLS_CA): the coordinator must serve TLS with a "
                "certificate that CA signed for this address.")
    return ("The channel is plaintext: a coordinator serving TLS needs its CA in HORA_TLS_CA "
            "(horarun --tls-ca FILE).")


# One identity per process: an elastic worker that re-joins after a reset is
# recognised by the coordinator as the same member, so it keeps its place.
PROCESS_WORKER_ID = uuid.uuid4().hex
# The worker secret Join issued to PROCESS_WORKER_ID, by (coordinator, job): a
# later client of this process (an elastic reset re-initialises) joins again
# under the same id, which a job token allows only with the secret.
_WORKER_SECRETS: dict[tuple[str, str], str] = {}


class Stream(Protocol):
    """A negotiation stream as the engine uses it."""

    def send(self, request: negotiation_pb2.TensorRequest) -> None: ...

    def heartbeat(self, sequence: int,
                  telemetry: rendezvous_pb2.RankTelemetry | None = None) -> None: ...

    def __iter__(self) -> Iterator[negotiation_pb2.CoordinatorMessage]: ...

    def close(self) -> None: ...


class CoordinatorLink(Protocol):
    """What the engine asks of a coordinator: :class:`CoordinatorClient` over gRPC,
    or :class:`hora._solo.SoloClient` in a world of one."""

    def heartbeat(self, generation: int, telemetry: rendezvous_pb2.RankTelemetry | None = None
                  ) -> rendezvous_pb2.HeartbeatResponse: ...

    def leave(self, reason: str = "shutdown", rejoin: bool = False) -> None: ...

    def reattach(self, world: rendezvous_pb2.WorldView,
                 process_sets: dict[int, tuple[int, ...]], host_update_epoch: int) -> bool: ...

    def outage_started(self) -> float: ...

    def outage_over(self) -> None: ...

    def add_process_set(self, generation: int, process_set_id: int, ranks: list[int],
                        invalid: str = "") -> None: ...

    def remove_process_set(self, generation: int, process_set_id: int,
                           invalid: str = "") -> None: ...

    def open_stream(self, generation: int,
                    received: Sequence[negotiation_pb2.ReceivedLists] = ()) -> Stream: ...


class StoreKeyError(KeyError):
    """A store key did not appear before its deadline."""


def _seconds(value: timedelta) -> float:
    return max(value.total_seconds(), 0.001)


class CoordinatorClient:
    """One channel to the coordinator, shared by every call of this worker.

    Args:
        settings: where the coordinator is, which job, which token, deadlines.
    """

    def __init__(self, settings: Settings) -> None:
        if not settings.coordinator:
            raise CoordinatorError(
                "no coordinator address: start the script with horarun, or set "
                "HORA_COORDINATOR=HOST:PORT (and HORA_JOB_ID, HORA_TOKEN)")
        self.settings = settings
        self.job_id = settings.job_id
        self.worker_id = PROCESS_WORKER_ID
        self._metadata: tuple[tuple[str, str], ...] = ((TOKEN_METADATA_KEY, settings.token),)
        self._remember_secret(_WORKER_SECRETS.get((settings.coordinator, settings.job_id), ""))
        self._channel = coordinator_channel(
            settings.coordinator,
            settings.tls_ca,
            options=[
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
                # A coordinator that restarts is found again within a second,
                # not after gRPC's default backoff of up to two minutes.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        # Since when the coordinator has been unreachable (monotonic), or None.
        # Set by any call that found it gone, cleared once this worker has
        # re-attached: until then an unknown job (UNKNOWN_JOB in the refusal's
        # trailing metadata) means "restarted, not told yet".
        self.outage_since: float | None = None
        self._outage_lock = threading.Lock()
        self._rendezvous = rendezvous_pb2_grpc.RendezvousStub(self._channel)
        self._store = store_pb2_grpc.StoreStub(self._channel)
        self._negotiation = negotiation_pb2_grpc.NegotiationStub(self._channel)

    # -- errors ------------------------------------------------------------

    def _error(self, exc: grpc.RpcError, what: str) -> Exception:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        where = f"coordinator {self.settings.coordinator}"
        if code == grpc.StatusCode.UNAUTHENTICATED:
            sent = ("no token was sent (HORA_TOKEN is unset or empty)" if not self.settings.token
                    else "the token sent is not the coordinator's")
            return AuthenticationError(
                f"{where} refused the job token during {what} ({detail}): {sent}. {_TOKEN_HINT}")
        if code == grpc.StatusCode.UNAVAILABLE:
            return CoordinatorUnavailableError(f"{where} is unreachable during {what}: {detail}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return CoordinatorUnavailableError(f"{where} did not answer {what} in time: {detail}")
        return CoordinatorError(f"{where}: {what} failed ({code}): {detail}")

    def _call(self, what: str, method: Callable[..., Any], request: Any,
              timeout: timedelta, wait_out_outage: bool = True,
              outage_limit: timedelta | None = None) -> Any:
        """One unary call with its deadline; gRPC errors become hora errors.

        With ``wait_out_outage`` the call outlasts a coordinator outage
        (:meth:`_through_outage`), for at most ``outage_limit`` when given.
        """
        try:
            if not wait_out_outage:
                return method(request, timeout=_seconds(timeout), metadata=self._metadata)
            return self._through_outage(what, lambda: method(
                request, timeout=_seconds(timeout), metadata=self._metadata), outage_limit)
        except grpc.RpcError as exc:
            raise self._error(exc, what) from exc

    def _through_outage(self, what: str, invoke: Callable[[], Any],
                        limit: timedelta | None = None) -> Any:
        """Runs ``invoke`` (one gRPC call), retrying with backoff while the
        coordinator is unreachable, or restarted and not yet told of the job,
        for up to the outage timeout counted from when it was first found
        gone; then (or on any other error) the last RpcError propagates."""
        backoff = 0.1
        while True:
            try:
                return invoke()
            except grpc.RpcError as exc:
                if not self._outage_goes_on(exc, what, limit):
                    raise
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    def _outage_goes_on(self, exc: grpc.RpcError, what: str,
                        limit_td: timedelta | None = None) -> bool:
        """Whether ``exc`` is the coordinator being away and the outage timeout has
        not passed yet (the first such error starts the outage)."""
        code = exc.code()
        restarted = (code == grpc.StatusCode.NOT_FOUND and self.outage_since is not None
                     and error_kind(exc) == UNKNOWN_JOB)
        if code != grpc.StatusCode.UNAVAILABLE and not restarted:
            return False
        limit = (limit_td or self.settings.coordinator_outage_timeout).total_seconds()
        with self._outage_lock:
            if self.outage_since is None:
                self.outage_since = time.monotonic()
                log.warning("the coordinator %s is unreachable (%s); %s waits for it up to "
                            "%g s (HORA_COORDINATOR_OUTAGE_TIMEOUT)", self.settings.coordinator,
                            exc.details(), what, limit)
            return time.monotonic() - self.outage_since < limit

    def outage_started(self) -> float:
        """Marks the coordinator as gone (when not already) and returns since when."""
        with self._outage_lock:
            if self.outage_since is None:
                self.outage_since = time.monotonic()
            return self.outage_since

    def outage_over(self) -> None:
        with self._outage_lock:
            self.outage_since = None

    # -- rendezvous --------------------------------------------------------

    def wait_reachable(self) -> None:
        """Waits until the channel connects, at most the connect timeout.

        Raises:
            CoordinatorUnavailableError: nothing answered at the address.
        """
        timeout = self.settings.connect_timeout
        try:
            grpc.channel_ready_future(self._channel).result(timeout=_seconds(timeout))
        except grpc.FutureTimeoutError:
            raise CoordinatorUnavailableError(
                f"coordinator {self.settings.coordinator} could not be reached within "
                f"{timeout.total_seconds():g} s (HORA_CONNECT_TIMEOUT); is it running, and is "
                f"the address right? {_tls_hint(self.settings)}") from None

    def _join_request(self) -> rendezvous_pb2.JoinRequest:
        s = self.settings
        options = s.job_options()  # and fields 8..13 for a coordinator older than the map
        return rendezvous_pb2.JoinRequest(
            job_id=s.job_id, worker_id=self.worker_id, host=s.hostname, pid=os.getpid(),
            expected_size=s.size, rank_hint=s.rank, data_plane_address=s.data_plane_address,
            job_options=options, **legacy_join_fields(options),
        )

    def join(self) -> rendezvous_pb2.WorldView:
        """Joins the job and returns this worker's world view.

        Raises:
            RendezvousTimeoutError: the world did not gather within the start timeout.
            RendezvousError: the coordinator refused the join.
        """
        s = self.settings
        request = self._join_request()
        # An elastic round may wait up to the elastic timeout for enough workers.
        deadline, setting = s.start_timeout, "HORA_START_TIMEOUT"
        if s.is_elastic and s.elastic_timeout > deadline:
            deadline, setting = s.elastic_timeout, "HORA_ELASTIC_TIMEOUT"
        wanted = (f"at least {s.min_size or 1} workers" if s.is_elastic
                  else f"the world of {s.size} workers")
        give_up = time.monotonic() + _seconds(deadline)
        backoff = 0.1
        while True:
            try:
                response = self._rendezvous.Join(
                    request, timeout=max(0.001, give_up - time.monotonic()),
                    metadata=self._metadata)
                break
            except grpc.RpcError as exc:
                # A coordinator restarting (an elastic reset during its outage) is waited for.
                if (exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= give_up
                        or not self._outage_goes_on(exc, "join")):
                    self._join_failed(exc, wanted, deadline, setting)
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
        self.outage_over()
        self._remember_secret(response.worker_secret)
        return response.world

    def _remember_secret(self, secret: str) -> None:
        """Every later call naming this worker proves it with ``secret`` (a job token
        needs that; see :mod:`hora_proto.auth`)."""
        if not secret:
            return
        _WORKER_SECRETS[(self.settings.coordinator, self.job_id)] = secret
        self._metadata = ((TOKEN_METADATA_KEY, self.settings.token),
                          (WORKER_SECRET_METADATA_KEY, secret))

    def _join_failed(self, exc: grpc.RpcError, wanted: str, deadline: timedelta,
                     setting: str) -> NoReturn:
        job_id, code = self.settings.job_id, exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise RendezvousTimeoutError(
                f"job {job_id!r}: {wanted} did not gather within "
                f"{deadline.total_seconds():g} s ({setting})") from exc
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            raise RendezvousError(f"job {job_id!r}: join refused: {exc.details()}") from exc
        raise self._error(exc, "join") from exc

    def leave(self, reason: str = "shutdown", rejoin: bool = False) -> None:
        """Tells the coordinator this worker leaves on purpose (best effort).

        With ``rejoin`` it leaves this generation only (an elastic reset).
        """
        request = rendezvous_pb2.LeaveRequest(
            job_id=self.job_id, worker_id=self.worker_id, reason=reason, rejoin=rejoin)
        try:
            self._call("leave", self._rendezvous.Leave, request, timedelta(seconds=5),
                       outage_limit=self.settings.connect_timeout)
        except CoordinatorError as exc:
            log.debug("leave failed: %s", exc)

    def heartbeat(self, generation: int, telemetry: rendezvous_pb2.RankTelemetry | None = None
                  ) -> rendezvous_pb2.HeartbeatResponse:
        request = rendezvous_pb2.HeartbeatRequest(
            job_id=self.job_id, worker_id=self.worker_id, generation=generation,
            telemetry=telemetry)
        return self._call("heartbeat", self._rendezvous.Heartbeat, request,
                          max(self.settings.heartbeat_interval * 5, timedelta(seconds=2)),
                          wait_out_outage=False)

    def reattach(self, world: rendezvous_pb2.WorldView,
                 process_sets: dict[int, tuple[int, ...]], host_update_epoch: int) -> bool:
        """Reports this member of ``world``'s generation to the coordinator again after
        it was lost (see the Reattach RPC); no waiting: the caller retries.

        Returns:
            Whether the coordinator rebuilt the job from this report (no journal).

        Raises:
            CoordinatorUnavailableError: still unreachable.
            CoordinatorError: it refused (FAILED_PRECONDITION: the generation is
                over or this worker is no longer a member of it).
        """
        request = rendezvous_pb2.ReattachRequest(
            join=self._join_request(), world=world, host_update_epoch=host_update_epoch,
            process_sets=[rendezvous_pb2.ProcessSetSpec(process_set_id=i, ranks=r)
                          for i, r in sorted(process_sets.items())])
        try:
            response = self._rendezvous.Reattach(
                request, timeout=_seconds(self.settings.connect_timeout),
                metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # an old coordinator without Reattach
                raise CoordinatorError(f"coordinator {self.settings.coordinator} cannot "
                                       f"re-attach members: {exc.details()}") from exc
            raise self._error(exc, "re-attach") from exc
        return response.restored

    # -- store -------------------------------------------------------------

    def _store_call(self, what: str, method: Callable[..., Any], request: Any,
                    timeout: timedelta, keys: list[str]) -> Any:
        try:
            return self._through_outage(f"store {what}", lambda: method(
                request, timeout=_seconds(timeout) + 5.0, metadata=self._metadata))
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND):
                raise StoreKeyError(
                    f"store {what}: key(s) {keys} not set within "
                    f"{timeout.total_seconds():g} s: {exc.details()}") from exc
            raise self._error(exc, f"store {what}") from exc

    def store_set(self, key: str, value: bytes) -> None:
        self._call("store set", self._store.Set,
                   store_pb2.StoreSetRequest(job_id=self.job_id, key=key, value=value),
                   self.settings.connect_timeout)

    def store_get(self, key: str, timeout: timedelta) -> bytes:
        request = store_pb2.StoreGetRequest(
            job_id=self.job_id, key=key, timeout_ms=int(timeout.total_seconds() * 1000))
        return self._store_call("get", self._store.Get, request, timeout, [key]).value

    def store_add(self, key: str, amount: int) -> int:
        request = store_pb2.StoreAddRequest(job_id=self.job_id, key=key, amount=amount)
        return self._call("store add", self._store.Add, request,
                          self.settings.connect_timeout).value

    def store_wait(self, keys: list[str], timeout: timedelta) -> None:
        request = store_pb2.StoreWaitRequest(
            job_id=self.job_id, keys=keys, timeout_ms=int(timeout.total_seconds() * 1000))
        self._store_call("wait", self._store.Wait, request, timeout, keys)

    def store_compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        request = store_pb2.StoreCompareSetRequest(
            job_id=self.job_id, key=key, expected=expected, desired=desired)
        return self._call("store compare_set", self._store.CompareSet, request,
                          self.settings.connect_timeout).value

    def store_delete(self, key: str) -> bool:
        request = store_pb2.StoreDeleteRequest(job_id=self.job_id, key=key)
        return self._call("store delete", self._store.Delete, request,
                          self.settings.connect_timeout).existed

    # -- negotiation ---------------------------------------------------------

    def add_process_set(self, generation: int, process_set_id: int, ranks: list[int],
                        invalid: str = "") -> None:
        """This rank's call of the collective AddProcessSet (see :meth:`_set_call`)."""
        request = negotiation_pb2.AddProcessSetRequest(
            job_id=self.job_id, worker_id=self.worker_id, generation=generation,
            process_set_id=process_set_id, ranks=ranks, invalid=invalid)
        self._set_call("add_process_set", self._negotiation.AddProcessSet, request)

    def remove_process_set(self, generation: int, process_set_id: int,
                           invalid: str = "") -> None:
        """This rank's call of the collective RemoveProcessSet (see :meth:`_set_call`)."""
        request = negotiation_pb2.RemoveProcessSetRequest(
            job_id=self.job_id, worker_id=self.worker_id, generation=generation,
            process_set_id=process_set_id, invalid=invalid)
        self._set_call("remove_process_set", self._negotiation.RemoveProcessSet, request)

    def _set_call(self, what: str, method: Callable[..., Any], request: Any) -> None:
        """A process set call: answered once every rank has called, alike on every rank.

        The coordinator fails the call when some rank has not called within the
        job's stall shutdown time; this call's own deadline is a little longer,
        or the collective timeout when the stall shutdown is off.

        Raises:
            InvalidCallError: some rank's call was invalid, or the calls differ
                (the coordinator's message, the same on every rank).
            StallError: some rank did not call in time.
            RankLostError: a rank left or was lost, or the generation ended.
            CoordinatorError: the coordinator could not be reached.
        """
        s = self.settings
        timeout = (s.stall_shutdown_time + s.connect_timeout if s.stall_shutdown_time
                   else s.collective_timeout)
        start = time.monotonic()
        try:
            self._through_outage(what, lambda: method(
                request, timeout=_seconds(timeout), metadata=self._metadata))
        except grpc.RpcError as exc:
            code, detail = exc.code(), exc.details()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidCallError(detail) from exc
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise RankLostError(detail) from exc
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                if time.monotonic() - start >= timeout.total_seconds():  # our own deadline
                    detail = (f"{what} was not answered within {timeout.total_seconds():g} s: "
                              f"some rank did not call it")
                raise StallError(detail) from exc
            raise self._error(exc, what) from exc

    def open_stream(self, generation: int,
                    received: Sequence[negotiation_pb2.ReceivedLists] = ()) -> NegotiationStream:
        return NegotiationStream(self, generation, received)

    def close(self) -> None:
        self._channel.close()
