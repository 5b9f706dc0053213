"""A call read past its caller's deadline never becomes an invocation (InvokeToolRequest.deadline_unix_ms).

An invocation replica SIGSTOPped with a call it had taken in ran it, when let go, after its caller
had given up: `bench.chaos` seed 7 saw the tool run twice so, the caller's exact retry having run
and confirmed its delivery meanwhile (a confirmed outcome is not replayed: an identical call runs
anew). gRPC's own deadline cannot fence it: it is relative, and a paused process does not look.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.limits import CALLER_DEADLINE_SLACK_MS
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc

pytestmark = pytest.mark.integration

SESSION = "late-calls"


@pytest_asyncio.fixture
async def served() -> AsyncIterator[tuple[LocalSystem, list[int]]]:
    """The services in this process, and a host whose `write` tool notes each `n` it runs."""
    system = await start_local_system(heartbeat_s=0.5)
    ran: list[int] = []

    async def write(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        ran.append(args["n"])
        return {"n": args["n"]}

    host = ToolHost(system.bridge_target, SESSION)
    host.on_tool("write", write)
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(SESSION, [ToolSpec("write", "", '{"type":"object"}')])
    await host.start(timeout=10)
    try:
        yield system, ran
    finally:
        await host.stop()
        await system.stop(grace=0.5)


def call(n: int, deadline_unix_ms: int) -> invocation_pb2.InvokeToolRequest:
    return invocation_pb2.InvokeToolRequest(
        session_id=SESSION,
        turn_id="t",
        tool_name="write",
        arguments_json=f'{{"n": {n}}}',
        deadline_unix_ms=deadline_unix_ms,
    )


async def test_a_call_past_its_callers_deadline_is_refused_and_nothing_runs(
    served: tuple[LocalSystem, list[int]],
) -> None:
    system, ran = served
    now_ms = round(time.time() * 1000)
    async with grpc.aio.insecure_channel(system.invocation_target) as channel:
        stub = invocation_pb2_grpc.InvocationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stub.InvokeTool(call(1, now_ms - CALLER_DEADLINE_SLACK_MS - 1_000))
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert error_code(late.value) is Code.CALLER_DEADLINE_EXCEEDED
        # Within the slack (clocks that disagree a little), ahead, or none: each runs.
        for n, deadline in ((2, now_ms - CALLER_DEADLINE_SLACK_MS // 2), (3, now_ms + 10_000), (4, 0)):
            answered = await stub.InvokeTool(call(n, deadline))
            assert answered.outcome.result_json == f'{{"n":{n}}}'
        # The refused call left nothing behind: the identical call runs anew, not joined or replayed.
        fresh = await stub.InvokeTool(call(1, 0))
        assert not fresh.joined and not fresh.replayed
    assert ran == [2, 3, 4, 1]
