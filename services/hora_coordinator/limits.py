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

__all__ = ["check_join_limits", "shown_id", "split_long_tensor_names"]

def check_join_limits(limits: CoordinatorSettings, job: Job | None, request: JoinRequest) -> None:
    """Refuses a Join past the size limits; ``job`` is the job it names, if it exists.

    Raises:
        InvalidRequestError: an id is too long, or a size above the members per job.
        ResourceExhaustedError: the job's round already holds the most joiners.
    """
    job_id = shown_id(request.job_id)
    for what, value in (("job_id", request.job_id), ("worker_id", request.worker_id)):
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
