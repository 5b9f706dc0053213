"""InvocationService over gRPC: a thin adapter onto Invoker."""

from __future__ import annotations

from toolmesh.core.calls import ToolCall
from toolmesh.core.wire import outcome_to_pb
from toolmesh.invocation.invoker import Invoker
from toolmesh.server.rpc_types import ServicerContext
from toolmesh.server.runtime import Service
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc


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
        invocation = await self._invoker.invoke(call)
        return invocation_pb2.InvokeToolResponse(
            tool_request_id=invocation.tool_request_id, outcome=outcome_to_pb(invocation.outcome)
        )


def invocation_service(invoker: Invoker) -> Service:
    servicer = InvocationServicer(invoker)
    return Service(
        full_name=invocation_pb2.DESCRIPTOR.services_by_name["InvocationService"].full_name,
        register=lambda server: invocation_pb2_grpc.add_InvocationServiceServicer_to_server(servicer, server),
        on_shutdown=invoker.drain,
    )
