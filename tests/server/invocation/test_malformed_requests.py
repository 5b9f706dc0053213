"""Messages that do not decode: a typed INVALID_REQUEST with ErrorInfo, one log line, open calls answered.

Raw bytes over real servers: a corrupt protobuf, and a string field (session
id, tool name, inside a nested message) that is not UTF-8.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.v1 import bridge_pb2, invocation_pb2
from toolmesh_testing import logged

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "malformed"
CORRUPT = b"\xff\xff\xff\xff"
# Field 1 (a string: session_id, or host_session_id) holding bytes that are not UTF-8.
NOT_UTF8 = b"\x0a\x02\xff\xfe"
REFUSED = "undecodable request refused"


class Held:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        self.started.set()
        await self.release.wait()
        return {"held": True}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system() -> AsyncIterator[tuple[LocalSystem, Held]]:
    system = await start_local_system()
    held = Held()
    host = ToolHost(system.bridge_target, SESSION)
    host.on_tool("held", held)
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(SESSION, [ToolSpec("held", "", '{"type": "object"}')])
    await host.start(timeout=5)
    yield system, held
    await host.stop()
    await system.stop(0.5)


def raw_unary(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    return channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)


def raw_stream(channel: grpc.aio.Channel, method: str) -> grpc.aio.StreamStreamMultiCallable[bytes, bytes]:
    return channel.stream_stream(method, request_serializer=bytes, response_deserializer=bytes)


def assert_invalid_request(error: grpc.aio.AioRpcError) -> None:
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert error_code(error) is Code.INVALID_REQUEST
    info = error_info(error)
    assert info is not None and info.domain == "toolmesh"
    assert "could not be decoded" in (error.details() or "")


UNARY = [
    ("invocation", "/toolmesh.v1.InvocationService/InvokeTool"),
    ("invocation", "/toolmesh.v1.InvocationService/ConfirmDelivery"),
    ("invocation", "/toolmesh.v1.InvocationService/GetInvocation"),
    ("bridge", "/toolmesh.v1.BridgeService/SubmitToolResult"),
    ("bridge", "/toolmesh.v1.BridgeService/DeclareHostTools"),
    ("bridge-internal", "/toolmesh.v1.BridgeService/DispatchToolRequest"),
    ("registry", "/toolmesh.v1.RegistryService/PutTools"),
    ("registry", "/toolmesh.v1.RegistryService/GetTool"),
    ("registry", "/toolmesh.v1.RegistryService/ListTools"),
    ("registry", "/grpc.health.v1.Health/Check"),
]


def target(system: LocalSystem, service: str) -> str:
    return {
        "invocation": system.invocation_target,
        "bridge": system.bridge_target,
        "bridge-internal": system.bridge_internal_target,
        "registry": system.registry_target,
    }[service]


@pytest.mark.parametrize(("service", "method"), UNARY)
@pytest.mark.parametrize("payload", [CORRUPT, NOT_UTF8], ids=["corrupt", "not-utf8"])
async def test_a_unary_request_that_does_not_decode_is_invalid_request(
    system: tuple[LocalSystem, Held], service: str, method: str, payload: bytes
) -> None:
    async with grpc.aio.insecure_channel(target(system[0], service)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await raw_unary(channel, method)(payload, timeout=5)
    assert_invalid_request(raised.value)


@pytest.mark.parametrize(
    ("service", "method"),
    [
        ("bridge", "/toolmesh.v1.BridgeService/OpenHostSession"),
        ("registry", "/toolmesh.v1.RegistryService/WatchTools"),
    ],
)
async def test_a_server_stream_whose_request_does_not_decode_is_invalid_request(
    system: tuple[LocalSystem, Held], service: str, method: str
) -> None:
    async with grpc.aio.insecure_channel(target(system[0], service)) as channel:
        call = channel.unary_stream(method, request_serializer=bytes, response_deserializer=bytes)(NOT_UTF8)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in call:
                pass
    assert_invalid_request(raised.value)


async def test_a_reflection_stream_message_that_does_not_decode_is_invalid_request(
    system: tuple[LocalSystem, Held],
) -> None:
    method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    async with grpc.aio.insecure_channel(system[0].bridge_target) as channel:
        stream = raw_stream(channel, method)()
        await stream.write(CORRUPT)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stream:
                pass
    assert_invalid_request(raised.value)


async def test_a_flood_of_them_writes_one_warning_and_no_traceback(
    system: tuple[LocalSystem, Held], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    method = "/toolmesh.v1.RegistryService/ListTools"
    async with grpc.aio.insecure_channel(system[0].registry_target) as channel:
        for _ in range(200):
            with pytest.raises(grpc.aio.AioRpcError):
                await raw_unary(channel, method)(CORRUPT, timeout=5)
    assert logged(caplog.records, REFUSED) <= 1
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert not [record for record in caplog.records if record.exc_info]


def call_message(call_id: int, tool: str) -> bytes:
    # Arguments of its own: an identical earlier call's unconfirmed outcome would replay.
    arguments = json.dumps({"call": uuid.uuid4().hex})
    request = invocation_pb2.InvokeToolRequest(
        session_id=SESSION, turn_id="t", tool_name=tool, arguments_json=arguments
    )
    return invocation_pb2.InvokeToolsRequest(
        calls=[invocation_pb2.StreamedToolCall(call_id=call_id, request=request)]
    ).SerializeToString()


# An InvokeToolsRequest whose one call's tool name is not UTF-8: the whole message fails to decode.
NESTED_NOT_UTF8 = call_message(2, "held").replace(b"held", b"h\xffld")


@pytest.mark.parametrize("bad", [CORRUPT, NESTED_NOT_UTF8], ids=["corrupt", "nested-not-utf8"])
async def test_a_stream_message_that_does_not_decode_ends_the_stream_after_open_calls_are_answered(
    system: tuple[LocalSystem, Held], bad: bytes
) -> None:
    local, held = system
    held.started.clear()
    async with grpc.aio.insecure_channel(local.invocation_target) as channel:
        stream = raw_stream(channel, "/toolmesh.v1.InvocationService/InvokeTools")()
        await stream.write(call_message(1, "held"))
        await held.started.wait()
        await stream.write(bad)
        await stream.write(call_message(3, "held"))  # after the bad one: not taken
        held.release.set()
        answered: list[invocation_pb2.StreamedToolResult] = []
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for raw in stream:
                answered += invocation_pb2.InvokeToolsResponse.FromString(raw).results
        held.release.clear()
    assert [result.call_id for result in answered] == [1]
    assert json.loads(answered[0].response.outcome.result_json) == {"held": True}
    assert_invalid_request(raised.value)


async def test_a_dispatch_stream_message_that_does_not_decode_ends_it_after_open_requests(
    system: tuple[LocalSystem, Held],
) -> None:
    local, held = system
    held.started.clear()
    request = bridge_pb2.ToolRequest(
        session_id=SESSION,
        turn_id="t",
        tool_request_id=f"tr_{uuid.uuid4().hex}",
        tool_name="held",
        arguments_json="{}",
        timeout_ms=10_000,
    )
    good = bridge_pb2.DispatchToolRequestsRequest(requests=[request]).SerializeToString()
    async with grpc.aio.insecure_channel(local.bridge_internal_target) as channel:
        stream = raw_stream(channel, "/toolmesh.v1.BridgeService/DispatchToolRequests")()
        await stream.write(good)
        await held.started.wait()
        await stream.write(NOT_UTF8)
        held.release.set()
        answered: list[bridge_pb2.DispatchResult] = []
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for raw in stream:
                answered += bridge_pb2.DispatchToolRequestsResponse.FromString(raw).results
        held.release.clear()
    assert [result.tool_request_id for result in answered] == [request.tool_request_id]
    assert json.loads(answered[0].outcome.result_json) == {"held": True}
    assert_invalid_request(raised.value)
