"""BridgeService over gRPC: a thin adapter onto Router and Declarations.

The host-facing methods (`host_events`, `submit`, `declare`, `answer_read_check`) are shared with the
web port (toolmesh.bridge.web), which serves them over Connect and gRPC-Web.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Container
from dataclasses import replace

from toolmesh.auth.grants import Role
from toolmesh.auth.guard import caller, scope
from toolmesh.bridge.cancels import HeldRequests
from toolmesh.bridge.declarations import Declarations
from toolmesh.bridge.dispatch_stream import DispatchStream
from toolmesh.bridge.outcomes import OutcomeRecorder, accept
from toolmesh.bridge.router import EndReason, Heartbeat, Router, ToolRequestCancelled
from toolmesh.core import correlation, telemetry
from toolmesh.core.progress import ProgressVerdict, ToolProgress
from toolmesh.core.wire import outcome_from_pb, outcome_to_pb, request_from_pb, request_to_pb, tool_from_pb
from toolmesh.runtime.relay import relay
from toolmesh.runtime.rpc_types import ServicerContext
from toolmesh.runtime.server import Service
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc

_PROGRESS_STATUS = {
    ProgressVerdict.ACCEPTED: bridge_pb2.PROGRESS_REPORT_STATUS_ACCEPTED,
    ProgressVerdict.INVALID: bridge_pb2.PROGRESS_REPORT_STATUS_INVALID,
    ProgressVerdict.REQUEST_UNKNOWN: bridge_pb2.PROGRESS_REPORT_STATUS_REQUEST_UNKNOWN,
    ProgressVerdict.REQUEST_ENDED: bridge_pb2.PROGRESS_REPORT_STATUS_REQUEST_ENDED,
}
_CANCEL_REASONS = {
    EndReason.TIMED_OUT: bridge_pb2.CANCEL_REASON_TIMEOUT,
    EndReason.CANCELLED: bridge_pb2.CANCEL_REASON_CANCELLED,
}


async def host_events(
    router: Router, request: bridge_pb2.OpenHostSessionRequest
) -> AsyncIterator[bridge_pb2.OpenHostSessionResponse]:
    """A host session's stream: opened, then requests, cancellations and heartbeats until it ends."""
    host = router.open_host(
        request.session_id,
        request.host_name,
        request.handler_names,
        request.has_generic_handler,
        request.replaces_host_session_id,
        grant=caller(),
    )
    try:
        yield bridge_pb2.OpenHostSessionResponse(
            opened=bridge_pb2.HostSessionOpened(
                host_session_id=host.host_session_id,
                heartbeat_interval_ms=round(router.heartbeat_s * 1000),
            )
        )
        while True:
            event = await host.next_event()
            if event is None:
                return  # another host session of the host took over, and this one answered all it held
            if isinstance(event, Heartbeat):
                heartbeat = bridge_pb2.Heartbeat(read_check=event.read_check)
                yield bridge_pb2.OpenHostSessionResponse(heartbeat=heartbeat)
            elif isinstance(event, ToolRequestCancelled):
                yield bridge_pb2.OpenHostSessionResponse(
                    cancelled=bridge_pb2.ToolRequestCancelled(
                        tool_request_id=event.tool_request_id, reason=_CANCEL_REASONS[event.reason]
                    )
                )
            else:
                yield bridge_pb2.OpenHostSessionResponse(tool_request=request_to_pb(event))
    finally:
        router.close_host(host)


async def submit(
    router: Router,
    recorder: OutcomeRecorder | None,
    request: bridge_pb2.SubmitToolResultRequest,
    sessions: Container[str] | None,
) -> bridge_pb2.SubmitToolResultResponse:
    """A host's outcome, decoded once and taken by `outcomes.accept` (adopted through `recorder`
    when another replica sent the request). `sessions`: those the host may serve (None: all);
    another's host session is unknown to it."""
    outcome = outcome_from_pb(request.outcome)
    telemetry.record_outcome(outcome)
    await accept(
        router, recorder, request.host_session_id, request.tool_request_id, outcome, sessions=sessions
    )
    return bridge_pb2.SubmitToolResultResponse()


def answer_read_check(
    router: Router, request: bridge_pb2.AnswerReadCheckRequest, sessions: Container[str] | None
) -> bridge_pb2.AnswerReadCheckResponse:
    """`sessions`: as for `submit`."""
    router.answer_read_check(request.host_session_id, request.read_check, sessions)
    return bridge_pb2.AnswerReadCheckResponse()


