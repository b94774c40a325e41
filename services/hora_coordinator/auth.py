"""Guarding the hora.v1 services: the token first, then the request bytes.

:class:`TokenAuthInterceptor` checks the ``hora-token`` metadata (the admin
token, or a job token that names its job: :mod:`hora_proto.auth`) before any
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

A call with a job token is then held to its scope once decoded
(:mod:`.scopes`): PERMISSION_DENIED when it names another job, or speaks for a
worker without that worker's secret. Wrong tokens count against the caller's
address (:mod:`.guessing`): past its budget, new connections from it are
RESOURCE_EXHAUSTED, their token unchecked.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from hora_proto.auth import TOKEN_METADATA_KEY, job_of_token
from hora_proto.refusals import RefusalLog

from .errors import (
    AuthenticationError,
    CoordinatorError,
    InvalidRequestError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from .guessing import GuessLimiter, address_of_peer
from .scopes import check_scope, metadata_value
from .servicer import abort_with

__all__ = ["TokenAuthInterceptor"]

logger = logging.getLogger("hora_coordinator")

_PROTECTED_PREFIX = "/hora.v1."

_MISSING, _WRONG, _UNDECODABLE = "missing token", "wrong token", "undecodable request"
_LIMITED, _DENIED = "too many wrong tokens", "outside the job token's scope"
# The keys of a method's decoding handlers in the interceptor's cache.
_AUTHORISED, _SCOPED = "", "job token"
_JOB_TOKEN_CACHE = 4096

# The gRPC factory of each kind of handler, by (request streaming, response streaming).
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses hora.v1 calls without a right ``hora-token`` metadata, before decoding.

    The admin token opens every call. A job token (:func:`hora_proto.auth.job_token`)
    opens calls that stay within its job and prove the workers they speak for
    (:func:`.scopes.check_scope`, after decoding). Other services
    (grpc.health.v1) pass through untouched, so that probes need no secret.
    Addresses that send many wrong tokens are limited (:mod:`.guessing`).

    Args:
        token: The admin token.
        log: Where refusals are logged (rate limited).
        limiter: The wrong-token budget per address (default: 30, then 1 a second).
    """

    def __init__(self, token: str, log: RefusalLog | None = None,
                 limiter: GuessLimiter | None = None) -> None:
        self._admin = token
        self._token = token.encode()
        self._log = log if log is not None else RefusalLog(0.0, logger)
        self._limiter = limiter if limiter is not None else GuessLimiter()
        # Job tokens already verified, and their job (bounded: cleared when full).
        self._jobs: dict[str, str] = {}
        # By (method, outcome): the server's handler and the one wrapped around it.
        self._wrapped: dict[
            tuple[str, str], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]
        ] = {}

    def job_of(self, sent: str) -> str | None:
        """The job ``sent`` opens, if it is a genuine job token (cached)."""
        job = self._jobs.get(sent)
        if job is None:
            job = job_of_token(self._admin, sent)
            if job is not None:
                if len(self._jobs) >= _JOB_TOKEN_CACHE:
                    self._jobs.clear()
                self._jobs[sent] = job
        return job

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_PROTECTED_PREFIX):
            return handler
        sent = metadata_value(handler_call_details.invocation_metadata, TOKEN_METADATA_KEY)
        if sent is None:
            kind = _MISSING
        elif secrets.compare_digest(sent.encode("utf-8", "replace"), self._token):
            kind = _AUTHORISED
        elif self.job_of(sent) is not None:
            kind = _SCOPED
        else:
            kind = _WRONG
        cached = self._wrapped.get((method, kind))
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method, kind)
        self._wrapped[(method, kind)] = (handler, wrapped)
        return wrapped

    def _wrap(
        self, handler: grpc.RpcMethodHandler, method: str, kind: str
    ) -> grpc.RpcMethodHandler:
        if kind in (_AUTHORISED, _SCOPED):
            scope = self._scope_checker() if kind == _SCOPED else None
            return _decoding(handler, method, self._log, self._limiter, scope)
        if kind == _MISSING:
            problem = (
                f"missing job token: send the coordinator's token in metadata key "
                f"'{TOKEN_METADATA_KEY}'"
            )
        else:
            problem = f"wrong job token in metadata key '{TOKEN_METADATA_KEY}'"
        return _with_raw_requests(
            handler, _refusal(method, kind, problem, self._log, self._limiter))

    def _scope_checker(self) -> Callable[[Any, Any], None]:
        admin = self._admin

        def check(request: Any, context: Any) -> None:
            metadata = context.invocation_metadata()
            job = self.job_of(metadata_value(metadata, TOKEN_METADATA_KEY) or "")
            if job is None:  # cannot happen: the token was verified for this call
                raise AuthenticationError("the job token no longer verifies")
            check_scope(admin, job, request, metadata)

        return check


async def _admitted(context: grpc.aio.ServicerContext, limiter: GuessLimiter,
                    log: RefusalLog, method: str) -> None:
    """Refuses a call with a right token on a new connection from a limited address."""
    peer = context.peer()
    if not limiter.admits(address_of_peer(peer), peer):
        problem = _limited_problem(address_of_peer(peer))
        log.refused(_LIMITED, f"refused {method} from {peer}: {problem}")
        await abort_with(context, ResourceExhaustedError(problem))
    limiter.proved(peer)


def _limited_problem(address: str) -> str:
    return (f"too many wrong tokens from {address}: calls from new connections of this "
            f"address are refused, unchecked, for a while; retry later")


def _refusal(method: str, kind: str, problem: str, log: RefusalLog,
             limiter: GuessLimiter) -> Callable[..., Any]:
    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        address = address_of_peer(peer)
        if limiter.limited(address):
            limited = _limited_problem(address)
            log.refused(_LIMITED, f"refused {method} from {peer}: {limited}")
            await abort_with(context, ResourceExhaustedError(limited))
        limiter.failed(address, peer)
        log.refused(kind, f"refused {method} from {peer}: {problem}")
        await abort_with(context, AuthenticationError(problem))

    return refuse


def _undecodable(method: str, what: str, log: RefusalLog, context: Any) -> InvalidRequestError:
    problem = f"the request bytes do not decode as {what}"
    log.refused(_UNDECODABLE, f"refused {method} from {context.peer()}: {problem}")
    return InvalidRequestError(f"{problem} (method {method})")


def _decoding(
    handler: grpc.RpcMethodHandler, method: str, log: RefusalLog, limiter: GuessLimiter,
    scope: Callable[[Any, Any], None] | None,
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
        return handler  # nothing to decode (no hora.v1 method)
    descriptor = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
    what = getattr(descriptor, "full_name", "the method's request message")

    if handler.request_streaming:

        async def stream(raw_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            await _admitted(context, limiter, log, method)

            async def decoded() -> AsyncIterator[Any]:
                async for raw in raw_iterator:
                    try:
                        message = decode(raw)
                    except DecodeError:
                        raise _undecodable(method, what, log, context) from None
                    if scope is not None:
                        scope(message, context)  # raises PermissionDeniedError
                    yield message

            return await behavior(decoded(), context)

        return _with_raw_requests(handler, stream)

    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        await _admitted(context, limiter, log, method)
        try:
            request = decode(raw)
            if scope is not None:
                scope(request, context)
        except DecodeError:
            error: CoordinatorError = _undecodable(method, what, log, context)
            await abort_with(context, error)
        except PermissionDeniedError as exc:
            log.refused(_DENIED, f"refused {method} from {context.peer()}: {exc}")
            await abort_with(context, exc)
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
