"""Hosts declaring their tools (DeclareHostTools) over real servers, and the Python host SDK doing so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from toolmesh.assembly.system import LocalSystem, start_bridge, start_local_system, start_registry
from toolmesh.bridge.declarations import merge
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolAnnotations, ToolSet, ToolSpec
from toolmesh.core.wire import tool_to_pb
from toolmesh.host import ToolContext, ToolHost
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc
from toolmesh_testing import eventually

A = ToolSpec("a", "first", '{"type":"object"}')
B = ToolSpec("b", "second", '{"type":"object"}')
A2 = ToolSpec("a", "first, changed", '{"type":"object"}')


@pytest.mark.unit
def test_merge_replaces_by_name_in_place_adds_new_ones_and_drops_withdrawn() -> None:
    other = ToolSpec("other", "put by someone else")
    assert merge((A, other), {"a": A2, "b": B}, set()) == (A2, other, B)
    assert merge((A, other, B), {"b": B}, {"a"}) == (other, B)
    assert merge((other,), {}, {"a"}) == (other,)


@pytest.fixture
async def system() -> AsyncIterator[LocalSystem]:
    running = await start_local_system(heartbeat_s=0.3)
    yield running
    await running.stop(0.2)


async def open_host(stub: bridge_pb2_grpc.BridgeServiceAsyncStub, session: str) -> tuple[Any, str]:
    call = stub.OpenHostSession(bridge_pb2.OpenHostSessionRequest(session_id=session, host_name="t"))
    opened = await call.read()
    assert isinstance(opened, bridge_pb2.OpenHostSessionResponse), opened
    return call, opened.opened.host_session_id


async def listed(system: LocalSystem, session: str) -> ToolSet:
    async with RegistryClient(system.registry_target) as registry:
        return await registry.list_tools(session)


@pytest.mark.integration
async def test_declarations_merge_into_the_list_withdraw_and_stay_after_the_host_leaves(
    system: LocalSystem,
) -> None:
    other = ToolSpec("other", "put by an operator")
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools("s1", [other])
    async with grpc.aio.insecure_channel(system.bridge_target) as channel:
        stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        call, host_session_id = await open_host(stub, "s1")
        declared = await stub.DeclareHostTools(
            bridge_pb2.DeclareHostToolsRequest(
                host_session_id=host_session_id, tools=[tool_to_pb(A), tool_to_pb(B)]
            )
        )
        tools = await listed(system, "s1")
        assert tools.tools == (other, A, B) and declared.revision == tools.revision
        # The same declaration again changes nothing, so the revision stays.
        again = await stub.DeclareHostTools(
            bridge_pb2.DeclareHostToolsRequest(
                host_session_id=host_session_id, tools=[tool_to_pb(A), tool_to_pb(B)]
            )
        )
        assert again.revision == declared.revision
        # Leaving `b` out withdraws it; `a` changes in place.
        await stub.DeclareHostTools(
            bridge_pb2.DeclareHostToolsRequest(host_session_id=host_session_id, tools=[tool_to_pb(A2)])
        )
        assert (await listed(system, "s1")).tools == (other, A2)
        left = asyncio.Event()
        system.router.closed_hooks.append(lambda host: left.set())
        call.cancel()
        # The host left; its tool stays listed, and a call says no host serves it (nothing ran).
        await asyncio.wait_for(left.wait(), 5)
        assert not system.router.serves("s1")
        assert (await listed(system, "s1")).tools == (other, A2)
        async with InvocationClient(system.invocation_target) as client:
            result = await client.invoke("s1", "a", turn_id="t1", arguments_json="{}", timeout=5)
        assert result.outcome is not None and result.outcome.code == Code.TOOL_HOST_UNAVAILABLE.value


@pytest.mark.integration
async def test_refused_declarations(system: LocalSystem) -> None:
    async with grpc.aio.insecure_channel(system.bridge_target) as channel:
        stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.DeclareHostTools(bridge_pb2.DeclareHostToolsRequest(host_session_id="hs_nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert error_code(unknown.value) is Code.HOST_SESSION_UNKNOWN

        call, host_session_id = await open_host(stub, "s2")
        bad = ToolSpec("bad", "not an object schema", '{"type":"string"}')
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await stub.DeclareHostTools(
                bridge_pb2.DeclareHostToolsRequest(
                    host_session_id=host_session_id, tools=[tool_to_pb(A), tool_to_pb(bad)]
                )
            )
        assert error_code(invalid.value) is Code.INVALID_SCHEMA
        twice = [tool_to_pb(A), tool_to_pb(A2)]
        with pytest.raises(grpc.aio.AioRpcError) as duplicate:
            await stub.DeclareHostTools(
                bridge_pb2.DeclareHostToolsRequest(host_session_id=host_session_id, tools=twice)
            )
        assert error_code(duplicate.value) is Code.INVALID_REQUEST
        # Nothing was declared.
        assert (await listed(system, "s2")).revision == 0
        call.cancel()


@pytest.mark.integration
async def test_a_bridge_without_a_registry_refuses_declarations() -> None:
    bridge, _ = await start_bridge()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{bridge.port}") as channel:
            stub = bridge_pb2_grpc.BridgeServiceStub(channel)
            call, host_session_id = await open_host(stub, "s3")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.DeclareHostTools(
                    bridge_pb2.DeclareHostToolsRequest(host_session_id=host_session_id, tools=[tool_to_pb(A)])
                )
            assert error_code(refused.value) is Code.REGISTRY_UNAVAILABLE
            call.cancel()
    finally:
        await bridge.stop(0.2)


@pytest.mark.integration
async def test_the_python_host_declares_its_tools_and_they_come_back_after_a_registry_restart() -> None:
    registry = await start_registry("127.0.0.1:0")
    registry_target = f"127.0.0.1:{registry.port}"
    bridge, _ = await start_bridge(heartbeat_s=0.3, registry_target=registry_target)

    def echo(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        return {"echo": args}

    host = ToolHost(f"127.0.0.1:{bridge.port}", "py-declared")
    host.on_tool(
        "echo",
        echo,
        description="Echo the arguments.",
        input_schema={"type": "object", "properties": {"n": {"type": "integer"}}},
        annotations=ToolAnnotations(read_only=True),
    )
    host.on_tool("quiet", echo)  # served, not declared
    try:
        await host.start(timeout=10)
        async with RegistryClient(registry_target) as client:
            tools = await client.list_tools("py-declared")
        assert [tool.name for tool in tools.tools] == ["echo"]
        assert tools.tools[0].annotations.read_only
        assert json.loads(tools.tools[0].input_schema_json)["properties"] == {"n": {"type": "integer"}}

        await registry.stop(0.2)
        registry = await start_registry(registry_target)

        async def declared_again() -> ToolSet | None:
            async with RegistryClient(registry_target) as client:
                listed = await client.list_tools("py-declared")
            return listed if listed.tools else None

        tools = await eventually(declared_again)
        assert [tool.name for tool in tools.tools] == ["echo"]
    finally:
        await host.stop()
        await bridge.stop(0.2)
        await registry.stop(0.2)
