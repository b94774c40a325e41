"""The coordinator's size limits on requests, checked before anything changes.

The largest message (``max_message_bytes``) is gRPC's own limit, set where the
server is made (:func:`~.server.create_grpc_server`): gRPC refuses a larger one
with RESOURCE_EXHAUSTED before any handler runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidRequestError, ResourceExhaustedError, shown_id
from .messages import ErrorKind, JoinRequest, Response, ResponseType, TensorRequest
from .settings import CoordinatorSettings
from .state import Job

__all__ = [
    "check_event_limits",
    "check_join_limits",
    "check_printable_ids",
    "shown_id",
    "split_long_tensor_names",
]

# Fields of a unary request that name a job or a worker (checked for every call).
_ID_FIELDS = ("job_id", "worker_id")


def _check_printable(what: str, value: str) -> None:
    # Ids go into log lines and error messages: a newline in one forged a log line.
    if not value.isprintable():
        escaped = value[:64].encode("unicode_escape").decode("ascii")
        raise InvalidRequestError(
            f"{what} '{escaped}' holds a character that is not printable (a newline, a "
            "control character); ids must be printable"
        )


def check_printable_ids(request: object) -> None:
    """Refuses a request whose ``job_id`` or ``worker_id`` is not printable.

    Raises:
        InvalidRequestError: one of them holds a newline or another control character.
    """
    for field in _ID_FIELDS:
        value = getattr(request, field, None)
        if isinstance(value, str):
            _check_printable(field, value)


def check_join_limits(limits: CoordinatorSettings, job: Job | None, request: JoinRequest) -> None:
    """Refuses a Join past the size limits; ``job`` is the job it names, if it exists.

    Raises:
        InvalidRequestError: an id, the host or the data plane address is too long
            or not printable, or a size above the members per job.
        ResourceExhaustedError: the job's round already holds the most joiners.
    """
    job_id = shown_id(request.job_id)
    # A member's host and address are kept (and sent to every member) like its ids.
    for what, value in (("job_id", request.job_id), ("worker_id", request.worker_id),
                        ("host", request.host),
                        ("data_plane_address", request.data_plane_address)):
        _check_printable(what, value)
        if len(value) > limits.max_id_length:
            raise InvalidRequestError(
                f"{what} of {len(value)} characters is longer than the limit of "
                f"{limits.max_id_length} (job '{job_id}')"
            )
    for what, size in (("expected_size", request.expected_size),
                       ("min_size", request.min_size), ("max_size", request.max_size)):
        if size > limits.max_members_per_job:
            raise InvalidRequestError(
                f"{what} {size} is above this coordinator's limit of "
                f"{limits.max_members_per_job} members per job"
            )
    rnd = job.round if job is not None else None
    if (rnd is not None and request.worker_id not in rnd.joiners
            and len(rnd.joiners) >= limits.max_members_per_job):
        raise ResourceExhaustedError(
            f"job '{request.job_id}' already has {len(rnd.joiners)} joiners, the limit "
            "(max_members_per_job)"
        )


def check_event_limits(limits: CoordinatorSettings, kind: str, host: str, message: str) -> None:
    """Refuses a reported event whose kind or host is longer than an id.

    Its message is free text: the job keeps it cut (:data:`~.state.TEXT_LIMIT`).

    Raises:
        InvalidRequestError: the kind or the host is longer than ``max_id_length``.
    """
    for what, value in (("kind", kind), ("host", host)):
        if len(value) > limits.max_id_length:
            raise InvalidRequestError(
                f"event {what} of {len(value)} characters is longer than the limit of "
                f"{limits.max_id_length} (max_id_length)"
            )


def split_long_tensor_names(
    limits: CoordinatorSettings, requests: Sequence[TensorRequest]
) -> tuple[Sequence[TensorRequest], list[Response]]:
    """The requests whose names are within ``max_tensor_name_length``, and an
    ERROR response (kind INVALID: that call fails, nothing else) for each other one.

    On the hot path: a message without an over-long name costs one pass over
    the names and comes back as it is.
    """
    limit = limits.max_tensor_name_length
    if not any(len(r.name) > limit for r in requests):
        return requests, []
    kept: list[TensorRequest] = []
    refused: list[Response] = []
    for r in requests:
        if len(r.name) <= limit:
            kept.append(r)
            continue
        refused.append(Response(
            type=ResponseType.ERROR,
            tensor_names=(r.name,),
            process_set_id=r.process_set_id,
            error_message=(
                f"tensor '{shown_id(r.name)}': a name of {len(r.name)} characters is longer "
                f"than this coordinator's limit of {limit} (max_tensor_name_length)"
            ),
            error_kind=ErrorKind.INVALID,
        ))
    return kept, refused
