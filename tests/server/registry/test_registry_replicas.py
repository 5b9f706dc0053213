"""Two registry servers on one Redis: one set of tools, one revision sequence, every watch told."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_registry
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import open_stores
from toolmesh.v1 import registry_pb2, registry_pb2_grpc, tool_pb2

pytestmark = pytest.mark.integration


# Two RegistryService stubs (typed Any, as grpcio's aio stubs are in the stubs' types only).
Replicas = tuple[Any, Any]


@pytest_asyncio.fixture
async def replicas() -> AsyncIterator[Replicas]:
    prefix = new_prefix()
    servers: list[RunningServer] = [
        await start_registry(stores=open_stores(SHARED_URL, prefix)) for _ in range(2)
    ]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") for server in servers]
    yield (
        registry_pb2_grpc.RegistryServiceStub(channels[0]),
        registry_pb2_grpc.RegistryServiceStub(channels[1]),
    )
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0.1)
    await delete_prefixed(SHARED_URL, prefix)


def tool(name: str) -> tool_pb2.ToolDefinition:
    return tool_pb2.ToolDefinition(name=name, input_schema_json=json.dumps({"type": "object"}))


async def put(stub: Any, session: str, *names: str) -> int:
    request = registry_pb2.PutToolsRequest(session_id=session, tools=[tool(name) for name in names])
    return int((await stub.PutTools(request)).revision)


async def test_a_put_on_one_replica_is_seen_on_the_other_at_once(
    replicas: Replicas,
) -> None:
    one, other = replicas
    revision = await put(one, "s", "a", "b")
    listed = await other.ListTools(registry_pb2.ListToolsRequest(session_id="s"))
    assert listed.revision == revision and [t.name for t in listed.tools] == ["a", "b"]
    got = await other.GetTool(registry_pb2.GetToolRequest(session_id="s", name="b"))
    assert got.revision == revision and got.tool.name == "b"
    # An edit guarded by the revision read on the other replica.
    request = registry_pb2.PutToolsRequest(session_id="s", tools=[tool("c")], expected_revision=revision)
    assert (await other.PutTools(request)).revision == revision + 1
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await one.PutTools(request)
    assert raised.value.code() is grpc.StatusCode.ABORTED


async def test_every_watch_sees_a_put_made_on_either_replica(
    replicas: Replicas,
) -> None:
    one, other = replicas
    watches = [stub.WatchTools(registry_pb2.WatchToolsRequest(session_id="w")) for stub in replicas]
    for watch in watches:
        first = await asyncio.wait_for(watch.read(), 5)
        assert isinstance(first, registry_pb2.WatchToolsResponse) and first.revision == 0
    for writer, names in ((one, ["a"]), (other, ["a", "b"])):
        revision = await put(writer, "w", *names)
        for watch in watches:
            seen = await asyncio.wait_for(watch.read(), 5)
            assert isinstance(seen, registry_pb2.WatchToolsResponse)
            assert seen.revision == revision and [t.name for t in seen.tools] == names
    for watch in watches:
        watch.cancel()


async def test_concurrent_puts_on_both_replicas_get_one_sequence(
    replicas: Replicas,
) -> None:
    revisions = await asyncio.gather(
        *(put(replicas[index % 2], "race", f"tool_{index}") for index in range(20))
    )
    assert sorted(revisions) == list(range(1, 21))
    listed = await replicas[1].ListTools(registry_pb2.ListToolsRequest(session_id="race"))
    assert listed.revision == 20
