"""Requests that do not decode: a typed INVALID_REQUEST and a rate-limited log line, never a traceback.

grpc.aio decodes a request before any handler runs. A message that does not
decode (a corrupt wire format, a string field that is not UTF-8) would fail
the call with UNKNOWN and no ErrorInfo, and log a traceback at ERROR for each
one: a cheap way to flood the logs. Inside a request stream, the stream would
end with OK while the calls still open on it never got their answers.

Here each method's decoder never raises: a message that does not decode
becomes UNDECODABLE, and the method's handler answers it. A unary request
fails with INVALID_ARGUMENT and ErrorInfo INVALID_REQUEST. In a request stream
the message ends what the caller sends: the stream takes nothing after it,
answers what is still open, then fails the same way (toolmesh.runtime.relay).
Either way one WARNING line per method says so, at most every LOG_INTERVAL_S,
with how many were refused since the last line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn, cast

import grpc

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import to_grpc_status
from toolmesh.runtime.rpc_types import ServicerContext

log = logging.getLogger("toolmesh.server")

LOG_INTERVAL_S = 10.0
DETAIL = "A message could not be decoded (a corrupt protobuf, or a string field that is not UTF-8)."


class _Undecodable:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNDECODABLE"


# What a method's decoder gives for bytes that are not its request message.
UNDECODABLE: Any = _Undecodable()


def undecodable() -> ToolmeshError:
    """The error a request that did not decode fails with."""
    return ToolmeshError(Code.INVALID_REQUEST, DETAIL)


class _Tally:
    """Refusals per method, logged at most once per LOG_INTERVAL_S."""

    def __init__(self) -> None:
        self._since_logged: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}

    def refused(self, method: str) -> None:
        count = self._since_logged.get(method, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(method, -LOG_INTERVAL_S) < LOG_INTERVAL_S:
            self._since_logged[method] = count
            return
        self._logged_at[method] = now
        self._since_logged[method] = 0
        log.warning("undecodable request refused", extra={"method": method, "count": count})


_TALLY = _Tally()


def decoding(server: grpc.aio.Server) -> grpc.aio.Server:
    """`server` as a generated add_*Servicer_to_server sees it: each handler it adds decodes leniently.

    Those functions call only the two methods of grpc.aio.Server that the stand-in has.
    """
    return cast(grpc.aio.Server, _DecodingServer(server))


class _DecodingServer:
    """Stands in for the server while a service's handlers are added to it."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers([_LenientGeneric(handler) for handler in handlers])

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        lenient = {name: lenient_handler(f"{service}/{name}", handler) for name, handler in handlers.items()}
        self._server.add_registered_method_handlers(service, lenient)


class _LenientGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        return lenient_handler(handler_call_details.method.lstrip("/"), handler)


def lenient_handler(method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` with a decoder that never raises, and a behavior that answers UNDECODABLE."""
    decode = handler.request_deserializer
    if decode is None:
        return handler

    def lenient(data: bytes) -> Any:
        try:
            return decode(data)
        except Exception:
            return UNDECODABLE

    encode = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            _stream_stream(method, handler.stream_stream), lenient, encode
        )
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            _stream_unary(method, handler.stream_unary), lenient, encode
        )
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _unary_stream(method, handler.unary_stream), lenient, encode
        )
    return grpc.unary_unary_rpc_method_handler(_unary_unary(method, handler.unary_unary), lenient, encode)


async def _refuse(method: str, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
    _TALLY.refused(method)
    await _abort(context, undecodable())


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: ToolmeshError) -> NoReturn:
    status = to_grpc_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)


async def _checked(method: str, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for message in messages:
        if message is UNDECODABLE:
            _TALLY.refused(method)
            raise undecodable()
        yield message


def _unary_unary(method: str, inner: Any) -> Callable[[Any, ServicerContext], Awaitable[Any]]:
    async def unary_unary(request: Any, context: ServicerContext) -> Any:
        if request is UNDECODABLE:
            await _refuse(method, context)
        return await inner(request, context)

    return unary_unary


def _unary_stream(method: str, inner: Any) -> Callable[[Any, ServicerContext], AsyncIterator[Any]]:
    async def unary_stream(request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        if request is UNDECODABLE:
            await _refuse(method, context)
        async for response in inner(request, context):
            yield response

    return unary_stream


def _stream_unary(method: str, inner: Any) -> Callable[[AsyncIterator[Any], ServicerContext], Awaitable[Any]]:
    async def stream_unary(requests: AsyncIterator[Any], context: ServicerContext) -> Any:
        try:
            return await inner(_checked(method, requests), context)
        except ToolmeshError as error:  # a servicer that maps no errors of its own (reflection)
            await _abort(context, error)

    return stream_unary


def _stream_stream(
    method: str, inner: Any
) -> Callable[[AsyncIterator[Any], ServicerContext], AsyncIterator[Any]]:
    async def stream_stream(requests: AsyncIterator[Any], context: ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in inner(_checked(method, requests), context):
                yield response
        except ToolmeshError as error:  # a servicer that maps no errors of its own (reflection)
            await _abort(context, error)

    return stream_stream
