"""One DispatchToolRequests stream on the bridge: tool requests in, their outcomes out.

The invocation service keeps one such stream open instead of one call per tool
request, so a request the host is still working on costs the bridge a pending
entry and a timer, not a gRPC call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from toolmesh.bridge.cancels import HeldRequests
from toolmesh.bridge.outcomes import OutcomeRecorder
from toolmesh.bridge.router import Router
from toolmesh.core import correlation, telemetry
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE
from toolmesh.core.outbox import Outbox
from toolmesh.core.outcome import Outcome
from toolmesh.core.progress import ToolProgress
from toolmesh.core.wire import outcome_to_pb, progress_to_pb, request_from_pb
from toolmesh.v1 import bridge_pb2, tool_pb2

SPAN_NAME = "toolmesh.v1.BridgeService/DispatchToolRequests"
# Requests of one message started between two turns of the event loop.
START_AT_ONCE = 32
_SPAN_ATTRIBUTES = {
    "rpc.system": "grpc",
    "rpc.service": "toolmesh.v1.BridgeService",
    "rpc.method": "DispatchToolRequests",
}


class DispatchStream:
    """With `recorder` (a shared ledger), every outcome is also written there, and requests
    outlive the stream: its invocation replica may have died, and the call should still end
    and be recorded for an exact retry elsewhere. Without one, requests end with the stream.
    `holds`: where this replica lists the requests its streams hold, for cancellations that come
    through the store rather than on the stream (toolmesh.bridge.cancels)."""

    def __init__(
        self, router: Router, recorder: OutcomeRecorder | None = None, holds: HeldRequests | None = None
    ) -> None:
        self._router = router
        self._recorder = recorder
        self._holds = holds
        # Results (and progress reports) to send back, in the order requests ended (reports were
        # made); closed when the stream may end.
        self._results: Outbox[bridge_pb2.DispatchResult | tool_pb2.ToolProgress] = Outbox(
            _result_size,
            more_coming=lambda: bool(self._held),  # other requests' results (Outbox)
        )
        # Requests taken from this stream that have no outcome yet, with their spans.
        self._held: dict[str, Any] = {}
        self._reading = True

    async def read(self, messages: AsyncIterator[bridge_pb2.DispatchToolRequestsRequest]) -> None:
        """Take every message of the stream; when the caller stops sending, end once all are answered.

        Raises ToolmeshError(INVALID_REQUEST) for a message with too many
        requests and cancellations, and takes nothing after it. A message's
        requests start a few at a time, so that other work runs meanwhile.
        """
        try:
            async for message in messages:
                items = len(message.requests) + len(message.cancel_tool_request_ids)
                if items > MAX_CALLS_PER_MESSAGE:
                    raise ToolmeshError(
                        Code.INVALID_REQUEST,
                        f"At most {MAX_CALLS_PER_MESSAGE} requests and cancellations per message.",
                        {"limit": str(MAX_CALLS_PER_MESSAGE)},
                    )
                for index, request in enumerate(message.requests, 1):
                    self._start(request)
                    if index % START_AT_ONCE == 0:
                        await asyncio.sleep(0)
                for tool_request_id in message.cancel_tool_request_ids:
                    self._cancel(tool_request_id)
        finally:
            self._reading = False
            self._end_when_answered()

    async def responses(self) -> AsyncIterator[bridge_pb2.DispatchToolRequestsResponse]:
        """What to send: every result ready at once in one message, until the stream may end; first,
        with a start fence, a message saying so (starts_fenced)."""
        if self._router.fence is not None:
            yield bridge_pb2.DispatchToolRequestsResponse(starts_fenced=True)
        while taken := await self._results.take():
            response = bridge_pb2.DispatchToolRequestsResponse()
            for item in taken:
                if isinstance(item, bridge_pb2.DispatchResult):
                    response.results.append(item)
                else:
                    response.progress.append(item)
            yield response

    def close(self) -> None:
        """The stream ended: give up on every request it still holds, unless they are recorded."""
        if self._recorder is not None:
            return
        for tool_request_id in list(self._held):
            self._cancel(tool_request_id)

    def _start(self, message: bridge_pb2.ToolRequest) -> None:
        tool_request_id = message.tool_request_id
        if tool_request_id in self._held:
            self._refuse(tool_request_id, ToolmeshError(Code.REQUEST_DUPLICATE))
            return
        try:
            request = request_from_pb(message)
        except ToolmeshError as error:
            self._refuse(tool_request_id, error)
            return
        with (
            # Ended by the request's outcome or cancellation, not here.
            telemetry.span(
                SPAN_NAME,
                SpanKind.SERVER,
                request.trace_context,
                attributes=_SPAN_ATTRIBUTES,
                end_on_exit=False,
            ) as span,
            correlation.ids(
                session_id=request.session_id,
                turn_id=request.turn_id,
                tool_request_id=tool_request_id,
                tool_name=request.tool_name,
            ),
        ):
            self._held[tool_request_id] = span
            if self._holds is not None:
                self._holds.hold(tool_request_id, self._cancel)

            def settle(outcome: Outcome) -> None:
                self._release(tool_request_id)
                if self._recorder is not None and not _nothing_ran(outcome):
                    self._recorder.record(tool_request_id, outcome)
                if span.is_recording():
                    with trace.use_span(span, end_on_exit=True):
                        telemetry.record_outcome(outcome)
                self._results.put(
                    bridge_pb2.DispatchResult(tool_request_id=tool_request_id, outcome=outcome_to_pb(outcome))
                )
                self._end_when_answered()

            def progressed(progress: ToolProgress) -> None:
                self._results.put(progress_to_pb(progress))

            if telemetry.enabled():  # the host's span becomes a child of this one
                request = replace(request, trace_context=telemetry.inject())
            try:
                self._router.start(request, settle, progressed)
            except ToolmeshError as error:
                self._release(tool_request_id)
                span.end()
                self._refuse(tool_request_id, error)

    def _release(self, tool_request_id: str) -> Any:
        """Its span, no longer held (None when it was not)."""
        if self._holds is not None:
            self._holds.release(tool_request_id, self._cancel)
        return self._held.pop(tool_request_id, None)

    def _cancel(self, tool_request_id: str) -> None:
        span = self._release(tool_request_id)
        if span is not None:
            self._router.cancel(tool_request_id)
            span.set_attribute(telemetry.OUTCOME_CODE, "CANCELLED")
            span.end()
            self._end_when_answered()

    def _refuse(self, tool_request_id: str, error: ToolmeshError) -> None:
        refusal = bridge_pb2.DispatchRefusal(reason=error.code.value, message=error.message)
        self._results.put(bridge_pb2.DispatchResult(tool_request_id=tool_request_id, refusal=refusal))

    def _end_when_answered(self) -> None:
        if not self._reading and not self._held:
            self._results.close()


def _nothing_ran(outcome: Outcome) -> bool:
    """No host here (or the start fence refused its start here): so the invocation replica records
    it, and may send the request to another bridge replica that has one."""
    return outcome.failure is not None and outcome.failure.code == Code.TOOL_HOST_UNAVAILABLE


def _result_size(result: bridge_pb2.DispatchResult | tool_pb2.ToolProgress) -> int:
    return result.ByteSize()
