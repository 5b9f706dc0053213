"""The registry's session lists over gRPC, for the bridge's declared tools (declarations.ToolLists)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from toolmesh.client.registry import RegistryClient
from toolmesh.core.channels import open_channel
from toolmesh.core.errors import ERROR_TABLE, Code, ToolmeshError
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.runtime.peers import Connect

# What the registry may refuse a put for; anything else means it did not answer.
_REFUSALS = {Code.REVISION_CONFLICT, Code.INVALID_SCHEMA, Code.INVALID_REQUEST}


class RegistryToolLists:
    """`target`: the registry's internal listener; `connect` opens the bridge's channel to it (its
    mutual TLS and service token, if any; default plaintext)."""

    def __init__(self, target: str, connect: Connect = open_channel) -> None:
        self._channel = connect(target)
        self._client = RegistryClient(target, channel=self._channel)

    async def get(self, session_id: str) -> ToolSet:
        try:
            return await self._client.list_tools(session_id)
        except grpc.aio.AioRpcError as error:
            raise _translated(error) from None

    async def put(self, session_id: str, tools: Sequence[ToolSpec], expected_revision: int) -> int:
        try:
            return await self._client.put_tools(session_id, tools, expected_revision=expected_revision)
        except grpc.aio.AioRpcError as error:
            raise _translated(error) from None

    async def watch(self, session_id: str) -> AsyncIterator[ToolSet]:
        try:
            async for tool_set in self._client.watch_tools(session_id):
                yield tool_set
        except grpc.aio.AioRpcError as error:
            raise _translated(error) from None
        # The registry ended the stream (it is stopping): as good as gone.
        raise ToolmeshError(Code.REGISTRY_UNAVAILABLE, "The registry ended the watch.")

    async def aclose(self) -> None:
        await self._client.close()
        await self._channel.close()


def _translated(error: grpc.aio.AioRpcError) -> ToolmeshError:
    code = error_code(error)
    if code not in _REFUSALS:
        return ToolmeshError(Code.REGISTRY_UNAVAILABLE, "", {"grpcStatus": error.code().name})
    assert code is not None
    # The registry's message starts with the table's text for the code; keep what it added.
    detail = (error.details() or "").removeprefix(ERROR_TABLE[code].message).strip()
    return ToolmeshError(code, detail)
