"""MCP tasks on the gateway, backed by the ledger: start a call, leave, fetch it from another replica.

2025-11-25 tasks (the client asks for one), and the 2026-07-28 tasks extension (the server decides),
each with the MCP Python SDK's own client over streamable HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import mcp_types as types
import pytest
import pytest_asyncio
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import ConfigDict

from mcp_testing import http_gateway
from toolmesh.assembly.system import LocalSystem
from toolmesh.host import ToolContext, ToolHost
from toolmesh.mcp.tasks import TASKS_EXTENSION
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


async def fails(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Waits for the test's gate, then fails with a domain error."""
    await GATES.setdefault(args["id"], asyncio.Event()).wait()
    return {"error": {"code": "NO_SELECTION", "message": "Select text first.", "retryable": True}}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def host(system: LocalSystem) -> AsyncIterator[ToolHost]:
    host = ToolHost(system.bridge_target, SESSION)
    host.on_tool("gated", gated, description="waits for the test")
    host.on_tool("fails", fails, description="fails once the test says")
    await host.start()
    yield host
    await host.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def replicas(system: LocalSystem, host: ToolHost) -> AsyncIterator[tuple[str, str]]:
    """A host of `gated`, and two gateway processes (replicas) on the same services."""
    async with http_gateway(system) as first, http_gateway(system) as second:
        yield f"{first}/sessions/{SESSION}/mcp", f"{second}/sessions/{SESSION}/mcp"


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


# -- 2026-07-28: the tasks extension (io.modelcontextprotocol/tasks) ---------------------------------


class CreatedTask(types.Result):
    """A tools/call answered with a task (`resultType: "task"`), as the extension says it."""

    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    created_at: str
    last_updated_at: str
    ttl_ms: int | None
    poll_interval_ms: int | None = None
    status_message: str | None = None


