"""TensorFlow's error classes for hora's errors, as Horovod's TensorFlow ops raise them.

Horovod's ops raise ``tf.errors.FailedPreconditionError`` when ranks
disagree on a call (shape, dtype, op, root rank, process set) and
``tf.errors.InvalidArgumentError`` for an invalid call (alltoall splits that
do not add up, ...). In eager mode hora raises classes with both bases, so
that ``except tf.errors.InvalidArgumentError`` and ``except
hvd.InvalidCallError`` both catch the error, chained ``from`` the engine's
own. In a graph the op's status carries the matching TensorFlow code
(:func:`status_code`), and :func:`engine_error` finds the engine's error
behind the ``OpError`` that ``Session.run`` raises.
"""

from __future__ import annotations

import collections
import re
import threading

import tensorflow as tf

from .. import errors as _hora

__all__ = ["InvalidCallError", "TensorMismatchError", "engine_error", "remember",
           "status_code", "translate"]


class InvalidCallError(tf.errors.InvalidArgumentError, _hora.InvalidCallError):
    """An invalid collective call (hora's InvalidCallError, TensorFlow's InvalidArgumentError)."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


class TensorMismatchError(tf.errors.FailedPreconditionError, _hora.TensorMismatchError):
    """Ranks disagree on a call (hora's TensorMismatchError, TF's FailedPreconditionError)."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


# absl's status codes (TensorFlow's error codes).
_INVALID_ARGUMENT = 3
_FAILED_PRECONDITION = 9
_ABORTED = 10
_UNKNOWN = 2


def translate(exc: BaseException) -> BaseException:
    """The TensorFlow-flavoured error for an engine error (``exc`` itself if it has none)."""
    if isinstance(exc, (InvalidCallError, TensorMismatchError, _hora.InvalidTypeError)):
        return exc
    if isinstance(exc, _hora.TensorMismatchError):
        return TensorMismatchError(str(exc))
    if isinstance(exc, _hora.InvalidCallError):
        return InvalidCallError(str(exc))
    return exc


def status_code(exc: BaseException) -> int:
    """The TensorFlow status code a graph op fails with for ``exc``."""
    if isinstance(exc, _hora.TensorMismatchError):
        return _FAILED_PRECONDITION
    if isinstance(exc, (_hora.InvalidCallError, ValueError, TypeError)):
        return _INVALID_ARGUMENT
    if isinstance(exc, _hora.HorovodInternalError):
        return _ABORTED
    return _UNKNOWN


# Errors of graph ops by request id: the OpError's message names the id (see remember).
_FAILURES: collections.OrderedDict[int, BaseException] = collections.OrderedDict()
_FAILURES_KEPT = 256
_LOCK = threading.Lock()
_TAG = re.compile(r"\[hora request (\d+)\]")


def remember(request_id: int, exc: BaseException) -> str:
    """Keeps ``exc`` for :func:`engine_error`; returns the op's status message."""
    with _LOCK:
        _FAILURES[request_id] = exc
        while len(_FAILURES) > _FAILURES_KEPT:
            _FAILURES.popitem(last=False)
    return f"{type(exc).__name__}: {exc} [hora request {request_id}]"


def engine_error(exc: BaseException) -> BaseException | None:
    """The engine's error behind ``exc``: itself, its cause, or what failed a graph op."""
    if isinstance(exc, _hora.HoraError):
        return exc
    if isinstance(exc.__cause__, _hora.HoraError):
        return exc.__cause__
    if isinstance(exc, tf.errors.OpError):
        found = _TAG.search(exc.message or "")
        if found is not None:
            with _LOCK:
                failure = _FAILURES.pop(int(found.group(1)), None)
            return None if failure is None else translate(failure)
    return None
