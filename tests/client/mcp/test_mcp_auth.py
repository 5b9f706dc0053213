"""Who may call the MCP gateway's HTTP endpoint: the caller's own token decides, at the services."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx2
import mcp_types as types
import pytest
import pytest_asyncio
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from mcp_testing import MCP_HEADERS, WaitsUntilCancelled, gateway_in_process, http_gateway, open_mcp_session
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.auth.grants import Role
from toolmesh.auth.tokens import SharedSecret, Verifier, mint
from toolmesh.host import ToolContext, ToolHost
from toolmesh.runtime.security import Security
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SECRET = b"mcp-gateway-test-secret-of-32-bytes!"
SESSION = "mcp-auth"


async def echo(args: dict[str, Any], ctx: ToolContext) -> Any:
    return args


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def secured() -> AsyncIterator[LocalSystem]:
    system = await start_local_system(
        heartbeat_s=0.5, security=Security(verifier=Verifier(SharedSecret(SECRET)))
    )
    host = ToolHost(
        system.bridge_target, SESSION, token=mint(SECRET, roles=[Role.HOST], sessions=[SESSION], ttl_s=600)
    )
    host.on_tool("echo", echo, description="echoes its arguments")
    await host.start()
    yield system
    await host.stop()
    await system.stop(grace=0.5)


@asynccontextmanager
async def client_with(base: str, token: str | None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        Client(streamable_http_client(f"{base}/sessions/{SESSION}/mcp", http_client=http)) as client,
    ):
        yield client


async def test_the_callers_token_passes_through(secured: LocalSystem) -> None:
    own = mint(SECRET, roles=[Role.CALL], sessions=[SESSION], ttl_s=600)
    other = mint(SECRET, roles=[Role.CALL], sessions=["another-session"], ttl_s=600)
    async with http_gateway(secured) as base:
        async with client_with(base, own) as client:
            assert [tool.name for tool in (await client.list_tools()).tools] == ["echo"]
            result = await client.call_tool("echo", {"x": 1})
            assert result.structured_content == {"x": 1}
        for token, code in ((other, "PERMISSION_DENIED"), (None, "UNAUTHENTICATED")):
            async with client_with(base, token) as client:
                with pytest.raises(MCPError) as listing:
                    await client.list_tools()
                assert listing.value.code == types.INVALID_REQUEST and listing.value.data["code"] == code
                with pytest.raises(MCPError) as calling:
                    await client.call_tool("echo", {"x": 1})
                assert calling.value.data["code"] == code


async def test_a_refused_caller_does_not_keep_list_changed_from_the_next(secured: LocalSystem) -> None:
    """The first caller of a session has another session's token; the next, its own, hears list_changed."""
    session = "mcp-auth-watch"
    other = mint(SECRET, roles=[Role.CALL], sessions=["another-session"], ttl_s=600)
    own = mint(SECRET, roles=[Role.CALL], sessions=[session], ttl_s=600)
    heard: list[str] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            heard.append(message.method)

    async with http_gateway(secured) as base:
        url = f"{base}/sessions/{session}/mcp"
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {other}"}) as http,
            Client(streamable_http_client(url, http_client=http), mode="legacy") as refused,
        ):
            with pytest.raises(MCPError):
                await refused.list_tools()
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {own}"}) as http,
            Client(
                streamable_http_client(url, http_client=http), mode="legacy", message_handler=on_message
            ) as client,
        ):
            assert (await client.list_tools()).tools == []
            host = ToolHost(
                secured.bridge_target,
                session,
                token=mint(SECRET, roles=[Role.HOST], sessions=[session], ttl_s=600),
            )
            host.on_tool("late", echo, description="arrives later")
            await host.start()
            try:
                await eventually(lambda: heard, timeout=10)
                assert [tool.name for tool in (await client.list_tools()).tools] == ["late"]
            finally:
                await host.stop()


@asynccontextmanager
async def legacy_client_with(
    base: str, session: str, token: str | None, **options: Any
) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        Client(
            streamable_http_client(f"{base}/sessions/{session}/mcp", http_client=http),
            mode="legacy",
            **options,
        ) as client,
    ):
        yield client


