"""The MCP gateway, called by the MCP Python SDK's own client over stdio and streamable HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import httpx2
import mcp_types as types
import pytest
import pytest_asyncio
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.subscriptions import ToolsListChanged

from mcp_testing import MCP_HEADERS, gateway_stdio, http_gateway, open_mcp_session
from toolmesh.assembly.system import LocalSystem
from toolmesh.client import InvocationClient
from toolmesh.core.errors import Code
from toolmesh.core.tools import ToolAnnotations
from toolmesh.host import ToolContext, ToolHost
from toolmesh.mcp.mapping import META_IDEMPOTENCY_KEY, META_REPLAYED, META_TOOL_REQUEST_ID, NO_OUTCOME
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "mcp-gw"
RUNS: dict[str, int] = {}


async def counted(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Counts its runs by `args["id"]`, takes `args["sleep"]` seconds."""
    RUNS[args["id"]] = RUNS.get(args["id"], 0) + 1
    await asyncio.sleep(args.get("sleep", 0))
    return {"id": args["id"], "runs": RUNS[args["id"]]}


async def echo(args: dict[str, Any], ctx: ToolContext) -> Any:
    return args.get("value")


async def domain_fail(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"error": {"code": "NO_SELECTION", "message": "Select text first.", "retryable": True}}


# Set by the test once it has heard the progress report; `reports_progress` waits for it.
PROGRESS_HEARD = asyncio.Event()
WAITING: dict[str, str] = {}
STOPPED: dict[str, str | None] = {}


async def reports_progress(args: dict[str, Any], ctx: ToolContext) -> dict[str, bool]:
    await ctx.report_progress(1, 2, "half way")
    await asyncio.wait_for(PROGRESS_HEARD.wait(), 10)
    return {"done": True}


async def waits(args: dict[str, Any], ctx: ToolContext) -> None:
    """Waits until the runtime says stop; records that it started and why it stopped."""
    WAITING[args["id"]] = ctx.tool_request_id
    try:
        await ctx.cancellation.wait()
    finally:
        STOPPED[args["id"]] = ctx.cancellation.reason


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def tool_host(system: LocalSystem) -> AsyncIterator[ToolHost]:
    host = ToolHost(system.bridge_target, SESSION)
    host.on_tool(
        "counted",
        counted,
        description="counts its runs",
        input_schema={
            "type": "object",
            "properties": {"id": {"type": "string"}, "sleep": {"type": "number"}},
        },
        output_schema={"type": "object", "properties": {"runs": {"type": "integer"}}},
    )
    host.on_tool("echo", echo, description="echoes value", annotations=ToolAnnotations(read_only=True))
    host.on_tool(
        "domain_fail", domain_fail, description="fails", annotations=ToolAnnotations(idempotent=True)
    )
    host.on_tool("reports_progress", reports_progress, description="reports progress")
    host.on_tool("waits", waits, description="waits until cancelled")
    await host.start()
    yield host
    await host.stop()


@asynccontextmanager
async def stdio_client(system: LocalSystem, session: str = SESSION) -> AsyncIterator[Client]:
    async with Client(gateway_stdio(system, session)) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="module", scope="module", name="http_gateway")
async def http_gateway_fixture(system: LocalSystem) -> AsyncIterator[str]:
    async with http_gateway(system) as base:
        yield base


async def test_stdio_lists_tools_with_annotations(tool_host: ToolHost, system: LocalSystem) -> None:
    async with stdio_client(system) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(listed) == {"counted", "echo", "domain_fail", "reports_progress", "waits"}
    echo_tool = listed["echo"]
    assert echo_tool.annotations is not None
    assert echo_tool.annotations.read_only_hint is True and echo_tool.annotations.idempotent_hint is True
    fail_tool = listed["domain_fail"]
    assert fail_tool.annotations is not None
    assert fail_tool.annotations.read_only_hint is False and fail_tool.annotations.idempotent_hint is True
    assert listed["counted"].output_schema == {"type": "object", "properties": {"runs": {"type": "integer"}}}


