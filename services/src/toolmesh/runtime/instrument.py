"""Wrapping each servicer method once: who may call it, a span per RPC, and errors turned into statuses.

This is done when a service is added to its server, not by a server
interceptor: grpc.aio runs interceptors on every call and builds a new
handler each time, which is measurable on a call path this short.

Spans follow the OpenTelemetry RPC conventions (name `package.Service/Method`,
`rpc.system`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code`) and continue
the caller's W3C trace context from the metadata; when tracing is off
(telemetry.enabled() is false) no span is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from toolmesh.auth.guard import grant_expires_at, token_expired
from toolmesh.core import telemetry
from toolmesh.core.errors import Code, ToolmeshError, typed_error
from toolmesh.core.rpcstatus import to_grpc_status
from toolmesh.runtime import store_errors
from toolmesh.runtime.rpc_types import ServicerContext

log = logging.getLogger("toolmesh.server")


class OpenStreams:
    """The server-streaming calls a server has open, so that stopping it can end them at once.

    Each ends with UNAVAILABLE and ErrorInfo SHUTTING_DOWN, instead of holding
    the server's stop until its grace runs out.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.ending = False

    def opened(self) -> asyncio.Task[Any] | None:
        """Register the current call's task (to pass to `closed`); None outside a task."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        return task

    def closed(self, task: asyncio.Task[Any] | None) -> None:
        """The call ended."""
        if task is not None:
            self._tasks.discard(task)

    def end_all(self) -> None:
        """End every open stream (and refuse new ones) with SHUTTING_DOWN."""
        self.ending = True
        for task in list(self._tasks):
            task.cancel()


# What a call must pass before the servicer runs (toolmesh.auth.guard); it raises ToolmeshError.
Admit = Callable[[Any, ServicerContext], Awaitable[None]]


def instrumented(
    servicer: object,
    descriptor: ServiceDescriptor,
    admission: Callable[[str], Admit | None],
    streams: OpenStreams,
) -> Any:
    """An object with the servicer's RPC methods, each wrapped once.

    `admission(full_method)` says what each call of a method must pass first (None: nothing).
    Server-streaming methods register with `streams`, which ends them when the server stops.
    """
    methods: dict[str, Any] = {}
    for method in descriptor.methods:
        inner = getattr(servicer, method.name)
        full_method = f"{descriptor.full_name}/{method.name}"
        admit = admission(full_method)
        if method.server_streaming:
            methods[method.name] = _stream(
                full_method, descriptor.full_name, method.name, inner, admit, streams=streams
            )
        else:
            methods[method.name] = _unary(full_method, descriptor.full_name, method.name, inner, admit)
    return types.SimpleNamespace(**methods)


async def _abort_for(method: str, context: ServicerContext, exc: Exception) -> None:
    """Fail the call with the status for `exc`; gRPC's own abort passes through."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    exc = typed_error(exc, method, log)
    store_errors.count(method, exc)
    status = to_grpc_status(exc)
    span = trace.get_current_span()
    span.set_attribute("rpc.grpc.status_code", status.code.value[0])
    span.set_status(Status(StatusCode.ERROR, exc.code.value))
    await context.abort(status.code, status.details, status.trailing_metadata)


def _span(full_method: str, service: str, name: str, context: ServicerContext) -> Any:
    if not telemetry.enabled():
        return telemetry.NO_SPAN
    return telemetry.TRACER.start_as_current_span(
        full_method,
        context=telemetry.extract_metadata(context.invocation_metadata()),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        record_exception=False,
        set_status_on_exception=False,
    )


async def until_token_expires(items: AsyncIterator[Any], expires_at: float | None) -> AsyncIterator[Any]:
    """`items` until the token that opened the stream expires; then UNAUTHENTICATED (reason expired).

    A stream must not outlive the token it was admitted with: the caller opens a
    new one with a fresh token (the SDKs do so ahead of expiry).
    """
    if expires_at is None:
        async for item in items:
            yield item
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (expires_at - time.time())
    async with contextlib.aclosing(_generator(items)) as generator:
        while True:
            # The scope says whether its own deadline fired: the loop's clock cannot, as uvloop's
            # (whole milliseconds, read once per turn) may still be short of it when it fires.
            expiry = asyncio.timeout_at(deadline)
            try:
                async with expiry:
                    item = await anext(generator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not expiry.expired():
                    raise  # the servicer's own timeout
                raise token_expired() from None
            yield item


async def _generator(items: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
    async for item in items:
        yield item


def _unary(
    full_method: str, service: str, name: str, inner: Callable[..., Awaitable[Any]], admit: Admit | None
) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: ServicerContext) -> Any:
        with _span(full_method, service, name, context) as span:
            try:
                if admit is not None:
                    await admit(request, context)
                response = await inner(request, context)
            except Exception as exc:
                await _abort_for(full_method, context, exc)
                return None
            span.set_attribute("rpc.grpc.status_code", 0)
            return response

    return unary


def _stream(
    full_method: str,
    service: str,
    name: str,
    inner: Callable[..., AsyncIterator[Any]],
    admit: Admit | None,
    *,
    streams: OpenStreams,
) -> Callable[..., AsyncIterator[Any]]:
    async def stream(request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        with _span(full_method, service, name, context):
            task = streams.opened()
            try:
                if streams.ending:
                    raise ToolmeshError(Code.SHUTTING_DOWN)
                if admit is not None:
                    await admit(request, context)
                async for item in until_token_expires(inner(request, context), grant_expires_at()):
                    yield item
            except asyncio.CancelledError:
                if not streams.ending:
                    raise  # the caller went away
                if task is not None:
                    task.uncancel()
                await _abort_for(full_method, context, ToolmeshError(Code.SHUTTING_DOWN))
            except Exception as exc:
                await _abort_for(full_method, context, exc)
            finally:
                streams.closed(task)

    return stream
