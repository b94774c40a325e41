"""The errors the coordinator raises on purpose, typed by what went wrong.

    CoordinatorError
     +-- InvalidRequestError        the request contradicts the job (INVALID_ARGUMENT)
     |    +-- RoundFullError        the next round already has every joiner it needs
     +-- OutOfRangeError            a store integer would leave int64 (OUT_OF_RANGE)
     +-- UnknownError               a job, worker or key does not exist (NOT_FOUND)
     |    +-- UnknownJobError       the job named is not served here (kind unknown-job)
     +-- PreconditionError          the job is not in a state that allows it
     |    |                         (FAILED_PRECONDITION)
     |    +-- JobFailedError        the job failed; carries the failure reason
     |    +-- StaleGenerationError  the caller names a generation that is not current
     |    +-- RankGoneError         a collective call can never complete: a member
     |                              of its generation left or was lost
     +-- AlreadyOpenError           a second negotiation stream for a member (ALREADY_EXISTS)
     +-- SupersededError           a retried Join replaced this one (ABORTED)
     +-- KeyTimeoutError           store keys did not arrive in time (DEADLINE_EXCEEDED)
     +-- CallTimeoutError          some ranks did not make a collective call in time
     |                             (DEADLINE_EXCEEDED)
     +-- AuthenticationError       the job token is missing or wrong (UNAUTHENTICATED)
     +-- PermissionDeniedError     a job token names another job, or a worker's secret
     |                             is missing or wrong (PERMISSION_DENIED)
     +-- ResourceExhaustedError    a coordinator-wide limit is reached (RESOURCE_EXHAUSTED)

The five a negotiation table raises (the root, InvalidRequestError,
PreconditionError, RankGoneError, CallTimeoutError) are defined in
:mod:`hora_negotiation.errors`, which a world of one imports without this
service, and re-exported here. The state transitions and the store raise
these; the gRPC layer turns them into status codes in exactly one place
(``servicer.status_for``; ``auth`` refuses before decoding).
An error whose ``kind`` is set also carries it in the call's trailing metadata
(:mod:`hora_proto.error_kinds`), for clients to act on without reading the text.
"""

from __future__ import annotations

from hora_negotiation.errors import (
    CallTimeoutError,
    CoordinatorError,
    InvalidRequestError,
    PreconditionError,
    RankGoneError,
)
from hora_proto.error_kinds import UNKNOWN_JOB

__all__ = [
    "AlreadyOpenError",
    "AuthenticationError",
    "CallTimeoutError",
    "CoordinatorError",
    "InvalidRequestError",
    "JobFailedError",
    "KeyTimeoutError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "PreconditionError",
    "RankGoneError",
    "ResourceExhaustedError",
    "RoundFullError",
    "StaleGenerationError",
    "SupersededError",
    "UnknownError",
    "UnknownJobError",
    "shown_id",
]

# Ids and keys quoted in error messages are cut to this many characters.
_SHOWN_LENGTH = 64


def shown_id(value: str) -> str:
    """An id (or key) as error messages quote it: at most 64 characters ("…" if cut).

    A caller may send any length, and a message is sent back whole to every
    caller it answers.
    """
    return value if len(value) <= _SHOWN_LENGTH else value[:_SHOWN_LENGTH] + "…"


class RoundFullError(InvalidRequestError):
    """Raised when a Join arrives for a round that already has all its joiners."""


class OutOfRangeError(CoordinatorError):
    """Raised when a store Add would make (or reads) an integer outside int64, the
    range the wire carries; the key keeps its value."""


class UnknownError(CoordinatorError):
    """Raised when a job, a member or a store key does not exist."""


class UnknownJobError(UnknownError):
    """Raised when the job named is not one this coordinator serves."""

    kind = UNKNOWN_JOB


class JobFailedError(PreconditionError):
    """Raised for Join and stream opens on a job that failed; the message is the failure."""


class StaleGenerationError(PreconditionError):
    """Raised when a worker names a generation that is not the job's current one."""


class AlreadyOpenError(CoordinatorError):
    """Raised when a member opens a second negotiation stream in one generation."""


class SupersededError(CoordinatorError):
    """Raised to a pending Join that a retry with the same worker id replaced."""


class KeyTimeoutError(CoordinatorError):
    """Raised when store keys are not set before the request's timeout; names them."""


class AuthenticationError(CoordinatorError):
    """Raised when a call carries no job token or the wrong one."""


class PermissionDeniedError(CoordinatorError):
    """Raised when a job token names another job, or a call speaks for a worker
    without that worker's secret (:mod:`.scopes`)."""


class ResourceExhaustedError(CoordinatorError):
    """Raised when a request would take the coordinator past one of its limits
    (settings ``max_jobs``, ``max_members_per_job``); nothing was changed."""
