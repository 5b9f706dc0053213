"""RegistryService over gRPC: a thin adapter onto Registry."""

from __future__ import annotations

from collections.abc import AsyncIterator

from toolmesh.auth.guard import caller
from toolmesh.core.wire import tool_from_pb, tool_to_pb
from toolmesh.registry.registry import Registry
from toolmesh.runtime.rpc_types import ServicerContext
from toolmesh.runtime.server import Service
from toolmesh.v1 import registry_pb2, registry_pb2_grpc


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def PutTools(
        self, request: registry_pb2.PutToolsRequest, context: ServicerContext
    ) -> registry_pb2.PutToolsResponse:
        expected = request.expected_revision if request.HasField("expected_revision") else None
        revision = await self._registry.put_tools(
            request.session_id, [tool_from_pb(tool) for tool in request.tools], expected, grant=caller()
        )
        return registry_pb2.PutToolsResponse(revision=revision)

    async def ListTools(
        self, request: registry_pb2.ListToolsRequest, context: ServicerContext
    ) -> registry_pb2.ListToolsResponse:
        tools = await self._registry.list_tools(request.session_id)
        return registry_pb2.ListToolsResponse(
            revision=tools.revision, tools=[tool_to_pb(t) for t in tools.tools]
        )

    async def GetTool(
        self, request: registry_pb2.GetToolRequest, context: ServicerContext
    ) -> registry_pb2.GetToolResponse:
        revision, tool = await self._registry.get_tool(request.session_id, request.name)
        return registry_pb2.GetToolResponse(revision=revision, tool=tool_to_pb(tool))

    async def WatchTools(
        self, request: registry_pb2.WatchToolsRequest, context: ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchToolsResponse]:
        async for tools in self._registry.watch(request.session_id, caller()):
            yield registry_pb2.WatchToolsResponse(
                revision=tools.revision, tools=[tool_to_pb(t) for t in tools.tools]
            )


def registry_service(registry: Registry) -> Service:
    servicer = RegistryServicer(registry)
    return Service(
        descriptor=registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        servicer=servicer,
        add_to_server=registry_pb2_grpc.add_RegistryServiceServicer_to_server,
    )
