"""Guarding the hora.v1 services: the token first, then the request bytes.

:class:`TokenAuthInterceptor` checks the ``hora-token`` metadata before any
request byte is decoded: the handlers it returns take raw bytes (no
deserializer), so a caller without the token gets UNAUTHENTICATED whatever it
sends, and the coordinator spends nothing on decoding it. Calls with the token
are decoded by the interceptor's wrapper: bytes that do not decode end in
INVALID_ARGUMENT (:class:`~.errors.InvalidRequestError`), not in gRPC's
"Unexpected error" with a traceback in the log. Log lines about refusals are
rate limited per kind (:class:`hora_proto.refusals.RefusalLog`), so that a flood of bad calls
cannot flood the log. The wrapped handler of each method and outcome is
built once and kept: the authorised path (every heartbeat, every store call)
only looks it up.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from hora_proto.auth import TOKEN_METADATA_KEY
from hora_proto.refusals import RefusalLog

from .errors import AuthenticationError, CoordinatorError, InvalidRequestError
from .servicer import abort_with

__all__ = ["TokenAuthInterceptor"]

logger = logging.getLogger("hora_coordinator")

_PROTECTED_PREFIX = "/hora.v1."

_MISSING, _WRONG, _UNDECODABLE = "missing token", "wrong token", "undecodable request"
_AUTHORISED = ""  # the key of a method's decoding handler in the interceptor's cache

# The gRPC factory of each kind of handler, by (request streaming, response streaming).
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses hora.v1 calls without the right ``hora-token`` metadata, before decoding.

    Other services (grpc.health.v1) pass through untouched, so that probes
    need no secret.

    Args:
        token: The token calls must carry.
        log: Where refusals are logged (rate limited).
    """

    def __init__(self, token: str, log: RefusalLog | None = None) -> None:
        self._token = token.encode()
        self._log = log if log is not None else RefusalLog(0.0, logger)
        # By (method, outcome): the server's handler and the one wrapped around it.
        self._wrapped: dict[
            tuple[str, str], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]
        ] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_PROTECTED_PREFIX):
            return handler
        sent = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                sent = value
                break
        if sent is None:
            kind = _MISSING
        elif not secrets.compare_digest(
            sent.encode() if isinstance(sent, str) else bytes(sent), self._token
        ):
            kind = _WRONG
        else:
            kind = _AUTHORISED
        cached = self._wrapped.get((method, kind))
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method, kind)
        self._wrapped[(method, kind)] = (handler, wrapped)
        return wrapped

    def _wrap(
        self, handler: grpc.RpcMethodHandler, method: str, kind: str
    ) -> grpc.RpcMethodHandler:
        if kind == _AUTHORISED:
            return _decoding(handler, method, self._log)
        if kind == _MISSING:
            problem = (
                f"missing job token: send the coordinator's token in metadata key "
                f"'{TOKEN_METADATA_KEY}'"
            )
        else:
            problem = f"wrong job token in metadata key '{TOKEN_METADATA_KEY}'"
        return _with_raw_requests(handler, _refusal(method, kind, problem, self._log))


def _refusal(method: str, kind: str, problem: str, log: RefusalLog) -> Callable[..., Any]:
    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        log.refused(kind, f"refused {method} from {context.peer()}: {problem}")
        await abort_with(context, AuthenticationError(problem))

    return refuse


def _undecodable(method: str, what: str, log: RefusalLog, context: Any) -> InvalidRequestError:
    problem = f"the request bytes do not decode as {what}"
    log.refused(_UNDECODABLE, f"refused {method} from {context.peer()}: {problem}")
    return InvalidRequestError(f"{problem} (method {method})")


def _decoding(
    handler: grpc.RpcMethodHandler, method: str, log: RefusalLog
) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes and decoding them itself, refusing what does not decode.

    A request stream is decoded message by message; an undecodable one raises
    InvalidRequestError where the servicer reads it (the servicer maps it).
    Every hora.v1 handler is a coroutine function (:mod:`.servicer`).
    """
    decode = handler.request_deserializer
    if handler.request_streaming:
        behavior = handler.stream_stream or handler.stream_unary
    else:
        behavior = handler.unary_stream or handler.unary_unary
    if decode is None:
        return handler  # nothing to decode
    descriptor = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
    what = getattr(descriptor, "full_name", "the method's request message")

    if handler.request_streaming:

        async def stream(raw_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            async def decoded() -> AsyncIterator[Any]:
                async for raw in raw_iterator:
                    try:
                        yield decode(raw)
                    except DecodeError:
                        raise _undecodable(method, what, log, context) from None

            return await behavior(decoded(), context)

        return _with_raw_requests(handler, stream)

    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = decode(raw)
        except DecodeError:
            error: CoordinatorError = _undecodable(method, what, log, context)
            await abort_with(context, error)
        return await behavior(request, context)

    return _with_raw_requests(handler, unary)


def _with_raw_requests(
    handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` running ``behavior`` on undecoded bytes."""
    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(
        behavior, request_deserializer=None, response_serializer=handler.response_serializer
    )
