"""Unit tests of the token interceptor's handler cache (no server)."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import grpc
import pytest

from hora_coordinator.auth import TokenAuthInterceptor
from hora_proto.v1 import rendezvous_pb2 as rpb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class _Details(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


async def _heartbeat(request, context):
    return rpb.HeartbeatResponse()


def test_each_method_and_outcome_is_wrapped_once():
    server_handler = grpc.unary_unary_rpc_method_handler(
        _heartbeat,
        request_deserializer=rpb.HeartbeatRequest.FromString,
        response_serializer=rpb.HeartbeatResponse.SerializeToString,
    )
    interceptor = TokenAuthInterceptor("t")

    async def continuation(details):
        return server_handler

    def intercept(token: str | None):
        metadata = (("hora-token", token),) if token is not None else ()
        details = _Details("/hora.v1.Rendezvous/Heartbeat", metadata)
        return asyncio.run(interceptor.intercept_service(continuation, details))

    authorised = intercept("t")
    assert authorised is not server_handler and authorised.request_deserializer is None
    assert intercept("t") is authorised
    wrong, missing = intercept("x"), intercept(None)
    assert len({id(authorised), id(wrong), id(missing)}) == 3
    assert intercept("y") is wrong and intercept(None) is missing
