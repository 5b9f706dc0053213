"""RegistryService over a real server: lists, revisions, watch, and every refusal."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import start_registry
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.runtime.server import RunningServer
from toolmesh.v1 import registry_pb2, registry_pb2_grpc, tool_pb2

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def registry() -> AsyncIterator[registry_pb2_grpc.RegistryServiceStub]:
    server: RunningServer = await start_registry()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield registry_pb2_grpc.RegistryServiceStub(channel)
    await server.stop(0.1)


def tool(name: str = "t", schema: Any = None, **fields: Any) -> tool_pb2.ToolDefinition:
    text = schema if isinstance(schema, str) else json.dumps({"type": "object"} if schema is None else schema)
    return tool_pb2.ToolDefinition(name=name, input_schema_json=text, **fields)


async def put(stub: Any, session: str, *tools: tool_pb2.ToolDefinition, **kw: Any) -> int:
    response = await stub.PutTools(registry_pb2.PutToolsRequest(session_id=session, tools=tools, **kw))
    return int(response.revision)


async def refused(
    stub: Any, session: str, *tools: tool_pb2.ToolDefinition, **kw: Any
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await put(stub, session, *tools, **kw)
    return raised.value


async def test_put_list_get_and_revisions(registry: Any) -> None:
    assert (await registry.ListTools(registry_pb2.ListToolsRequest(session_id="r1"))).revision == 0
    first = await put(registry, "r1", tool("a", description="A"), tool("b", timeout_ms=1500))
    listed = await registry.ListTools(registry_pb2.ListToolsRequest(session_id="r1"))
    assert listed.revision == first >= 1
    assert [t.name for t in listed.tools] == ["a", "b"]
    got = await registry.GetTool(registry_pb2.GetToolRequest(session_id="r1", name="b"))
    assert got.tool.timeout_ms == 1500 and got.revision == first
    # Replacing with the same list changes nothing; a different list moves the revision.
    assert await put(registry, "r1", tool("a", description="A"), tool("b", timeout_ms=1500)) == first
    assert await put(registry, "r1", tool("a", description="A2")) > first


async def test_get_unknown_tool_is_not_found(registry: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await registry.GetTool(registry_pb2.GetToolRequest(session_id="r2", name="missing"))
    assert raised.value.code() is grpc.StatusCode.NOT_FOUND
    info = error_info(raised.value)
    assert info is not None and info.reason == "TOOL_NOT_FOUND" and info.domain == "toolmesh"
    assert dict(info.metadata) == {"sessionId": "r2", "tool": "missing"}


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ("[]", "is not a JSON object"),
        ("true", "is not a JSON object"),
        ("{not json", "is not JSON"),
        ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "object"}, "unsupported dialect"),
        (
            {"$schema": "https://json-schema.org/draft/2019-09/schema", "type": "object"},
            "unsupported dialect",
        ),
        ({"type": "object", "properties": {"a": {"type": 5}}}, "not a valid schema"),
        ({"type": "string"}, "must describe an object"),
    ],
)
async def test_bad_input_schema_is_invalid_schema(registry: Any, schema: Any, needle: str) -> None:
    error = await refused(registry, "r3", tool("ok"), tool("bad", schema))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error_code(error) is Code.INVALID_SCHEMA
    assert needle in (error.details() or "")
    info = error_info(error)
    assert info is not None and info.metadata["tool"] == "bad"
    # Nothing of the refused list was stored.
    assert (await registry.ListTools(registry_pb2.ListToolsRequest(session_id="r3"))).revision == 0


@pytest.mark.parametrize(
    "dialect",
    ["https://json-schema.org/draft/2020-12/schema", "http://json-schema.org/draft-07/schema#", None],
)
async def test_supported_dialects_are_accepted(registry: Any, dialect: str | None) -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    if dialect:
        schema["$schema"] = dialect
    assert await put(registry, f"r4-{len(dialect or '')}", tool("t", schema)) >= 1


async def test_bad_output_schema_is_invalid_schema(registry: Any) -> None:
    error = await refused(registry, "r5", tool("t", output_schema_json='{"type": 12}'))
    assert error_code(error) is Code.INVALID_SCHEMA
    assert "outputSchema" in (error.details() or "")


@pytest.mark.parametrize("name", ["", "has space", "x" * 129, "slash/name", "ümlaut"])
async def test_bad_tool_names_are_refused(registry: Any, name: str) -> None:
    error = await refused(registry, "r6", tool(name))
    assert error_code(error) is Code.INVALID_REQUEST


async def test_duplicate_names_and_bad_timeouts_are_refused(registry: Any) -> None:
    assert error_code(await refused(registry, "r7", tool("a"), tool("a"))) is Code.INVALID_REQUEST
    assert error_code(await refused(registry, "r7", tool("a", timeout_ms=16 * 60_000))) is Code.INVALID_SCHEMA


async def test_expected_revision_guards_concurrent_edits(registry: Any) -> None:
    revision = await put(registry, "r8", tool("a"))
    assert await put(registry, "r8", tool("b"), expected_revision=revision) > revision
    error = await refused(registry, "r8", tool("c"), expected_revision=revision)
    assert error.code() is grpc.StatusCode.ABORTED
    assert error_code(error) is Code.REVISION_CONFLICT


async def test_bad_session_id_is_invalid_request(registry: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await registry.ListTools(registry_pb2.ListToolsRequest(session_id=""))
    assert error_code(raised.value) is Code.INVALID_REQUEST


async def test_watch_streams_each_revision(registry: Any) -> None:
    stream = registry.WatchTools(registry_pb2.WatchToolsRequest(session_id="r9"))
    first = await asyncio.wait_for(stream.read(), 5)
    assert first.revision == 0 and list(first.tools) == []
    revision = await put(registry, "r9", tool("a"))
    second = await asyncio.wait_for(stream.read(), 5)
    assert second.revision == revision and [t.name for t in second.tools] == ["a"]
    revision = await put(registry, "r9", tool("a"), tool("b"))
    third = await asyncio.wait_for(stream.read(), 5)
    assert third.revision == revision and len(third.tools) == 2
    stream.cancel()


async def test_schema_with_a_remote_ref_is_refused_not_fetched(registry: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:1/never-fetched.json"}}}
    error = await refused(registry, "r10", tool("t", schema))
    assert error_code(error) is Code.INVALID_SCHEMA
    assert "cannot be used" in (error.details() or "")