async def test_stdio_result_error_and_unknown_tool(tool_host: ToolHost, system: LocalSystem) -> None:
    async with stdio_client(system) as client:
        result = await client.call_tool("echo", {"value": {"a": 1}})
        assert not result.is_error and result.structured_content == {"a": 1}
        assert isinstance(result.content[0], types.TextContent) and result.content[0].text == '{"a":1}'
        assert result.meta is not None and result.meta[META_TOOL_REQUEST_ID].startswith("tr_")
        # A value that is not an object: text only (structuredContent is an object).
        listed = await client.call_tool("echo", {"value": [1, 2]})
        assert listed.structured_content is None and listed.content == [types.TextContent(text="[1,2]")]
        failed = await client.call_tool("domain_fail", {})
        assert failed.is_error
        assert failed.structured_content == {
            "error": {
                "code": "NO_SELECTION",
                "kind": "domain",
                "message": "Select text first.",
                "retryable": True,
                "details": None,
            }
        }
        invalid = await client.call_tool("counted", {"id": 7})
        assert invalid.is_error and invalid.structured_content["error"]["code"] == "TOOL_ARGS_INVALID"
        with pytest.raises(MCPError) as raised:
            await client.call_tool("no_such_tool", {})
        assert raised.value.code == types.INVALID_PARAMS
        assert "Unknown tool" in raised.value.message


async def test_identical_retries_run_the_tool_once(tool_host: ToolHost, system: LocalSystem) -> None:
    """Two MCP clients send the same call at once, then again: one run, the others join and replay."""
    async with stdio_client(system) as first, stdio_client(system) as second:
        arguments = {"id": "retry-1", "sleep": 0.5}
        one, two = await asyncio.gather(
            first.call_tool("counted", arguments), second.call_tool("counted", arguments)
        )
        again = await first.call_tool("counted", arguments)
    assert RUNS["retry-1"] == 1
    assert one.structured_content == two.structured_content == again.structured_content
    assert one.meta is not None and two.meta is not None and again.meta is not None
    assert (
        one.meta[META_TOOL_REQUEST_ID] == two.meta[META_TOOL_REQUEST_ID] == again.meta[META_TOOL_REQUEST_ID]
    )
    assert again.meta[META_REPLAYED] is True


def keyed(key: str) -> types.RequestParamsMeta:
    # An open map: keys other than the SDK's own round-trip as they are.
    return cast(types.RequestParamsMeta, {META_IDEMPOTENCY_KEY: key})


async def test_an_idempotency_key_names_a_new_run(tool_host: ToolHost, system: LocalSystem) -> None:
    async with stdio_client(system) as client:
        arguments = {"id": "keyed"}
        await client.call_tool("counted", arguments, meta=keyed("k1"))
        await client.call_tool("counted", arguments, meta=keyed("k2"))
        replayed = await client.call_tool("counted", arguments, meta=keyed("k2"))
    assert RUNS["keyed"] == 2
    assert replayed.structured_content == {"id": "keyed", "runs": 2}


async def test_no_outcome_is_a_json_rpc_error_saying_retry_is_safe(
    tool_host: ToolHost, system: LocalSystem
) -> None:
    """The invocation service is not there: a JSON-RPC error, not an isError result."""
    params = gateway_stdio(system, SESSION, "--invocation", "127.0.0.1:1")
    async with Client(params) as client:
        with pytest.raises(MCPError) as raised:
            await client.call_tool("echo", {"value": 1})
    assert raised.value.code == NO_OUTCOME
    assert raised.value.data["code"] == "TRANSPORT_FAILED"
    assert raised.value.data["exactRetrySafe"] is True and raised.value.data["retryable"] is True


