"""What a job token's holder may name: its job, and only the workers it proves.

Once a call with a job token is decoded (:mod:`.auth`), :func:`check_scope`
compares what the request names with what the caller proved: every job id
in it must be the token's job, and a request that speaks for a worker
(Heartbeat, Leave, GetWorld, Reattach, a negotiation stream's ``open``,
process set calls) must carry that worker's secret, the one Join issued to
it (:func:`hora_proto.auth.worker_secret`). Join itself is the call that
issues the secret: the servicer refuses a Join that names a current member
without its secret (:func:`join_allowed`), so a member cannot be taken over
by joining under its id. The admin token is never scoped.
"""

from __future__ import annotations

import hmac
from typing import Any

from hora_proto.auth import WORKER_SECRET_METADATA_KEY, worker_secret
from hora_proto.v1 import negotiation_pb2, rendezvous_pb2

from .errors import PermissionDeniedError, shown_id

__all__ = ["check_scope", "metadata_value", "named_identity"]

# Requests that name a worker but need no secret: Join issues it.
_NO_SECRET = (rendezvous_pb2.JoinRequest,)


def metadata_value(metadata: Any, key: str) -> str | None:
    """The first value of ``key`` in gRPC invocation metadata, as text."""
    for name, value in metadata or ():
        if name == key:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None


def named_identity(request: Any) -> tuple[tuple[str, ...], str]:
    """The job ids a decoded hora.v1 request names, and the worker it speaks for ("")."""
    if isinstance(request, rendezvous_pb2.ReattachRequest):
        return (request.join.job_id, request.world.job_id), request.join.worker_id
    if isinstance(request, negotiation_pb2.WorkerMessage):
        if request.WhichOneof("kind") != "open":
            return (), ""  # the stream's identity is its open message's
        return (request.open.job_id,), request.open.worker_id
    fields = request.DESCRIPTOR.fields_by_name
    jobs = (request.job_id,) if "job_id" in fields else ()
    worker = request.worker_id if "worker_id" in fields else ""
    return jobs, worker


def _secret_ok(admin: str, job: str, worker: str, metadata: Any) -> bool:
    sent = metadata_value(metadata, WORKER_SECRET_METADATA_KEY)
    return sent is not None and hmac.compare_digest(
        sent.encode("utf-8", "replace"), worker_secret(admin, job, worker).encode())


def check_scope(admin: str, job: str, request: Any, metadata: Any) -> None:
    """Refuses ``request`` unless it stays within job ``job`` and proves its worker.

    Raises:
        PermissionDeniedError: it names another job, or speaks for a worker
            without that worker's secret.
    """
    jobs, worker = named_identity(request)
    for named in jobs:
        if named != job:
            raise PermissionDeniedError(
                f"this job token opens job '{shown_id(job)}' only; the call names job "
                f"'{shown_id(named)}'")
    if worker and not isinstance(request, _NO_SECRET) and not _secret_ok(
            admin, job, worker, metadata):
        raise PermissionDeniedError(
            f"the call speaks for worker '{shown_id(worker)}' of job '{shown_id(job)}' "
            f"without its secret (metadata '{WORKER_SECRET_METADATA_KEY}', issued by Join)")


def join_allowed(admin: str, job: str, worker: str, is_member: bool, metadata: Any) -> None:
    """Refuses a job-token Join under the id of a current member unless it proves that member.

    Raises:
        PermissionDeniedError: ``worker`` is a member and the secret is missing or wrong.
    """
    if is_member and not _secret_ok(admin, job, worker, metadata):
        raise PermissionDeniedError(
            f"worker '{shown_id(worker)}' is already a member of job '{shown_id(job)}'; a "
            f"Join under its id must carry its secret (metadata '{WORKER_SECRET_METADATA_KEY}')")