class GetTask(types.Request[dict[str, Any], Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"


class UpdateTask(types.Request[dict[str, Any], Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    name_param = "taskId"


class CancelTask(types.Request[dict[str, Any], Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    name_param = "taskId"


class AnyResult(types.Result):
    """A result as it came, its fields kept (the SDK has no types of the extension's results)."""

    model_config = ConfigDict(extra="allow")


async def send(session: ClientSession, request: types.Request[Any, Any]) -> dict[str, Any]:
    return (await session.send_request(request, AnyResult)).model_dump(by_alias=True, exclude_none=True)


async def tasks_get(client: Client, task_id: str) -> dict[str, Any]:
    return await send(client.session, GetTask(params={"taskId": task_id}))


async def until_ended(client: Client, task_id: str) -> dict[str, Any]:
    """tasks/get until the task is no longer working, as often as the server says."""
    while True:
        task = await tasks_get(client, task_id)
        if task["status"] != "working":
            return task
        await asyncio.sleep(task["pollIntervalMs"] / 1000)


class Tasks(ClientExtension):
    """The client side of the extension: a task answer is polled (tasks/get) to its result."""

    identifier = TASKS_EXTENSION

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return (ResultClaim(result_type="task", model=CreatedTask, resolve=self._resolve),)

    async def _resolve(self, created: CreatedTask, ctx: ClaimContext) -> types.CallToolResult:
        while True:
            task = await send(ctx.session, GetTask(params={"taskId": created.task_id}))
            if task["status"] != "working":
                break
            await asyncio.sleep(task["pollIntervalMs"] / 1000)
        assert task["status"] == "completed", task
        return types.CallToolResult.model_validate(task["result"], by_name=False)


def connect_2026(url: str, *, tasks: bool = True) -> Client:
    return Client(url, extensions=[Tasks()] if tasks else None)


async def open_gate_later(marker: str, after_s: float) -> None:
    await asyncio.sleep(after_s)
    GATES.setdefault(marker, asyncio.Event()).set()


async def test_2026_a_long_call_becomes_a_task_any_replica_answers(replicas: tuple[str, str]) -> None:
    first, second = replicas
    async with connect_2026(first) as client:
        assert client.session.protocol_version == "2026-07-28"
        created = await client.session.call_tool("gated", {"id": "v2-leave"}, allow_claimed=True)
        assert isinstance(created, CreatedTask)
        assert created.status == "working" and created.task_id.startswith("tr_")
        assert created.ttl_ms is not None and created.ttl_ms >= 600_000 and created.poll_interval_ms == 1000
    # The client has gone; the call goes on in the invocation service. Another replica knows the task.
    async with connect_2026(second) as client:
        assert (await tasks_get(client, created.task_id))["status"] == "working"
        # Accepted: no toolmesh tool asks for input, so there is nothing to answer.
        await send(client.session, UpdateTask(params={"taskId": created.task_id, "inputResponses": {}}))
        GATES.setdefault("v2-leave", asyncio.Event()).set()
        task = await until_ended(client, created.task_id)
    assert task["status"] == "completed"
    assert task["result"]["structuredContent"] == {"id": "v2-leave", "done": True}
    assert task["result"]["isError"] is False


async def test_2026_a_task_survives_a_gateway_restart(system: LocalSystem, host: ToolHost) -> None:
    async with http_gateway(system) as base, connect_2026(f"{base}/sessions/{SESSION}/mcp") as client:
        created = await client.session.call_tool("gated", {"id": "v2-restart"}, allow_claimed=True)
        assert isinstance(created, CreatedTask)
    # That gateway process has exited; a new one answers from the ledger.
    GATES.setdefault("v2-restart", asyncio.Event()).set()
    async with http_gateway(system) as base, connect_2026(f"{base}/sessions/{SESSION}/mcp") as client:
        task = await until_ended(client, created.task_id)
    assert task["status"] == "completed"
    assert task["result"]["structuredContent"] == {"id": "v2-restart", "done": True}


async def test_2026_the_sdk_client_resolves_a_task_to_the_result(replicas: tuple[str, str]) -> None:
    """The SDK's client with the extension: a call that became a task ends as its CallToolResult."""
    first, _ = replicas
    async with connect_2026(first) as client:
        opener = asyncio.create_task(open_gate_later("v2-resolve", 1.5))
        result = await client.call_tool("gated", {"id": "v2-resolve"})
        await opener
    assert result.structured_content == {"id": "v2-resolve", "done": True}


async def test_2026_a_quick_call_is_answered_inline(replicas: tuple[str, str]) -> None:
    first, _ = replicas
    GATES.setdefault("v2-quick", asyncio.Event()).set()
    async with connect_2026(first) as client:
        result = await client.session.call_tool("gated", {"id": "v2-quick"}, allow_claimed=True)
    assert isinstance(result, types.CallToolResult)
    assert result.structured_content == {"id": "v2-quick", "done": True}


async def test_2026_without_the_extension_no_task(replicas: tuple[str, str]) -> None:
    """A client that did not declare the extension waits for the result, however long the call takes."""
    first, _ = replicas
    async with connect_2026(first, tasks=False) as client:
        opener = asyncio.create_task(open_gate_later("v2-plain", 1.5))
        result = await client.session.call_tool("gated", {"id": "v2-plain"}, allow_claimed=True)
        await opener
    assert isinstance(result, types.CallToolResult)
    assert result.structured_content == {"id": "v2-plain", "done": True}


async def test_2026_a_tool_error_is_a_completed_task_with_is_error(replicas: tuple[str, str]) -> None:
    """The model reads the tool's error as isError content: the task is completed, its result says so."""
    first, _ = replicas
    async with connect_2026(first) as client:
        created = await client.session.call_tool("fails", {"id": "v2-fails"}, allow_claimed=True)
        assert isinstance(created, CreatedTask)
        GATES["v2-fails"].set()
        task = await until_ended(client, created.task_id)
    assert task["status"] == "completed" and task["statusMessage"] == "NO_SELECTION"
    assert task["result"]["isError"] is True
    assert task["result"]["content"][0]["text"].startswith("NO_SELECTION: Select text first.")
    assert task["result"]["structuredContent"]["error"]["retryable"] is True


async def test_2026_cancel_a_task(replicas: tuple[str, str]) -> None:
    first, second = replicas
    async with connect_2026(first) as client:
        created = await client.session.call_tool("gated", {"id": "v2-cancel"}, allow_claimed=True)
        assert isinstance(created, CreatedTask)
    async with connect_2026(second) as client:
        cancel = CancelTask(params={"taskId": created.task_id})
        await send(client.session, cancel)
        assert await eventually(lambda: STOPPED.get("v2-cancel")) == "cancelled"
        assert (await until_ended(client, created.task_id))["status"] == "cancelled"
        with pytest.raises(MCPError) as again:
            await send(client.session, cancel)
        assert again.value.code == types.INVALID_PARAMS
        with pytest.raises(MCPError) as unknown:
            await tasks_get(client, "tr_0123456789abcdef0123456789abcdef")
        assert unknown.value.code == types.INVALID_PARAMS


async def test_2026_closing_the_stream_before_it_is_a_task_cancels(replicas: tuple[str, str]) -> None:
    """Until the call is a task, the client closing its response stream (2026-07-28's cancel) cancels it."""
    first, _ = replicas
    async with connect_2026(first) as client:
        call = asyncio.create_task(client.call_tool("gated", {"id": "v2-closed"}))
        await eventually(lambda: "v2-closed" in GATES)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        assert await eventually(lambda: STOPPED.get("v2-closed")) == "cancelled"
