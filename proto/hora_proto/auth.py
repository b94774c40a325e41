"""How a caller proves it belongs to a job."""

from __future__ import annotations

__all__ = ["TOKEN_METADATA_KEY"]

# The gRPC metadata key that carries the job token on every call.
TOKEN_METADATA_KEY = "hora-token"
