"""Reading and replacing a session's tools."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

import grpc

from toolmesh.core import telemetry
from toolmesh.core.bearer import Bearer, TokenSource
from toolmesh.core.channels import open_channel
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.core.wire import tool_from_pb, tool_to_pb
from toolmesh.v1 import registry_pb2, registry_pb2_grpc


class RegistryClient:
    """Reads, watches and replaces sessions' tools.

    `credentials`: TLS (toolmesh.core.tls.client_credentials); `token`: the
    caller's token, as text or a callback asked before each call (refresh).
    """

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.aio.Channel | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        token: TokenSource | None = None,
    ) -> None:
        self._own_channel = channel is None
        self._channel = channel or open_channel(target, credentials)
        self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)
        self._bearer = Bearer(token)

    async def put_tools(
        self, session_id: str, tools: Sequence[ToolSpec], *, expected_revision: int | None = None
    ) -> int:
        request = registry_pb2.PutToolsRequest(session_id=session_id, tools=[tool_to_pb(t) for t in tools])
        if expected_revision is not None:
            request.expected_revision = expected_revision
        with telemetry.client_call("toolmesh.v1.RegistryService/PutTools") as metadata:
            response: registry_pb2.PutToolsResponse = await self._stub.PutTools(
                request, timeout=10.0, metadata=await self._bearer.metadata(metadata)
            )
        return response.revision

    async def list_tools(self, session_id: str) -> ToolSet:
        with telemetry.client_call("toolmesh.v1.RegistryService/ListTools") as metadata:
            response = await self._stub.ListTools(
                registry_pb2.ListToolsRequest(session_id=session_id),
                timeout=10.0,
                metadata=await self._bearer.metadata(metadata),
            )
        return _tool_set(response)

    async def watch_tools(self, session_id: str) -> AsyncGenerator[ToolSet, None]:
        """The current tools, then the tools again each time the revision moves.

        Runs until the caller stops iterating (the stream is then cancelled) or
        the stream fails (the gRPC error is raised).
        """
        call = self._stub.WatchTools(
            registry_pb2.WatchToolsRequest(session_id=session_id), metadata=await self._bearer.metadata()
        )
        try:
            async for response in call:
                yield _tool_set(response)
        finally:
            call.cancel()

    async def close(self) -> None:
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _tool_set(response: registry_pb2.ListToolsResponse | registry_pb2.WatchToolsResponse) -> ToolSet:
    return ToolSet(response.revision, tuple(tool_from_pb(t) for t in response.tools))
