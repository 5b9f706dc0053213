"""The service's end of one InvokeTools stream: calls in, each result out as soon as it ends.

A call on the stream costs this service a task and the invocation's own state,
not a gRPC call held for as long as the tool runs. The caller's end is
toolmesh.client.call_link.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Container

from opentelemetry.trace import SpanKind, Status, StatusCode

from toolmesh.core import telemetry
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outbox import Outbox
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.messages import call_from_pb, response_to_pb
from toolmesh.v1 import invocation_pb2

log = logging.getLogger("toolmesh.invocation")

SPAN_NAME = "toolmesh.v1.InvocationService/InvokeTools"


class CallStream:
    def __init__(self, invoker: Invoker, sessions: Container[str] | None = None) -> None:
        self._invoker = invoker
        # The sessions the caller may call (None: all); a call for another is refused alone.
        self._sessions = sessions
        # Each result, and whether it refuses a duplicate call id (sent apart: see the proto).
        self._results: Outbox[tuple[invocation_pb2.StreamedToolResult, bool]] = Outbox(_result_size)
        # Calls taken from this stream that have no result yet.
        self._open: dict[int, asyncio.Task[None]] = {}
        self._reading = True
        self._closed = False

    async def read(self, messages: AsyncIterator[invocation_pb2.InvokeToolsRequest]) -> None:
        """Take every call of the stream; when the caller stops sending, end once all are answered."""
        try:
            async for message in messages:
                for call in message.calls:
                    self._start(call)
        finally:
            self._reading = False
            self._end_when_answered()

    async def responses(self) -> AsyncIterator[invocation_pb2.InvokeToolsResponse]:
        """What to send: every result ready at once in one message, until the stream may end."""
        while ready := await self._results.take():
            yield invocation_pb2.InvokeToolsResponse(
                results=[result for result, duplicate in ready if not duplicate],
                refused_duplicates=[result for result, duplicate in ready if duplicate],
            )

    def close(self) -> None:
        """The stream ended: its calls go on to their outcomes (a retry joins them), sent nowhere."""
        self._closed = True

    def _start(self, call: invocation_pb2.StreamedToolCall) -> None:
        call_id = call.call_id
        if call_id in self._open:
            duplicate = ToolmeshError(
                Code.INVALID_REQUEST, "The call id is already open.", {"callId": str(call_id)}
            )
            self._send(_error_result(call_id, duplicate), duplicate=True)
            return
        self._open[call_id] = asyncio.create_task(self._run(call))

    async def _run(self, call: invocation_pb2.StreamedToolCall) -> None:
        request = call.request
        try:
            with telemetry.span(SPAN_NAME, SpanKind.SERVER, call.trace_context) as span:
                try:
                    # This task waits for the outcome whatever the caller does: no task of its own needed.
                    result = await self._invoker.invoke(
                        call_from_pb(request),
                        request.idempotency_key,
                        request.confirmed_tool_request_ids,
                        leaves_early=False,
                        sessions=self._sessions,
                    )
                except ToolmeshError as error:
                    span.set_status(Status(StatusCode.ERROR, error.code.value))
                    self._send(_error_result(call.call_id, error))
                    return
                except Exception as exc:
                    # The exception text may quote request data: log only its type.
                    log.error("unexpected error in %s: %s", SPAN_NAME, type(exc).__name__, exc_info=exc)
                    self._send(_error_result(call.call_id, ToolmeshError(Code.INTERNAL)))
                    return
                response = response_to_pb(result)
                self._send(invocation_pb2.StreamedToolResult(call_id=call.call_id, response=response))
        finally:
            self._open.pop(call.call_id, None)
            self._end_when_answered()

    def _send(self, result: invocation_pb2.StreamedToolResult, *, duplicate: bool = False) -> None:
        if not self._closed:
            self._results.put((result, duplicate))

    def _end_when_answered(self) -> None:
        if not self._reading and not self._open and not self._closed:
            self._results.close()


def _error_result(call_id: int, error: ToolmeshError) -> invocation_pb2.StreamedToolResult:
    failure = invocation_pb2.CallError(
        reason=error.code.value, message=error.message, metadata=error.metadata
    )
    return invocation_pb2.StreamedToolResult(call_id=call_id, error=failure)


def _result_size(item: tuple[invocation_pb2.StreamedToolResult, bool]) -> int:
    return item[0].ByteSize()
