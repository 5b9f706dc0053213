"""The peer: the MCP Python SDK serving the same no-op tool over stdio and streamable HTTP.

`python -m bench.mcp_peer stdio` is the server the stdio client spawns;
`python -m bench.mcp_peer http` binds 127.0.0.1:0, prints its port and serves
the SDK's streamable HTTP app (its defaults: stateful sessions, SSE responses)
with uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from mcp import Client, StdioServerParameters
from mcp.server.mcpserver import MCPServer

from bench.procs import REPO

MCP_PATH = "/mcp"


def noop(n: int = 0) -> dict[str, bool]:
    return {"ok": True}


def build_server() -> MCPServer:
    server: MCPServer = MCPServer("toolmesh-bench", log_level="WARNING")
    server.add_tool(noop, description="Does nothing")
    return server


def serve_http() -> None:
    server = build_server()
    app = server.streamable_http_app(streamable_http_path=MCP_PATH, host="127.0.0.1")
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
    # and accepted connections inherit this socket's protocol. Without it replies wait ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"mcp listening on port {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning")
    asyncio.run(uvicorn.Server(config).serve([sock]))


@asynccontextmanager
async def connect_stdio() -> AsyncIterator[Client]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "bench.mcp_peer", "stdio"], cwd=REPO)
    async with Client(params) as client:
        yield client


@asynccontextmanager
async def connect_http(port: int) -> AsyncIterator[Client]:
    async with Client(f"http://127.0.0.1:{port}{MCP_PATH}") as client:
        yield client


async def call_noop(client: Client, n: int) -> None:
    result = await client.call_tool("noop", {"n": n})
    if result.is_error or result.structured_content != {"ok": True}:
        raise RuntimeError(f"mcp noop answered {result!r}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mcp_peer")
    parser.add_argument("transport", choices=["stdio", "http"])
    args = parser.parse_args()
    if args.transport == "stdio":
        build_server().run("stdio")
    else:
        serve_http()


if __name__ == "__main__":
    main()
