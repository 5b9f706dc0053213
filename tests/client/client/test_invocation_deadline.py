"""InvocationClient sends its caller's deadline with each call (InvokeToolRequest.deadline_unix_ms),
so that a service that reads the call late never begins it. A scripted InvocationService on a real
port records what it is sent."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.client import InvocationClient
from toolmesh.v1 import invocation_pb2, tool_pb2

pytestmark = pytest.mark.integration

INVOKE = "/toolmesh.v1.InvocationService/InvokeTool"


@pytest_asyncio.fixture
async def recorded() -> AsyncIterator[tuple[str, list[invocation_pb2.InvokeToolRequest]]]:
    """The target of a server whose InvokeTool records each request and answers it with {}."""
    requests: list[invocation_pb2.InvokeToolRequest] = []

    async def invoke(
        request: invocation_pb2.InvokeToolRequest, context: Any
    ) -> invocation_pb2.InvokeToolResponse:
        requests.append(request)
        outcome = tool_pb2.ToolOutcome(result_json="{}")
        return invocation_pb2.InvokeToolResponse(tool_request_id="tr_" + "0" * 32, outcome=outcome)

    handler = grpc.unary_unary_rpc_method_handler(
        invoke,
        request_deserializer=invocation_pb2.InvokeToolRequest.FromString,
        response_serializer=invocation_pb2.InvokeToolResponse.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("toolmesh.v1.InvocationService", {"InvokeTool": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", requests
    finally:
        await server.stop(0)


async def test_a_call_with_a_timeout_carries_its_deadline_and_one_without_none(
    recorded: tuple[str, list[invocation_pb2.InvokeToolRequest]],
) -> None:
    target, requests = recorded
    async with InvocationClient(target) as client:
        before = time.time()
        timed = await client.invoke("s", "echo", {}, turn_id="t", timeout=5, confirm_delivery=False)
        after = time.time()
        untimed = await client.invoke("s", "echo", {}, turn_id="t", confirm_delivery=False)
    assert timed.outcome is not None and untimed.outcome is not None
    first, second = requests
    assert (before + 5) * 1000 <= first.deadline_unix_ms <= (after + 5) * 1000 + 1
    assert second.deadline_unix_ms == 0
