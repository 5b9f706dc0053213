"""Server interceptors: errors become statuses with ErrorInfo in one place."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import to_grpc_status
from toolmesh.server.rpc_types import ServicerContext

log = logging.getLogger("toolmesh.server")


async def _abort_for(method: str, context: ServicerContext, exc: Exception) -> None:
    """Fail the call with the status for `exc`; gRPC's own abort passes through."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if not isinstance(exc, ToolmeshError):
        # The exception text may quote request data: log only its type.
        log.error("unexpected error in %s: %s", method, type(exc).__name__, exc_info=exc)
        exc = ToolmeshError(Code.INTERNAL)
    status = to_grpc_status(exc)
    await context.abort(status.code, status.details, status.trailing_metadata)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Turns ToolmeshError (and any unexpected exception) raised by a servicer into a status."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(method: str, inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: ServicerContext) -> Any:
        try:
            return await inner(request, context)
        except Exception as exc:
            await _abort_for(method, context, exc)
        return None

    return unary


def _wrap_stream(method: str, inner: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def stream(request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in inner(request, context):
                yield item
        except Exception as exc:
            await _abort_for(method, context, exc)

    return stream
