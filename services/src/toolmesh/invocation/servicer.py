"""InvocationService over gRPC: a thin adapter onto Invoker."""

from __future__ import annotations

from collections.abc import AsyncIterator

from toolmesh.auth.grants import Role
from toolmesh.auth.guard import scope
from toolmesh.invocation.call_stream import CallStream
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.messages import call_from_pb, record_to_pb, response_to_pb
from toolmesh.server.relay import relay
from toolmesh.server.rpc_types import ServicerContext
from toolmesh.server.runtime import Service
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc


class InvocationServicer(invocation_pb2_grpc.InvocationServiceServicer):
    def __init__(self, invoker: Invoker) -> None:
        self._invoker = invoker

    async def InvokeTool(
        self, request: invocation_pb2.InvokeToolRequest, context: ServicerContext
    ) -> invocation_pb2.InvokeToolResponse:
        result = await self._invoker.invoke(
            call_from_pb(request),
            request.idempotency_key,
            request.confirmed_tool_request_ids,
            sessions=scope(Role.CALL),
        )
        return response_to_pb(result)

    async def InvokeTools(
        self, request_iterator: AsyncIterator[invocation_pb2.InvokeToolsRequest], context: ServicerContext
    ) -> AsyncIterator[invocation_pb2.InvokeToolsResponse]:
        async for response in relay(CallStream(self._invoker, scope(Role.CALL)), request_iterator):
            yield response

    async def ConfirmDelivery(
        self, request: invocation_pb2.ConfirmDeliveryRequest, context: ServicerContext
    ) -> invocation_pb2.ConfirmDeliveryResponse:
        await self._invoker.confirm_delivery(request.tool_request_ids, scope(Role.CALL))
        return invocation_pb2.ConfirmDeliveryResponse()

    async def GetInvocation(
        self, request: invocation_pb2.GetInvocationRequest, context: ServicerContext
    ) -> invocation_pb2.GetInvocationResponse:
        record = await self._invoker.get_invocation(request.tool_request_id, scope(Role.CALL))
        return invocation_pb2.GetInvocationResponse(invocation=record_to_pb(record))


def invocation_service(invoker: Invoker) -> Service:
    servicer = InvocationServicer(invoker)
    return Service(
        descriptor=invocation_pb2.DESCRIPTOR.services_by_name["InvocationService"],
        servicer=servicer,
        add_to_server=invocation_pb2_grpc.add_InvocationServiceServicer_to_server,
        on_shutdown=invoker.drain,
    )
