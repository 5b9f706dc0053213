"""An MCP server made with the MCP SDK, for `toolmesh host --mcp` in the tests.

`python mcp_server.py MARKERS` serves over stdio; MARKERS is a directory where
`slow` writes `cancelled-<marker>` when the call is cancelled.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError

from toolmesh.core import otel

MARKERS = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
server: MCPServer = MCPServer("toolmesh-test-mcp-server", log_level="WARNING")


@server.tool(description="Adds two numbers", annotations=types.ToolAnnotations(read_only_hint=True))
def add(a: int, b: int) -> dict[str, int]:
    return {"sum": a + b}


@server.tool(description="Always fails")
def fail(reason: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=f"it failed: {reason}")], is_error=True)


@server.tool(description="Waits until cancelled", meta={"toolmesh/timeoutMs": 1000})
async def slow(marker: str) -> str:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        (MARKERS / f"cancelled-{marker}").touch()
        raise
    return "done"


@server.tool(description="Reports progress, then answers")
async def progressing(ctx: Context[Any]) -> str:
    await ctx.report_progress(3, 4, "three of four")
    return "finished"


@server.tool(description="Answers with a JSON-RPC error")
def rpc_error() -> str:
    raise MCPError(code=-32001, message="the server refused")


def extra(x: int) -> int:
    return x


@server.tool(description="Adds the tool `extra` and says the list changed")
async def grow(ctx: Context[Any]) -> str:
    server.add_tool(extra, description="Added later")
    await ctx.request_context.session.send_tool_list_changed()
    return "grown"


if __name__ == "__main__":
    # Exports its spans (the MCP SDK's) when the environment names an OTLP endpoint.
    otel.configure("toolmesh-test-mcp-server")
    try:
        server.run("stdio")
    finally:
        otel.shutdown()
