"""The exceptions hora raises, typed by what the caller should do about them.

    HoraError
     +-- InvalidCallError (also a ValueError and a RuntimeError)
     |    A collective was called wrongly (on this rank or on another rank of
     |    the call): this call fails on every rank of it, and nothing else.
     |    The next collective works. Raised before anything reaches the
     |    data plane.
     |    +-- InvalidTypeError (also a TypeError)   an argument of the wrong type
     +-- GradientComputedAgainError (also an AssertionError and a RuntimeError)
     |    A DistributedOptimizer's gradient was computed more often than
     |    backward_passes_per_step before step(); that step is forgotten.
     +-- HorovodInternalError (also a RuntimeError)
     |    A collective could not complete: a peer died, a tensor disagreed
     |    across ranks, the data plane failed. Elastic jobs restore the last
     |    commit and re-synchronise; other jobs should exit.
     |    +-- TensorMismatchError   ranks disagree on a tensor's dtype, shape,
     |    |                         op (also a ValueError); fails that call only
     |    +-- RankLostError         a member of the world was lost or left
     |    +-- StallError            a tensor waited on some ranks too long
     +-- HostsUpdatedInterrupt
     |    Membership changed gracefully: re-rendezvous, no restore needed.
     +-- CoordinatorError (also a ConnectionError)
     |    The coordinator could not be reached or refused us.
     |    +-- CoordinatorUnavailableError   nothing answered before the deadline
     |    +-- AuthenticationError           the job token was missing or wrong
     +-- RendezvousError
          Joining the job failed.
          +-- RendezvousTimeoutError        the world did not gather in time

Names match Horovod's where Horovod has the concept, so that
``except HorovodInternalError`` in an existing script keeps working. Only a
lost peer, a failed job or a broken transport fails the engine of a
generation (every later collective raises until an elastic reset or
``shutdown()``/``init()``); an invalid or mismatched call fails that call.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "CoordinatorError",
    "CoordinatorUnavailableError",
    "GradientComputedAgainError",
    "HoraError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "InvalidCallError",
    "InvalidTypeError",
    "RankLostError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "StallError",
    "TensorMismatchError",
]


class HoraError(Exception):
    """Root of every error hora raises on purpose."""


class InvalidCallError(HoraError, ValueError, RuntimeError):
    """A collective's arguments are invalid on some rank; that call fails on every rank.

    Both a ValueError (what Python code raises for bad arguments) and a
    RuntimeError (what Horovod raises from its ops), so that either
    ``except`` in an existing script catches it.
    """


class InvalidTypeError(InvalidCallError, TypeError):
    """An argument has the wrong type (a tensor was expected, say)."""


class GradientComputedAgainError(HoraError, AssertionError, RuntimeError):
    """A DistributedOptimizer's gradient was computed again before ``step()``.

    An AssertionError, as Horovod's optimizer raises there, and a RuntimeError,
    as hora raised before, so that either ``except`` keeps working.
    """


class HorovodInternalError(HoraError, RuntimeError):
    """A collective failed; the state of this generation cannot be trusted."""


class TensorMismatchError(HorovodInternalError, ValueError):
    """Ranks submitted the same tensor name with a different dtype, shape or op.

    Fails that collective on every rank; the generation goes on.
    """


class RankLostError(HorovodInternalError):
    """A member of the world died, stopped answering, or shut down."""


class StallError(HorovodInternalError):
    """A tensor waited on some ranks for longer than the stall shutdown time."""


class HostsUpdatedInterrupt(HoraError):
    """Hosts were added or removed gracefully; re-rendezvous without a restore.

    Args:
        skip_sync: True when only removals happened and no state must be
            broadcast again.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class CoordinatorError(HoraError, ConnectionError):
    """Talking to the coordinator failed."""


class CoordinatorUnavailableError(CoordinatorError):
    """The coordinator did not answer before the deadline."""


class AuthenticationError(CoordinatorError):
    """The coordinator refused the job token."""


class RendezvousError(HoraError):
    """Joining the job failed."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """The world did not gather before the start timeout."""
