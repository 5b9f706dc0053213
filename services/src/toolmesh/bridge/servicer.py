"""BridgeService over gRPC: a thin adapter onto Router."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from toolmesh.auth.grants import Role
from toolmesh.auth.guard import scope
from toolmesh.bridge.dispatch_stream import DispatchStream
from toolmesh.bridge.router import Cancellation, EndReason, Heartbeat, Router
from toolmesh.core import telemetry
from toolmesh.core.wire import outcome_from_pb, outcome_to_pb, request_from_pb, request_to_pb
from toolmesh.server.relay import relay
from toolmesh.server.rpc_types import ServicerContext
from toolmesh.server.runtime import Service
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc

_CANCEL_REASONS = {
    EndReason.TIMED_OUT: bridge_pb2.CANCEL_REASON_TIMEOUT,
    EndReason.CANCELLED: bridge_pb2.CANCEL_REASON_CANCELLED,
}


class BridgeServicer(bridge_pb2_grpc.BridgeServiceServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def OpenHostSession(
        self, request: bridge_pb2.OpenHostSessionRequest, context: ServicerContext
    ) -> AsyncIterator[bridge_pb2.OpenHostSessionResponse]:
        router = self._router
        host = router.open_host(
            request.session_id, request.host_name, request.handler_names, request.has_generic_handler
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
                if isinstance(event, Heartbeat):
                    yield bridge_pb2.OpenHostSessionResponse(heartbeat=bridge_pb2.Heartbeat())
                elif isinstance(event, Cancellation):
                    yield bridge_pb2.OpenHostSessionResponse(
                        cancelled=bridge_pb2.ToolRequestCancelled(
                            tool_request_id=event.tool_request_id, reason=_CANCEL_REASONS[event.reason]
                        )
                    )
                else:
                    yield bridge_pb2.OpenHostSessionResponse(tool_request=request_to_pb(event))
        finally:
            router.close_host(host)

    async def SubmitToolResult(
        self, request: bridge_pb2.SubmitToolResultRequest, context: ServicerContext
    ) -> bridge_pb2.SubmitToolResultResponse:
        outcome = outcome_from_pb(request.outcome)
        telemetry.record_outcome(outcome)
        self._router.submit(request.host_session_id, request.tool_request_id, outcome, scope(Role.HOST))
        return bridge_pb2.SubmitToolResultResponse()

    async def DispatchToolRequest(
        self, request: bridge_pb2.DispatchToolRequestRequest, context: ServicerContext
    ) -> bridge_pb2.DispatchToolRequestResponse:
        tool_request = request_from_pb(request.request)
        with telemetry.correlation(
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
        async for response in relay(DispatchStream(self._router), request_iterator):
            yield response


def bridge_service(router: Router) -> Service:
    servicer = BridgeServicer(router)

    async def on_shutdown() -> None:
        router.shutdown()

    return Service(
        descriptor=bridge_pb2.DESCRIPTOR.services_by_name["BridgeService"],
        servicer=servicer,
        add_to_server=bridge_pb2_grpc.add_BridgeServiceServicer_to_server,
        on_shutdown=on_shutdown,
    )
