"""`toolmesh host --mcp`: an MCP server made with the MCP SDK serves a session's tools."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.outcome import ErrorKind
from toolmesh.core.progress import ToolProgress
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import REPO, SUPPORT, HostProcess, eventually, run_cli, toolmesh_command

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "mcp-host"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mcp_host(system: LocalSystem, marker_dir: Path) -> AsyncIterator[HostProcess]:
    server = f"{sys.executable} {SUPPORT / 'mcp_server.py'} {marker_dir}"
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "host",
        "--thread-id",
        SESSION,
        "--mcp",
        server,
        "--bridge",
        system.bridge_target,
        cwd=SUPPORT,
        env=dict(os.environ),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    host = HostProcess(process)

    async def read() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            host.stderr_lines.append(line.decode(errors="replace"))

    host._reader = asyncio.create_task(read())
    await host.wait_for_log(msg="host ready", timeout=30)
    yield host
    await host.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def clients(system: LocalSystem) -> AsyncIterator[tuple[RegistryClient, InvocationClient]]:
    async with (
        RegistryClient(system.registry_target) as registry,
        InvocationClient(system.invocation_target) as calls,
    ):
        yield registry, calls


async def test_the_mcp_servers_tools_are_declared(
    mcp_host: HostProcess, clients: tuple[RegistryClient, InvocationClient]
) -> None:
    registry, _ = clients

    async def declared() -> dict[str, ToolSpec] | None:
        tools = {tool.name: tool for tool in (await registry.list_tools(SESSION)).tools}
        return tools if {"add", "fail", "slow", "grow", "progressing", "rpc_error"} <= set(tools) else None

    tools = await eventually(declared)
    add = tools["add"]
    assert add.annotations.read_only and add.description == "Adds two numbers"
    assert tools["slow"].timeout_ms == 1000


async def test_calls_reach_the_mcp_server(
    mcp_host: HostProcess, clients: tuple[RegistryClient, InvocationClient]
) -> None:
    _, calls = clients
    added = await calls.invoke(SESSION, "add", {"a": 2, "b": 3}, turn_id="t1")
    assert added.outcome is not None and added.outcome.result_json == '{"sum":5}'
    failed = await calls.invoke(SESSION, "fail", {"reason": "no"}, turn_id="t1")
    assert failed.outcome is not None and failed.outcome.failure is not None
    assert (
        failed.outcome.failure.code == "MCP_TOOL_ERROR" and failed.outcome.failure.message == "it failed: no"
    )
    refused = await calls.invoke(SESSION, "add", {"a": "x", "b": 1}, turn_id="t1")
    assert refused.outcome is not None and refused.outcome.failure is not None
    # toolmesh checks the MCP server's own schema before anything runs.
    assert refused.outcome.failure.code == Code.TOOL_ARGS_INVALID.value


async def test_a_json_rpc_error_from_the_mcp_server_is_mcp_error(
    mcp_host: HostProcess, clients: tuple[RegistryClient, InvocationClient]
) -> None:
    """The MCP server answers tools/call with a JSON-RPC error: the caller gets the domain error MCP_ERROR."""
    _, calls = clients
    result = await calls.invoke(SESSION, "rpc_error", {}, turn_id="t6")
    assert result.outcome is not None and result.outcome.failure is not None
    failure = result.outcome.failure
    assert failure.kind is ErrorKind.DOMAIN
    assert failure.code == "MCP_ERROR" and failure.message == "the server refused"
    assert failure.details == {"jsonrpcCode": -32001}


async def test_toolmeshs_deadline_cancels_the_mcp_servers_call(
    mcp_host: HostProcess, clients: tuple[RegistryClient, InvocationClient], marker_dir: Path
) -> None:
    _, calls = clients
    result = await calls.invoke(SESSION, "slow", {"marker": "deadline"}, turn_id="t2")
    assert result.outcome is not None and result.outcome.failure is not None
    assert result.outcome.failure.code == Code.TOOL_TIMEOUT.value
    await eventually((marker_dir / "cancelled-deadline").exists)


async def test_list_changed_redeclares(
    mcp_host: HostProcess, clients: tuple[RegistryClient, InvocationClient]
) -> None:
    registry, calls = clients
    grown = await calls.invoke(SESSION, "grow", {}, turn_id="t3")
    assert grown.outcome is not None and grown.outcome.ok

    async def listed() -> bool:
        return (await registry.list_tools(SESSION)).find("extra") is not None

    await eventually(listed)
    extra = await calls.invoke(SESSION, "extra", {"x": 4}, turn_id="t3")
    assert extra.outcome is not None and extra.outcome.result_json is not None


async def test_the_mcp_servers_progress_reaches_the_caller(
    mcp_host: HostProcess, clients: tuple[RegistryClient, InvocationClient]
) -> None:
    _, calls = clients
    heard: list[ToolProgress] = []
    result = await calls.invoke(SESSION, "progressing", {}, turn_id="t4", on_progress=heard.append)
    assert result.outcome is not None and result.outcome.ok
    assert [(p.progress, p.total, p.message) for p in heard] == [(3.0, 4.0, "three of four")]


async def test_an_mcp_server_over_streamable_http(system: LocalSystem, tmp_path: Path) -> None:
    """`--mcp-url`: the MCP SDK's server over streamable HTTP serves a session's tool."""
    peer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.mcp_peer",
        "http",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert peer.stdout is not None
    try:
        line = (await asyncio.wait_for(peer.stdout.readline(), 20)).decode()
        url = f"http://127.0.0.1:{int(line.rsplit(' ', 1)[1])}/mcp"
        code, _, err = await run_cli(
            "host", "--session-id", "mcp-url", "--mcp-url", url, "--detach",
            "--log-file", str(tmp_path / "host.log"), "--pid-file", str(tmp_path / "host.pid"),
            env=dict(os.environ, TOOLMESH_BRIDGE_ADDR=system.bridge_target),
        )  # fmt: skip
        assert code == 0, err
        host_pid = int((tmp_path / "host.pid").read_text())
        try:
            async with InvocationClient(system.invocation_target) as calls:

                async def answered() -> bool:
                    result = await calls.invoke("mcp-url", "noop", {"n": 1}, turn_id="t5")
                    return result.outcome is not None and result.outcome.result_json == '{"ok":true}'

                await eventually(answered)
        finally:
            os.kill(host_pid, signal.SIGTERM)
    finally:
        peer.terminate()
        await peer.wait()
