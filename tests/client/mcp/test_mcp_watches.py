"""The HTTP gateway's watches of sessions' tools: held by open MCP sessions, ended with them, bounded.

The gateway runs in this process (a real uvicorn server on a free port) so
that the tests can read which sessions it watches; the MCP SDK's own client
speaks to it over streamable HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.session import IncomingMessage
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from mcp_testing import MCP_HEADERS, WaitsUntilCancelled, gateway_in_process, http_gateway, open_mcp_session
from toolmesh.assembly.system import LocalSystem
from toolmesh.core.errors import Code
from toolmesh.host import ToolContext, ToolHost
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


async def echo(args: dict[str, Any], ctx: ToolContext) -> Any:
    return args.get("value")


def legacy_client(base: str, session: str, **options: Any) -> Client:
    """An MCP session (initialize handshake) at the session's endpoint; closing it DELETEs it."""
    return Client(streamable_http_client(f"{base}/sessions/{session}/mcp"), mode="legacy", **options)


@asynccontextmanager
async def hosted(system: LocalSystem, session: str, tool_name: str) -> AsyncIterator[ToolHost]:
    host = ToolHost(system.bridge_target, session)
    host.on_tool(tool_name, echo, description=tool_name)
    await host.start()
    try:
        yield host
    finally:
        await host.stop()


async def test_closed_mcp_sessions_release_their_watches(system: LocalSystem) -> None:
    """Many sessions opened and closed leave no watch; a still-open MCP session still hears list_changed."""
    changed = asyncio.Event()

    async def on_message(message: IncomingMessage) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with (
        gateway_in_process(system) as (gateway, base),
        hosted(system, "watch-open", "first"),
        legacy_client(base, "watch-open", message_handler=on_message) as kept,
    ):
        assert [tool.name for tool in (await kept.list_tools()).tools] == ["first"]
        for n in range(25):
            async with legacy_client(base, f"watch-{n}") as client:
                await client.list_tools()
                assert f"watch-{n}" in gateway.watched_sessions
        assert await eventually(lambda: gateway.watched_sessions == {"watch-open"})
        async with hosted(system, "watch-open", "second"):
            await asyncio.wait_for(changed.wait(), 10)
            assert {tool.name for tool in (await kept.list_tools()).tools} == {"first", "second"}
    assert gateway.watched_sessions == frozenset()


async def test_two_mcp_sessions_of_one_session_share_its_watch_until_both_close(system: LocalSystem) -> None:
    async with gateway_in_process(system) as (gateway, base):
        async with legacy_client(base, "watch-shared") as first:
            await first.list_tools()
            async with legacy_client(base, "watch-shared") as second:
                await second.list_tools()
            # The first MCP session still holds the watch.
            assert gateway.watched_sessions == {"watch-shared"}
            await first.list_tools()
        assert await eventually(lambda: not gateway.watched_sessions)


async def test_a_delete_ends_the_mcp_session_its_watch_and_its_calls(system: LocalSystem) -> None:
    """DELETE: the MCP session is gone (404), its watch ends, its running call is cancelled."""
    waits = WaitsUntilCancelled()

    host = ToolHost(system.bridge_target, "watch-delete")
    host.on_tool("waits", waits, description="waits until cancelled")
    await host.start()
    endpoint = "/sessions/watch-delete/mcp"
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "waits", "arguments": {}}}
    try:
        async with (
            gateway_in_process(system) as (gateway, base),
            httpx2.AsyncClient(headers=MCP_HEADERS) as http,
        ):
            await open_mcp_session(http, f"{base}{endpoint}")
            calling = asyncio.create_task(http.post(f"{base}{endpoint}", json=call, timeout=30))
            await asyncio.wait_for(waits.started.wait(), 10)
            assert gateway.watched_sessions == {"watch-delete"}
            deleted = await http.delete(f"{base}{endpoint}")
            assert deleted.status_code == 200
            assert await eventually(lambda: waits.stopped) == ["cancelled"]
            assert await eventually(lambda: not gateway.watched_sessions)
            after = await http.post(
                f"{base}{endpoint}", json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
            )
            assert after.status_code == 404
            calling.cancel()
            await asyncio.gather(calling, return_exceptions=True)
    finally:
        await host.stop()


async def test_watches_are_bounded(system: LocalSystem) -> None:
    """At the bound, a watch nothing holds is ended to make room; when all are held, OVERLOADED."""
    async with gateway_in_process(system, max_watches=2) as (gateway, base):
        async with legacy_client(base, "bound-1") as held:
            await held.list_tools()
            # A 2026-07-28 request holds no watch: it only lives until idle.
            async with Client(f"{base}/sessions/bound-2/mcp") as unheld:
                await unheld.list_tools()
            assert gateway.watched_sessions == {"bound-1", "bound-2"}
            async with legacy_client(base, "bound-3") as third:
                await third.list_tools()
                assert gateway.watched_sessions == {"bound-1", "bound-3"}
                async with legacy_client(base, "bound-4") as fourth:
                    with pytest.raises(MCPError) as raised:
                        await fourth.list_tools()
        assert raised.value.code == types.INTERNAL_ERROR
        assert raised.value.data == {"code": Code.OVERLOADED.value, "retryable": True}
        assert await eventually(lambda: not gateway.watched_sessions)


async def test_a_watch_nothing_holds_ends_when_idle(system: LocalSystem) -> None:
    async with (
        gateway_in_process(system, watch_idle_s=0.2) as (gateway, base),
        Client(f"{base}/sessions/idle-1/mcp") as client,
    ):
        await client.list_tools()
        assert gateway.watched_sessions == {"idle-1"}
        assert await eventually(lambda: not gateway.watched_sessions)
        # The next request watches again.
        await client.list_tools()
        assert gateway.watched_sessions == {"idle-1"}


async def test_progress_reaches_an_mcp_client_over_http(system: LocalSystem) -> None:
    """`toolmesh mcp --http`: a handler's progress reaches the MCP SDK client that sent a progressToken."""
    heard: list[tuple[float, float | None, str | None]] = []
    progress_heard = asyncio.Event()

    async def reports_progress(args: dict[str, Any], ctx: ToolContext) -> dict[str, bool]:
        await ctx.report_progress(1, 2, "half way")
        await asyncio.wait_for(progress_heard.wait(), 10)
        return {"done": True}

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        heard.append((progress, total, message))
        progress_heard.set()

    host = ToolHost(system.bridge_target, "http-progress")
    host.on_tool("reports_progress", reports_progress, description="reports progress")
    await host.start()
    try:
        async with http_gateway(system) as base:
            clients = [legacy_client(base, "http-progress"), Client(f"{base}/sessions/http-progress/mcp")]
            for n, client in enumerate(clients):
                heard.clear()
                progress_heard.clear()
                async with client:
                    # Other arguments each time: an identical call would replay the first outcome.
                    result = await client.call_tool(
                        "reports_progress", {"n": n}, progress_callback=on_progress
                    )
                assert result.structured_content == {"done": True}
                assert heard == [(1.0, 2.0, "half way")]
    finally:
        await host.stop()
