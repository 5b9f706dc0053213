"""What a turn needs from the tool services of its session (implemented over gRPC in grpc_channel)."""

from __future__ import annotations

from typing import Protocol

from toolmesh.client.invocation import CallResult
from toolmesh.core.tools import ToolSet


class ToolChannel(Protocol):
    """The tool services of one session, as a turn uses them (implemented by GrpcToolChannel)."""

    async def check(self) -> None:
        """Raise AssistantError(UNSUPPORTED_WEBMCP) when the services cannot serve an assistant."""
        ...

    async def list_tools(self) -> ToolSet:
        """The session's current tools. Raises AssistantError(DISCOVERY_FAILED) when they cannot be read."""
        ...

    async def wait_for_change(self, revision: int) -> None:
        """Return once the session's revision differs from `revision`. Never raises."""
        ...

    async def invoke(
        self, tool_name: str, arguments_json: str, *, turn_id: str, timeout: float
    ) -> CallResult:
        """One tool call. Never raises: every failure is a CallResult."""
        ...

    async def close(self) -> None:
        """Release the connections; pending delivery confirmations are sent first."""
        ...
