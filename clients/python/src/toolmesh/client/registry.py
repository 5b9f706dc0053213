"""Reading and replacing a session's tools."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

import grpc

from toolmesh.core import telemetry
from toolmesh.core.bearer import Bearer, TokenSource
from toolmesh.core.channels import open_channel
from toolmesh.core.rpcstatus import token_expired
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.core.wire import tool_from_pb, tool_to_pb
from toolmesh.v1 import registry_pb2, registry_pb2_grpc


class RegistryClient:
    """Reads and replaces a session's tool definitions in the registry service.

    For applications that publish their tools and for callers that list them.
    Errors are raised as grpc.aio.AioRpcError, whose ErrorInfo reason is a code
    of the error table (read it with toolmesh.core.rpcstatus.error_code).

    Args:
        target: The registry service's address, `host:port`.
        channel: A channel to use instead of opening one (the client then does not close it).
        credentials: TLS for a channel it opens (toolmesh.core.tls.client_credentials).
        token: The caller's token: text, or a callback (sync or async) asked before each call.
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
        """Replace the session's whole tool list with `tools`; returns the new revision.

        With `expected_revision`, the list is replaced only if the session is
        still at that revision. The whole list is refused if any tool is.
        Raises grpc.aio.AioRpcError: INVALID_ARGUMENT with INVALID_REQUEST (a bad
        session id, a bad or repeated tool name, too many tools) or INVALID_SCHEMA
        (a schema that is not an object or of an unsupported dialect, a timeout
        out of range); ABORTED with REVISION_CONFLICT when the revision moved;
        or the transport's status.
        """
        request = registry_pb2.PutToolsRequest(session_id=session_id, tools=[tool_to_pb(t) for t in tools])
        if expected_revision is not None:
            request.expected_revision = expected_revision
        with telemetry.client_call("toolmesh.v1.RegistryService/PutTools") as metadata:
            response: registry_pb2.PutToolsResponse = await self._stub.PutTools(
                request, timeout=10.0, metadata=await self._bearer.metadata(metadata)
            )
        return response.revision

    async def list_tools(self, session_id: str) -> ToolSet:
        """The session's tools and their revision (revision 0 and no tools for an unknown session).

        Raises grpc.aio.AioRpcError: INVALID_ARGUMENT (INVALID_REQUEST) for a bad
        session id, or the transport's status.
        """
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
        the stream fails (the gRPC error is raised). A stream ended because its
        token expired is opened again with the current token (the callback's),
        without repeating a revision already given.
        """
        last: int | None = None
        while True:
            call = self._stub.WatchTools(
                registry_pb2.WatchToolsRequest(session_id=session_id), metadata=await self._bearer.metadata()
            )
            received = False
            try:
                async for response in call:
                    received = True
                    tools = _tool_set(response)
                    if tools.revision != last:
                        last = tools.revision
                        yield tools
                return
            except grpc.aio.AioRpcError as error:
                if not (received and token_expired(error)):
                    raise
            finally:
                call.cancel()

    async def close(self) -> None:
        """Close the channel, if this client opened it."""
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _tool_set(response: registry_pb2.ListToolsResponse | registry_pb2.WatchToolsResponse) -> ToolSet:
    return ToolSet(response.revision, tuple(tool_from_pb(t) for t in response.tools))
