"""MCP tasks on the gateway, backed by the ledger: start a call, leave, fetch it from another replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import mcp_types as types
import pytest
import pytest_asyncio
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from mcp_testing import http_gateway
from toolmesh.assembly.system import LocalSystem
from toolmesh.host import ToolContext, ToolHost
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "mcp-tasks"
GATES: dict[str, asyncio.Event] = {}
STOPPED: dict[str, str | None] = {}


async def gated(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Answers once the test opens its gate (or stops when cancelled)."""
    gate = GATES.setdefault(args["id"], asyncio.Event())
    try:
        await gate.wait()
    finally:
        STOPPED[args["id"]] = ctx.cancellation.reason
    return {"id": args["id"], "done": True}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def replicas(system: LocalSystem) -> AsyncIterator[tuple[str, str]]:
    """A host of `gated`, and two gateway processes (replicas) on the same services."""
    host = ToolHost(system.bridge_target, SESSION)
    host.on_tool("gated", gated, description="waits for the test")
    await host.start()
    async with http_gateway(system) as first, http_gateway(system) as second:
        yield f"{first}/sessions/{SESSION}/mcp", f"{second}/sessions/{SESSION}/mcp"
    await host.stop()


def connect(url: str) -> Client:
    # The initialize handshake at 2025-11-25, the revision with tasks.
    return Client(streamable_http_client(url), mode="legacy")


async def start_task(client: Client, marker: str) -> types.Task:
    """A task-augmented tools/call. The SDK's client checks every tools/call answer against
    CallToolResult (it has no tasks), so this one goes through its JSON-RPC dispatcher as it is."""
    params = {"name": "gated", "arguments": {"id": marker}, "task": {"ttl": 60_000}}
    raw = await client.session._dispatcher.send_raw_request("tools/call", params, None)
    return types.CreateTaskResult.model_validate(raw, by_name=False).task


async def get_task(client: Client, task_id: str) -> types.GetTaskResult:
    request = types.GetTaskRequest(params=types.GetTaskRequestParams(task_id=task_id))
    return await client.session.send_request(request, types.GetTaskResult)


async def test_start_leave_and_fetch_from_another_replica(replicas: tuple[str, str]) -> None:
    first, second = replicas
    async with connect(first) as client:
        assert client.server_capabilities.tasks is not None
        task = await start_task(client, "leave")
        assert task.status == "working" and task.task_id.startswith("tr_")
    # The client has gone; the call goes on. Another replica knows the task.
    async with connect(second) as client:
        assert (await get_task(client, task.task_id)).status == "working"
        result_request = types.GetTaskPayloadRequest(
            params=types.GetTaskPayloadRequestParams(task_id=task.task_id)
        )
        waiting = asyncio.create_task(client.session.send_request(result_request, types.CallToolResult))
        await eventually(lambda: "leave" in GATES)
        GATES["leave"].set()
        result = await waiting
        assert result.structured_content == {"id": "leave", "done": True}
        assert result.meta is not None
        assert result.meta["io.modelcontextprotocol/related-task"] == {"taskId": task.task_id}
        assert (await get_task(client, task.task_id)).status == "completed"


async def test_cancel_a_task(replicas: tuple[str, str]) -> None:
    first, _ = replicas
    async with connect(first) as client:
        task = await start_task(client, "cancel-me")
        await eventually(lambda: "cancel-me" in GATES)
        request = types.CancelTaskRequest(params=types.CancelTaskRequestParams(task_id=task.task_id))
        cancelled = await client.session.send_request(request, types.CancelTaskResult)
        assert cancelled.status == "cancelled"
        assert await eventually(lambda: STOPPED.get("cancel-me")) == "cancelled"
        with pytest.raises(MCPError) as again:
            await client.session.send_request(request, types.CancelTaskResult)
        assert again.value.code == types.INVALID_PARAMS


async def test_an_unknown_task(replicas: tuple[str, str]) -> None:
    first, _ = replicas
    async with connect(first) as client:
        with pytest.raises(MCPError) as unknown:
            await get_task(client, "tr_0123456789abcdef0123456789abcdef")
    assert unknown.value.code == types.INVALID_PARAMS


async def test_a_task_id_must_be_text(replicas: tuple[str, str]) -> None:
    first, _ = replicas
    async with connect(first) as client:
        with pytest.raises(MCPError) as malformed:
            await client.session._dispatcher.send_raw_request("tasks/get", {"taskId": 7}, None)
    assert malformed.value.code == types.INVALID_PARAMS
