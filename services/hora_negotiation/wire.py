"""The negotiation's answers as ``hora.v1`` messages (the coordinator's wire
adapter and a world of one both encode with these).

A tensor request is copied field by field over :class:`PlainTensorRequest`'s
fields, whose names are the message's (tests/coordinator/test_wire.py checks
it): the fields are listed in one place only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hora_proto.v1 import negotiation_pb2 as npb

from .messages import PlainTensorRequest, Response, TensorRequest

__all__ = ["response_pb", "tensor_request_pb"]

_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(PlainTensorRequest))


def tensor_request_pb(request: TensorRequest) -> npb.TensorRequest:
    """A tensor request as a message; one that is a message already comes back as it is."""
    if isinstance(request, npb.TensorRequest):
        return request
    fields: dict[str, Any] = {name: getattr(request, name) for name in _REQUEST_FIELDS}
    return npb.TensorRequest(**fields)


def response_pb(response: Response) -> npb.Response:
    """One response as a message."""
    return npb.Response(
        type=response.type,  # type: ignore[arg-type]
        tensor_names=response.tensor_names,
        process_set_id=response.process_set_id,
        first_dims=response.first_dims,
        splits=response.splits,
        error_message=response.error_message,
        error_kind=response.error_kind,  # type: ignore[arg-type]
        join_fill=[tensor_request_pb(r) for r in response.join_fill],
        last_joined_rank=response.last_joined_rank,
    )
