"""The invoker's ports over gRPC: the registry and the bridge as remote services."""

from __future__ import annotations

import grpc

from toolmesh.core import telemetry
from toolmesh.core.calls import ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.core.wire import outcome_from_pb, request_to_pb, tool_from_pb
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, registry_pb2, registry_pb2_grpc

# How long a registry lookup may take before the call fails as REGISTRY_UNAVAILABLE.
REGISTRY_TIMEOUT_S = 5.0
# The bridge enforces the tool's deadline itself; this margin only catches a
# bridge that stopped answering.
BRIDGE_GRACE_S = 2.0


class RemoteCatalog:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = registry_pb2_grpc.RegistryServiceStub(channel)

    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        try:
            with telemetry.client_call("toolmesh.v1.RegistryService/GetTool") as metadata:
                response = await self._stub.GetTool(
                    registry_pb2.GetToolRequest(session_id=session_id, name=name),
                    timeout=REGISTRY_TIMEOUT_S,
                    metadata=metadata,
                )
        except grpc.aio.AioRpcError as error:
            if error_code(error) is Code.TOOL_NOT_FOUND:
                return None
            raise ToolmeshError(Code.REGISTRY_UNAVAILABLE, "", {"grpc_status": error.code().name}) from None
        return tool_from_pb(response.tool)


class RemoteDispatcher:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = bridge_pb2_grpc.BridgeServiceStub(channel)

    async def dispatch(self, request: ToolRequest) -> Outcome:
        message = bridge_pb2.DispatchToolRequestRequest(request=request_to_pb(request))
        try:
            with telemetry.client_call("toolmesh.v1.BridgeService/DispatchToolRequest") as metadata:
                response = await self._stub.DispatchToolRequest(
                    message, timeout=request.timeout_ms / 1000 + BRIDGE_GRACE_S, metadata=metadata
                )
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                return Outcome.runtime_error(
                    Code.TOOL_TIMEOUT,
                    f"No result within {request.timeout_ms} ms.",
                    {"timeoutMs": request.timeout_ms},
                )
            raise ToolmeshError(Code.BRIDGE_UNAVAILABLE, "", {"grpc_status": error.code().name}) from None
        return outcome_from_pb(response.outcome)