async def test_unauthenticated_mcp_sessions_pin_no_watch_and_hear_no_list_changed(
    secured: LocalSystem,
) -> None:
    """Finding 4: refused MCP sessions (no token, another session's token) keep no watch, even at the
    bound, and never join the watch of the session they name; the tenant's own session is served."""
    own = mint(SECRET, roles=[Role.CALL], sessions=[SESSION], ttl_s=600)
    other = mint(SECRET, roles=[Role.CALL], sessions=["another-session"], ttl_s=600)
    async with gateway_in_process(secured, max_watches=2) as (gateway, base), AsyncExitStack() as attackers:
        for n, token in enumerate((None, other, None, other)):
            client = await attackers.enter_async_context(legacy_client_with(base, f"pin-{n}", token))
            with pytest.raises(MCPError):
                await client.list_tools()
            with pytest.raises(MCPError):
                await client.call_tool("echo", {})
        assert gateway.watched_sessions == frozenset()
        for token in (None, other):
            snooper = await attackers.enter_async_context(legacy_client_with(base, SESSION, token))
            with pytest.raises(MCPError) as refused:
                await snooper.list_tools()
            assert refused.value.data["code"] in ("UNAUTHENTICATED", "PERMISSION_DENIED")
        assert gateway.watched_sessions == frozenset()
        async with legacy_client_with(base, SESSION, own) as tenant:
            assert [tool.name for tool in (await tenant.list_tools()).tools] == ["echo"]
            assert gateway.watched_sessions == {SESSION}
            assert gateway.hearing(SESSION) == 1


async def test_an_mcp_session_id_alone_neither_uses_nor_ends_the_session(
    secured: LocalSystem, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 8: the id is bound to the token that opened it; DELETE or POST with none or another is
    refused (403, typed), the victim's call goes on; the SDK's log line with the id is never written."""
    session = "mcp-auth-owned"
    own = mint(SECRET, roles=[Role.CALL], sessions=[session], ttl_s=600)
    other = mint(SECRET, roles=[Role.CALL], sessions=[session], ttl_s=600, subject="someone-else")
    waits = WaitsUntilCancelled()

    host = ToolHost(
        secured.bridge_target, session, token=mint(SECRET, roles=[Role.HOST], sessions=[session], ttl_s=600)
    )
    host.on_tool("waits", waits, description="waits until cancelled")
    await host.start()
    for name in ("mcp.server.streamable_http_manager", "mcp.server.streamable_http"):
        caplog.set_level(logging.DEBUG, logger=name)
    endpoint = f"/sessions/{session}/mcp"
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "waits", "arguments": {}}}
    try:
        async with (
            gateway_in_process(secured) as (_, base),
            httpx2.AsyncClient(headers={**MCP_HEADERS, "Authorization": f"Bearer {own}"}) as victim,
            httpx2.AsyncClient(headers=MCP_HEADERS) as attacker,
        ):
            session_id = await open_mcp_session(victim, f"{base}{endpoint}")
            calling = asyncio.create_task(victim.post(f"{base}{endpoint}", json=call, timeout=30))
            await asyncio.wait_for(waits.started.wait(), 10)
            for token, code in ((None, "UNAUTHENTICATED"), (other, "PERMISSION_DENIED")):
                headers = {"Mcp-Session-Id": session_id}
                if token is not None:
                    headers["Authorization"] = f"Bearer {token}"
                deleted = await attacker.delete(f"{base}{endpoint}", headers=headers)
                assert deleted.status_code == 403
                assert deleted.json()["error"]["data"] == {"code": code, "retryable": False}
                listed = await attacker.post(
                    f"{base}{endpoint}",
                    headers=headers,
                    json={"jsonrpc": "2.0", "id": 9, "method": "tools/list"},
                )
                assert listed.status_code == 403
            # The victim's session and call are untouched; its own DELETE ends them.
            listed = await victim.post(
                f"{base}{endpoint}", json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
            )
            assert listed.status_code == 200
            assert waits.stopped == []
            assert (await victim.delete(f"{base}{endpoint}")).status_code == 200
            assert await eventually(lambda: waits.stopped) == ["cancelled"]
            calling.cancel()
            await asyncio.gather(calling, return_exceptions=True)
    finally:
        await host.stop()
    assert session_id not in caplog.text
