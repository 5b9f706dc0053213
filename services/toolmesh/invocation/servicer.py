"""InvocationService over gRPC: a thin adapter onto Invoker."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from toolmesh.core.calls import ToolCall
from toolmesh.core.wire import outcome_to_pb
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.ledger import InvocationRecord, InvocationState
from toolmesh.server.rpc_types import ServicerContext
from toolmesh.server.runtime import Service
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc

_STATES = {
    InvocationState.RUNNING: invocation_pb2.INVOCATION_STATE_RUNNING,
    InvocationState.COMPLETED: invocation_pb2.INVOCATION_STATE_COMPLETED,
    InvocationState.TIMED_OUT: invocation_pb2.INVOCATION_STATE_TIMED_OUT,
    InvocationState.FAILED: invocation_pb2.INVOCATION_STATE_FAILED,
}


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def record_to_pb(record: InvocationRecord) -> invocation_pb2.Invocation:
    message = invocation_pb2.Invocation(
        tool_request_id=record.tool_request_id,
        session_id=record.session_id,
        turn_id=record.turn_id,
        tool_name=record.tool_name,
        state=_STATES[record.state],
        delivered=record.delivered,
        created_at=_timestamp(record.created_at),
    )
    if record.outcome is not None:
        message.outcome.CopyFrom(outcome_to_pb(record.outcome))
    if record.finished_at is not None:
        message.finished_at.CopyFrom(_timestamp(record.finished_at))
    return message


class InvocationServicer(invocation_pb2_grpc.InvocationServiceServicer):
    def __init__(self, invoker: Invoker) -> None:
        self._invoker = invoker

    async def InvokeTool(
        self, request: invocation_pb2.InvokeToolRequest, context: ServicerContext
    ) -> invocation_pb2.InvokeToolResponse:
        call = ToolCall(
            session_id=request.session_id,
            turn_id=request.turn_id,
            tool_name=request.tool_name,
            arguments_json=request.arguments_json,
        )
        invocation = await self._invoker.invoke(
            call, request.idempotency_key, request.confirmed_tool_request_ids
        )
        return invocation_pb2.InvokeToolResponse(
            tool_request_id=invocation.tool_request_id,
            outcome=outcome_to_pb(invocation.outcome),
            joined=invocation.joined,
            replayed=invocation.replayed,
        )

    async def ConfirmDelivery(
        self, request: invocation_pb2.ConfirmDeliveryRequest, context: ServicerContext
    ) -> invocation_pb2.ConfirmDeliveryResponse:
        await self._invoker.confirm_delivery(request.tool_request_ids)
        return invocation_pb2.ConfirmDeliveryResponse()

    async def GetInvocation(
        self, request: invocation_pb2.GetInvocationRequest, context: ServicerContext
    ) -> invocation_pb2.GetInvocationResponse:
        record = await self._invoker.get_invocation(request.tool_request_id)
        return invocation_pb2.GetInvocationResponse(invocation=record_to_pb(record))


def invocation_service(invoker: Invoker) -> Service:
    servicer = InvocationServicer(invoker)
    return Service(
        descriptor=invocation_pb2.DESCRIPTOR.services_by_name["InvocationService"],
        servicer=servicer,
        add_to_server=invocation_pb2_grpc.add_InvocationServiceServicer_to_server,
        on_shutdown=invoker.drain,
    )
