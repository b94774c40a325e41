"""The kind of a coordinator's refusal, carried beside its status code.

A status code says what class of thing went wrong (NOT_FOUND); the kind
says which (the job is unknown, not a key). The coordinator puts it in the
call's trailing metadata under :data:`ERROR_KIND_METADATA_KEY`, and the
client reads it with :func:`error_kind`: never by matching the message,
whose wording is for people.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ERROR_KIND_METADATA_KEY", "UNKNOWN_JOB", "error_kind"]

ERROR_KIND_METADATA_KEY = "hora-error-kind"

#: The job named is not one the coordinator serves (a coordinator restarted
#: without a journal says this until a member re-attaches).
UNKNOWN_JOB = "unknown-job"


def error_kind(exc: Any) -> str:
    """The kind a refused gRPC call carries ("" when none, or when ``exc`` is not one)."""
    trailing = getattr(exc, "trailing_metadata", None)
    try:
        metadata = trailing() if callable(trailing) else None
    except Exception:  # an error raised before any call was made has no trailers
        metadata = None
    for key, value in metadata or ():
        if key == ERROR_KIND_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return ""