async def test_list_changed_reaches_a_stdio_client(system: LocalSystem) -> None:
    """A handshake-era client hears notifications/tools/list_changed when the session's tools change."""
    heard: list[str] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            heard.append(message.method)

    params = gateway_stdio(system, "mcp-changes")
    host = ToolHost(system.bridge_target, "mcp-changes")
    host.on_tool("first", echo, description="first")
    await host.start()
    try:
        async with Client(params, mode="legacy", message_handler=on_message) as client:
            assert [t.name for t in (await client.list_tools()).tools] == ["first"]
            second = ToolHost(system.bridge_target, "mcp-changes")
            second.on_tool("second", echo, description="second")
            await second.start()
            try:
                await eventually(lambda: "notifications/tools/list_changed" in heard, timeout=10)
                names = {t.name for t in (await client.list_tools()).tools}
                assert names == {"first", "second"}
            finally:
                await second.stop()
    finally:
        await host.stop()


async def test_http_endpoint_per_session(tool_host: ToolHost, http_gateway: str) -> None:
    async with Client(f"{http_gateway}/sessions/{SESSION}/mcp") as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        result = await client.call_tool("echo", {"value": {"over": "http"}})
    assert "counted" in names and "echo" in names
    assert result.structured_content == {"over": "http"}
    async with Client(f"{http_gateway}/sessions/empty-session/mcp") as client:
        assert (await client.list_tools()).tools == []


async def test_http_refuses_a_foreign_origin(http_gateway: str) -> None:
    """DNS-rebinding protection: a browser page of another origin is refused before any MCP."""
    async with httpx2.AsyncClient() as http:
        response = await http.post(
            f"{http_gateway}/sessions/{SESSION}/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
            headers={"Origin": "http://evil.example", "Accept": "application/json, text/event-stream"},
        )
    assert response.status_code == 403


async def test_http_legacy_client_over_streamable_http(tool_host: ToolHost, http_gateway: str) -> None:
    async with Client(
        streamable_http_client(f"{http_gateway}/sessions/{SESSION}/mcp"), mode="legacy"
    ) as client:
        result = await client.call_tool("echo", {"value": {"legacy": True}})
    assert result.structured_content == {"legacy": True}


async def test_progress_reaches_the_mcp_client(tool_host: ToolHost, system: LocalSystem) -> None:
    heard: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        heard.append((progress, total, message))
        PROGRESS_HEARD.set()

    async with stdio_client(system) as client:
        result = await client.call_tool("reports_progress", {}, progress_callback=on_progress)
    assert result.structured_content == {"done": True}
    assert heard == [(1.0, 2.0, "half way")]


async def test_notifications_cancelled_cancels_the_invocation(
    tool_host: ToolHost, system: LocalSystem
) -> None:
    """The MCP client gives up on a call (the SDK sends notifications/cancelled): the handler is told."""
    async with stdio_client(system) as client, InvocationClient(system.invocation_target) as calls:
        call = asyncio.create_task(client.call_tool("waits", {"id": "cancel-1"}))
        tool_request_id = await eventually(lambda: WAITING.get("cancel-1"))
        call.cancel()
        assert await eventually(lambda: STOPPED.get("cancel-1")) == "cancelled"
        invocation = await calls.get_invocation(tool_request_id)
        assert invocation.message.outcome.error.code == Code.TOOL_CANCELLED.value


async def test_an_idempotency_key_must_be_text(tool_host: ToolHost, system: LocalSystem) -> None:
    async with stdio_client(system) as client:
        with pytest.raises(MCPError) as raised:
            await client.call_tool("echo", {}, meta=cast(types.RequestParamsMeta, {META_IDEMPOTENCY_KEY: 5}))
    assert raised.value.code == types.INVALID_PARAMS


def sse_message(body: str) -> dict[str, Any]:
    """The JSON-RPC message in a streamable HTTP response's SSE body."""
    data = [line[len("data:") :].strip() for line in body.splitlines() if line.startswith("data:")]
    message: dict[str, Any] = json.loads(next(text for text in data if text))
    return message


