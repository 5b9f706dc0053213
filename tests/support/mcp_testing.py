"""Helpers for the MCP tests: `toolmesh mcp` as MCP clients start it, over stdio and HTTP."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mcp import StdioServerParameters

from toolmesh.assembly.system import LocalSystem
from toolmesh_testing import SUPPORT, toolmesh_command


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
