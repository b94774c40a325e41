"""The errors a negotiation table raises, the root of the coordinator's own.

:mod:`hora_coordinator.errors` re-exports these and derives the rest of its
hierarchy from :class:`CoordinatorError`; a world of one
(:mod:`hora_negotiation.solo`) raises them without the service.
"""

from __future__ import annotations

__all__ = [
    "CallTimeoutError",
    "CoordinatorError",
    "InvalidRequestError",
    "PreconditionError",
    "RankGoneError",
]


class CoordinatorError(Exception):
    """Root of every error the coordinator raises on purpose."""

    #: What a client may act on, sent in the trailing metadata ("": nothing to act on).
    kind = ""


class InvalidRequestError(CoordinatorError):
    """Raised when a request contradicts the job: a size that differs from the
    one the first joiner set, a rank hint out of range or taken twice, a
    malformed first stream message, a store value that is not an integer."""


class PreconditionError(CoordinatorError):
    """Raised when the job's state does not allow the operation."""


class RankGoneError(PreconditionError):
    """Raised to the callers of a collective call (AddProcessSet, RemoveProcessSet)
    that can never complete: a member of the generation left or was lost before
    calling, or the generation or the job ended; names the member or the cause."""


class CallTimeoutError(CoordinatorError):
    """Raised to the callers of a collective call (AddProcessSet, RemoveProcessSet)
    when some ranks did not call within the job's stall shutdown time; names them."""
