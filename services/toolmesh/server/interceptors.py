"""The one server interceptor: a span per RPC and errors turned into statuses.

grpc.aio builds a new handler on every call that passes through an
interceptor, and every layer of interception costs per call; so this is a
single layer, and it wraps each method's handler once and reuses it.

Spans follow the OpenTelemetry RPC conventions (name `package.Service/Method`,
`rpc.system`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code`) and continue
the caller's W3C trace context from the metadata. Health and reflection calls
are not traced.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from toolmesh.core import telemetry
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import to_grpc_status
from toolmesh.server.rpc_types import ServicerContext

log = logging.getLogger("toolmesh.server")

# grpcio ships no types: a grpc.RpcMethodHandler.
Handler: TypeAlias = Any
_UNTRACED_PREFIX = "/grpc."


async def _abort_for(method: str, context: ServicerContext, exc: Exception) -> None:
    """Fail the call with the status for `exc`; gRPC's own abort passes through."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if not isinstance(exc, ToolmeshError):
        # The exception text may quote request data: log only its type.
        log.error("unexpected error in %s: %s", method, type(exc).__name__, exc_info=exc)
        exc = ToolmeshError(Code.INTERNAL)
    status = to_grpc_status(exc)
    span = trace.get_current_span()
    span.set_attribute("rpc.grpc.status_code", status.code.value[0])
    span.set_status(Status(StatusCode.ERROR, exc.code.value))
    await context.abort(status.code, status.details, status.trailing_metadata)


class ServiceInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self) -> None:
        self._handlers: dict[str, Handler | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        method: str = handler_call_details.method
        if method in self._handlers:
            return self._handlers[method]
        inner = await continuation(handler_call_details)
        wrapped = None if inner is None else _wrap(method, inner)
        self._handlers[method] = wrapped
        return wrapped


def _wrap(method: str, handler: Handler) -> Handler:
    traced = not method.startswith(_UNTRACED_PREFIX)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _unary(method, handler.unary_unary, traced),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _stream(method, handler.unary_stream, traced),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler


def _span(method: str, context: ServicerContext, traced: bool) -> Any:
    if not traced or not telemetry.enabled():
        return contextlib.nullcontext(trace.INVALID_SPAN)
    service, _, name = method[1:].rpartition("/")
    return telemetry.TRACER.start_as_current_span(
        method[1:],
        context=telemetry.extract_metadata(context.invocation_metadata()),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        record_exception=False,
        set_status_on_exception=False,
    )


def _unary(method: str, inner: Callable[..., Awaitable[Any]], traced: bool) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: ServicerContext) -> Any:
        with _span(method, context, traced) as span:
            try:
                response = await inner(request, context)
            except Exception as exc:
                await _abort_for(method, context, exc)
                return None
            span.set_attribute("rpc.grpc.status_code", 0)
            return response

    return unary


def _stream(
    method: str, inner: Callable[..., AsyncIterator[Any]], traced: bool
) -> Callable[..., AsyncIterator[Any]]:
    async def stream(request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        with _span(method, context, traced):
            try:
                async for item in inner(request, context):
                    yield item
            except Exception as exc:
                await _abort_for(method, context, exc)

    return stream
