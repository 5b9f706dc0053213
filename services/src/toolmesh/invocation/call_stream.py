"""The service's end of one InvokeTools stream: calls in, each result out as soon as it ends.

A call on the stream costs this service a task and the invocation's own state,
not a gRPC call held for as long as the tool runs. The caller's end is
toolmesh.client.call_link.

What one stream may cost is bounded (toolmesh.core.limits): at most
MAX_CALLS_PER_MESSAGE calls per message, started a few at a time so that
other callers' calls run meanwhile; and results its caller has not read yet:
above UNREAD_RESULTS_PAUSE_BYTES no more calls are taken from the stream,
above UNREAD_RESULTS_MAX_BYTES they are dropped and the stream ends with
RESULTS_NOT_READ (the ledger keeps them for an exact retry to replay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Container

from opentelemetry.trace import SpanKind, Status, StatusCode

from toolmesh.core import telemetry
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.exceptions import exception_fields
from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE, UNREAD_RESULTS_MAX_BYTES, UNREAD_RESULTS_PAUSE_BYTES
from toolmesh.core.outbox import Outbox
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.messages import call_from_pb, deliveries_from_pb, response_to_pb
from toolmesh.v1 import invocation_pb2

log = logging.getLogger("toolmesh.invocation")

SPAN_NAME = "toolmesh.v1.InvocationService/InvokeTools"
# Calls of one message started between two turns of the event loop.
START_AT_ONCE = 32


class CallStream:
    def __init__(
        self,
        invoker: Invoker,
        sessions: Container[str] | None = None,
        *,
        caller: str | None = None,
        pause_bytes: int = UNREAD_RESULTS_PAUSE_BYTES,
        max_bytes: int = UNREAD_RESULTS_MAX_BYTES,
    ) -> None:
        self._invoker = invoker
        # The sessions the caller may call (None: all); a call for another is refused alone.
        self._sessions = sessions
        # Who calls (a token's subject), for the rate per caller.
        self._caller = caller
        # Each result, and whether it refuses a duplicate call id (sent apart: see the proto).
        self._results: Outbox[tuple[invocation_pb2.StreamedToolResult, bool]] = Outbox(
            _result_size,
            more_coming=lambda: bool(self._open),  # other calls' results (Outbox)
        )
        self._pause_bytes = pause_bytes
        self._max_bytes = max_bytes
        # Set while the results waiting to be sent are few enough to take more calls.
        self._room = asyncio.Event()
        self._room.set()
        # Why the stream ends before its caller is done with it (its results went unread).
        self._failure: ToolmeshError | None = None
        # Calls taken from this stream that have no result yet.
        self._open: dict[int, asyncio.Task[None]] = {}
        self._reading = True
        self._closed = False

    async def read(self, messages: AsyncIterator[invocation_pb2.InvokeToolsRequest]) -> None:
        """Take every call of the stream; when the caller stops sending, end once all are answered.

        Raises ToolmeshError(INVALID_REQUEST) for a message with too many calls,
        and takes nothing after it.
        """
        try:
            async for message in messages:
                calls = message.calls
                if len(calls) > MAX_CALLS_PER_MESSAGE:
                    raise ToolmeshError(
                        Code.INVALID_REQUEST,
                        f"At most {MAX_CALLS_PER_MESSAGE} calls per message.",
                        {"limit": str(MAX_CALLS_PER_MESSAGE)},
                    )
                for index, call in enumerate(calls, 1):
                    self._start(call)
                    if index % START_AT_ONCE == 0:
                        await asyncio.sleep(0)  # other callers' work runs between these
                # The calls just started take their first steps (those that end at once
                # put their results out) before the next message is considered.
                await asyncio.sleep(0)
                await self._room.wait()
                if self._failure is not None:
                    return
        finally:
            self._reading = False
            self._end_when_answered()

    async def responses(self) -> AsyncIterator[invocation_pb2.InvokeToolsResponse]:
        """What to send: every result ready at once in one message, until the stream may end.

        Raises ToolmeshError(RESULTS_NOT_READ) when results were dropped unread.
        """
        while ready := await self._results.take():
            if self._results.bytes <= self._pause_bytes:
                self._room.set()
            yield invocation_pb2.InvokeToolsResponse(
                results=[result for result, duplicate in ready if not duplicate],
                refused_duplicates=[result for result, duplicate in ready if duplicate],
            )
        if self._failure is not None:
            raise self._failure

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
                        deliveries_from_pb(request.confirmed_tool_request_ids, request.confirmed_attachments),
                        leaves_early=False,
                        sessions=self._sessions,
                        caller=self._caller,
                    )
                except ToolmeshError as error:
                    span.set_status(Status(StatusCode.ERROR, error.code.value))
                    self._send(_error_result(call.call_id, error))
                    return
                except Exception as exc:
                    # The exception text may quote request data: log only its type.
                    log.error(
                        "unexpected error",
                        extra={"method": SPAN_NAME, "code": Code.INTERNAL.value} | exception_fields(exc),
                    )
                    self._send(_error_result(call.call_id, ToolmeshError(Code.INTERNAL)))
                    return
                response = response_to_pb(result)
                self._send(invocation_pb2.StreamedToolResult(call_id=call.call_id, response=response))
        finally:
            self._open.pop(call.call_id, None)
            self._end_when_answered()

    def _send(self, result: invocation_pb2.StreamedToolResult, *, duplicate: bool = False) -> None:
        if self._closed or self._failure is not None:
            return
        self._results.put((result, duplicate))
        unread = self._results.bytes
        if unread > self._max_bytes:
            # Calls taken earlier kept ending: their outcomes stay in the ledger, not here.
            log.warning("stream results not read; dropped", extra={"unread_bytes": unread})
            self._failure = ToolmeshError(Code.RESULTS_NOT_READ, "", {"unread_bytes": str(unread)})
            self._results.clear()
            self._room.set()  # the reader sees the failure and stops
            self._results.close()
        elif unread > self._pause_bytes:
            self._room.clear()

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
