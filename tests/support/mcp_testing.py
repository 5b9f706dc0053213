"""Helpers for the MCP tests: `toolmesh mcp` as MCP clients start it, over stdio and HTTP."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
from mcp import StdioServerParameters

from toolmesh.assembly.system import LocalSystem
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.host import ToolContext
from toolmesh.mcp.gateway import Gateway, current_token
from toolmesh.mcp.serve import serve_http, session_of_path, token_of_header
from toolmesh_testing import SUPPORT, eventually, toolmesh_command


def services_env(system: LocalSystem, **extra: str) -> dict[str, str]:
    """This environment, pointing the CLI at `system`'s services."""
    return dict(
        os.environ,
        TOOLMESH_REGISTRY_ADDR=system.registry_target,
        TOOLMESH_INVOCATION_ADDR=system.invocation_target,
        TOOLMESH_BRIDGE_ADDR=system.bridge_target,
        **extra,
    )


def gateway_stdio(system: LocalSystem, session: str, *flags: str) -> StdioServerParameters:
    """`toolmesh mcp --thread-id SESSION`, as an MCP client spawns it."""
    command = toolmesh_command()
    return StdioServerParameters(
        command=command[0],
        args=[*command[1:], "mcp", "--thread-id", session, *flags],
        env=services_env(system),
        cwd=SUPPORT,
    )


@asynccontextmanager
async def http_gateway(system: LocalSystem) -> AsyncIterator[str]:
    """`toolmesh mcp --http` on a free loopback port; yields its base URL (http://127.0.0.1:PORT)."""
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "mcp",
        "--http",
        "--listen",
        "127.0.0.1:0",
        env=services_env(system),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdout is not None
    try:
        # Its imports (the MCP SDK, starlette, uvicorn) take seconds on a loaded machine.
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        assert line.startswith("toolmesh mcp: serving http://127.0.0.1:"), line
        yield line.split("serving ", 1)[1].split("/sessions/", 1)[0]
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), 10)


@asynccontextmanager
async def gateway_in_process(system: LocalSystem, **options: Any) -> AsyncIterator[tuple[Gateway, str]]:
    """The HTTP gateway served from this process; yields it and its base URL."""
    async with (
        RegistryClient(system.registry_target, token=current_token) as registry,
        InvocationClient(system.invocation_target, token=current_token) as invocation,
    ):
        gateway = Gateway(registry, invocation, session_of_path, token_of_header, **options)
        ports: list[int] = []
        stop = asyncio.Event()
        serving = asyncio.create_task(
            serve_http(gateway, "127.0.0.1", 0, allowed_origins=[], on_listening=ports.append, stop=stop)
        )
        try:
            port = await eventually(lambda: ports[0] if ports else None)
            yield gateway, f"http://127.0.0.1:{port}"
        finally:
            stop.set()
            await serving
            await gateway.close()


# What a 2025-11-25 client sends with each request over streamable HTTP.
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}


async def open_mcp_session(http: httpx2.AsyncClient, url: str) -> str:
    """The initialize handshake by hand at `url`; the client sends the MCP session id from then on."""
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    opened = await http.post(url, json=initialize)
    mcp_session: str = opened.headers["mcp-session-id"]
    http.headers["Mcp-Session-Id"] = mcp_session
    await http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    return mcp_session


class WaitsUntilCancelled:
    """A tool handler that runs until its call is cancelled: `started` once it runs, `stopped` the reasons."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.stopped: list[str | None] = []

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> None:
        self.started.set()
        try:
            await ctx.cancellation.wait()
        finally:
            self.stopped.append(ctx.cancellation.reason)