def report_progress(
    router: Router, request: bridge_pb2.ReportToolProgressRequest, sessions: Container[str] | None
) -> bridge_pb2.ReportToolProgressResponse:
    """`sessions`: as for `submit`."""
    progress = ToolProgress(
        tool_request_id=request.tool_request_id,
        progress=request.progress,
        total=request.total if request.HasField("total") else None,
        message=request.message or None,
    )
    verdict, truncated = router.report_progress(request.host_session_id, progress, sessions)
    return bridge_pb2.ReportToolProgressResponse(
        status=_PROGRESS_STATUS[verdict], message_truncated=truncated
    )


async def declare(
    declarations: Declarations, request: bridge_pb2.DeclareHostToolsRequest, sessions: Container[str] | None
) -> bridge_pb2.DeclareHostToolsResponse:
    """`sessions`: as for `submit`."""
    tools = [tool_from_pb(tool) for tool in request.tools]
    revision = await declarations.declare(request.host_session_id, tools, sessions)
    return bridge_pb2.DeclareHostToolsResponse(revision=revision)


class BridgeServicer(bridge_pb2_grpc.BridgeServiceServicer):
    def __init__(
        self,
        router: Router,
        declarations: Declarations,
        recorder: OutcomeRecorder | None = None,
        holds: HeldRequests | None = None,
    ) -> None:
        self._router = router
        self._declarations = declarations
        self._recorder = recorder
        self._holds = holds

    async def OpenHostSession(
        self, request: bridge_pb2.OpenHostSessionRequest, context: ServicerContext
    ) -> AsyncIterator[bridge_pb2.OpenHostSessionResponse]:
        async for event in host_events(self._router, request):
            yield event

    async def SubmitToolResult(
        self, request: bridge_pb2.SubmitToolResultRequest, context: ServicerContext
    ) -> bridge_pb2.SubmitToolResultResponse:
        return await submit(self._router, self._recorder, request, scope(Role.HOST))

    async def DeclareHostTools(
        self, request: bridge_pb2.DeclareHostToolsRequest, context: ServicerContext
    ) -> bridge_pb2.DeclareHostToolsResponse:
        return await declare(self._declarations, request, scope(Role.HOST))

    async def AnswerReadCheck(
        self, request: bridge_pb2.AnswerReadCheckRequest, context: ServicerContext
    ) -> bridge_pb2.AnswerReadCheckResponse:
        return answer_read_check(self._router, request, scope(Role.HOST))

    async def ReportToolProgress(
        self, request: bridge_pb2.ReportToolProgressRequest, context: ServicerContext
    ) -> bridge_pb2.ReportToolProgressResponse:
        return report_progress(self._router, request, scope(Role.HOST))

    async def DispatchToolRequest(
        self, request: bridge_pb2.DispatchToolRequestRequest, context: ServicerContext
    ) -> bridge_pb2.DispatchToolRequestResponse:
        tool_request = request_from_pb(request.request)
        with correlation.ids(
            session_id=tool_request.session_id,
            turn_id=tool_request.turn_id,
            tool_request_id=tool_request.tool_request_id,
            tool_name=tool_request.tool_name,
        ):
            # The host's span becomes a child of this one: the stream carries no
            # metadata, so the context travels inside the request.
            outcome = await self._router.dispatch(replace(tool_request, trace_context=telemetry.inject()))
            telemetry.record_outcome(outcome)
        return bridge_pb2.DispatchToolRequestResponse(outcome=outcome_to_pb(outcome))

    async def DispatchToolRequests(
        self,
        request_iterator: AsyncIterator[bridge_pb2.DispatchToolRequestsRequest],
        context: ServicerContext,
    ) -> AsyncIterator[bridge_pb2.DispatchToolRequestsResponse]:
        async for response in relay(
            DispatchStream(self._router, self._recorder, self._holds), request_iterator
        ):
            yield response


def bridge_service(
    router: Router,
    declarations: Declarations,
    recorder: OutcomeRecorder | None = None,
    holds: HeldRequests | None = None,
) -> Service:
    """`recorder`: the shared ledger outcomes are recorded in too (None: only sent back); `holds`:
    the held requests that cancellations posted in the store stop (toolmesh.bridge.cancels)."""
    servicer = BridgeServicer(router, declarations, recorder, holds)

    async def on_shutdown() -> None:
        router.shutdown()
        await declarations.aclose()

    return Service(
        descriptor=bridge_pb2.DESCRIPTOR.services_by_name["BridgeService"],
        servicer=servicer,
        add_to_server=bridge_pb2_grpc.add_BridgeServiceServicer_to_server,
        on_shutdown=on_shutdown,
    )