async def test_an_http_mcp_session_serves_one_toolmesh_session(http_gateway: str) -> None:
    """An MCP session opened at one session's endpoint cannot be used at another's."""
    async with httpx2.AsyncClient(headers=MCP_HEADERS) as http:
        await open_mcp_session(http, f"{http_gateway}/sessions/{SESSION}/mcp")
        own = await http.post(
            f"{http_gateway}/sessions/{SESSION}/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        )
        assert "tools" in sse_message(own.text)["result"]
        other = await http.post(
            f"{http_gateway}/sessions/another/mcp", json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
        )
    assert sse_message(other.text)["error"]["code"] == types.INVALID_REQUEST


async def test_a_stdio_client_that_goes_away_cancels_its_calls(
    tool_host: ToolHost, system: LocalSystem
) -> None:
    """The MCP client closes the gateway's stdin mid-call: the invocation is cancelled, not left running."""
    async with stdio_client(system) as client:
        call = asyncio.create_task(client.call_tool("waits", {"id": "gone-1"}))
        await eventually(lambda: WAITING.get("gone-1"))
    with contextlib.suppress(MCPError):
        await call
    assert await eventually(lambda: STOPPED.get("gone-1")) == "cancelled"


async def test_list_changed_reaches_a_2026_client_listening(system: LocalSystem, http_gateway: str) -> None:
    """A 2026-07-28 client hears the change on its subscriptions/listen stream."""
    host = ToolHost(system.bridge_target, "mcp-listen")
    host.on_tool("first", echo, description="first")
    await host.start()
    try:
        async with Client(f"{http_gateway}/sessions/mcp-listen/mcp") as client:
            assert [tool.name for tool in (await client.list_tools()).tools] == ["first"]
            async with client.listen(tools_list_changed=True) as subscription:
                second = ToolHost(system.bridge_target, "mcp-listen")
                second.on_tool("second", echo, description="second")
                await second.start()
                try:
                    event = await asyncio.wait_for(anext(aiter(subscription)), 10)
                    assert isinstance(event, ToolsListChanged)
                finally:
                    await second.stop()
    finally:
        await host.stop()


async def test_a_2026_client_closing_its_stream_cancels_the_call(
    tool_host: ToolHost, http_gateway: str
) -> None:
    """On 2026-07-28 a client cancels a call by closing its response stream: the invocation is cancelled."""
    async with Client(f"{http_gateway}/sessions/{SESSION}/mcp") as client:
        assert client.session.protocol_version == "2026-07-28"
        call = asyncio.create_task(client.call_tool("waits", {"id": "closed-1"}))
        await eventually(lambda: WAITING.get("closed-1"))
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        assert await eventually(lambda: STOPPED.get("closed-1")) == "cancelled"


async def test_a_dropped_legacy_http_connection_is_not_a_cancellation(
    tool_host: ToolHost, http_gateway: str
) -> None:
    """Before 2026-07-28 a dropped HTTP connection cancels nothing (the MCP spec); DELETE ends the calls.

    Raw HTTP: the SDK's client, abandoning a call, sends notifications/cancelled (a cancellation).
    """
    url = f"{http_gateway}/sessions/{SESSION}/mcp"
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
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
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "waits", "arguments": {"id": "drop-1"}},
    }
    async with httpx2.AsyncClient(headers=headers) as http:
        opened = await http.post(url, json=initialize)
        http.headers["Mcp-Session-Id"] = opened.headers["mcp-session-id"]
        await http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        async with http.stream("POST", url, json=call):
            await eventually(lambda: WAITING.get("drop-1"))
        # The response stream closed before its answer: the call goes on.
        await asyncio.sleep(1.0)
        assert "drop-1" not in STOPPED
        await http.delete(url)
    assert await eventually(lambda: STOPPED.get("drop-1")) == "cancelled"
