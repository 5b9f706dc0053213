"""An MCP server as a toolmesh host: its tools declared in the session, each call served by calling it.

The MCP server's tools/list becomes the host's declared tools (again on each
notifications/tools/list_changed); a call reaches the host with toolmesh's
deadline, join/replay, result cap and tracing in front of it, and is served
by a tools/call to the MCP server; its notifications/progress go on as the
call's progress (ctx.report_progress). When toolmesh cancels the call (its
deadline passed, or its caller cancelled), the handler is cancelled and the
SDK sends the MCP server notifications/cancelled. An isError result becomes a
domain error (MCP_TOOL_ERROR); a JSON-RPC error from the server, a domain
error MCP_ERROR with the server's message.

The connection uses the initialize handshake (mode "legacy"), which every MCP
server speaks, and on which notifications/tools/list_changed arrives unasked.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import mcp_types as types
from mcp import Client, StdioServerParameters
from mcp.client.session import IncomingMessage
from mcp.shared.exceptions import MCPError

from toolmesh.core.names import TOOL_NAME
from toolmesh.host import ToolContext, ToolHost
from toolmesh.mcp.mapping import handler_value, tool_spec
from toolmesh.mcp.telemetry import client_operation

log = logging.getLogger("toolmesh.mcp.upstream")

# The domain error code of a JSON-RPC error the MCP server answered a call with.
MCP_ERROR = "MCP_ERROR"


def stdio_server(command_line: str) -> StdioServerParameters:
    """`--mcp "command args"`: the MCP server to start, split as a POSIX shell would."""
    words = shlex.split(command_line)
    if not words:
        raise ValueError("--mcp needs a command")
    return StdioServerParameters(command=words[0], args=words[1:])


class Upstream:
    """One MCP server's tools, served by a ToolHost (see the module)."""

    def __init__(self, host: ToolHost) -> None:
        self._host = host
        self._client: Client | None = None
        self.tool_names: list[str] = []
        self._refreshing: set[asyncio.Task[None]] = set()
        host.on_any(self.call)

    async def refresh(self) -> None:
        """Read the MCP server's tools and declare them (a name toolmesh cannot take is left out, logged)."""
        assert self._client is not None
        with client_operation("tools/list", None, self._client.protocol_version):
            listed = await self._client.list_tools()
        specs = []
        for tool in listed.tools:
            if TOOL_NAME.fullmatch(tool.name):
                specs.append(tool_spec(tool))
            else:
                log.warning("MCP tool name not usable here; left out", extra={"tool_name": tool.name[:128]})
        self.tool_names = [spec.name for spec in specs]
        await self._host.declare_tools(specs)
        log.info("MCP server tools declared", extra={"tools": ",".join(self.tool_names)})

    async def _on_message(self, message: IncomingMessage) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            task = asyncio.create_task(self._refresh_logged())
            self._refreshing.add(task)
            task.add_done_callback(self._refreshing.discard)

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except (MCPError, OSError) as error:
            log.warning("re-reading the MCP server's tools failed", extra={"exception": type(error).__name__})

    async def call(self, arguments: dict[str, Any], ctx: ToolContext) -> object:
        """Serve one call: a tools/call to the MCP server; its result, or a domain error."""
        assert self._client is not None

        async def progressed(progress: float, total: float | None, message: str | None) -> None:
            await ctx.report_progress(progress, total, message)

        try:
            with client_operation("tools/call", ctx.tool_name, self._client.protocol_version) as operation:
                result = await self._client.call_tool(ctx.tool_name, arguments, progress_callback=progressed)
                operation.set_result(result)
        except MCPError as error:
            details = {"jsonrpcCode": error.code}
            return {"error": {"code": MCP_ERROR, "message": error.message, "details": details}}
        return handler_value(result)

    @asynccontextmanager
    async def connected(self, server: StdioServerParameters | str) -> AsyncIterator[Upstream]:
        """Connect to the MCP server (a command to start, or a streamable HTTP URL) and declare its tools."""
        async with Client(server, mode="legacy", message_handler=self._on_message) as client:
            self._client = client
            try:
                await self.refresh()
                yield self
            finally:
                for task in self._refreshing:
                    task.cancel()
                self._client = None
