"""What one stream may cost a service: calls per message, and results its caller has not read.

The unit tests drive the invocation service's end of an InvokeTools stream
(CallStream) with a real Invoker whose registry and bridge are stand-ins; the
integration tests send raw messages to real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.contracts.ledger import Ledger
from toolmesh.core.calls import ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE, UNREAD_RESULTS_MAX_BYTES
from toolmesh.core.outcome import Outcome
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.invocation.call_stream import CallStream
from toolmesh.invocation.invoker import Invoker
from toolmesh.store.memory import MemoryLedgerStore
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, invocation_pb2, invocation_pb2_grpc
from toolmesh_testing import eventually, logged

SESSION = "bounded"


def streamed(call_id: int, tool: str = "echo", **args: Any) -> invocation_pb2.StreamedToolCall:
    request = invocation_pb2.InvokeToolRequest(
        session_id=SESSION, turn_id="t", tool_name=tool, arguments_json=json.dumps(args)
    )
    return invocation_pb2.StreamedToolCall(call_id=call_id, request=request)


# -- the invocation service's end alone ------------------------------------------------------


class AnyTool:
    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        return ToolSpec(name, "", '{"type": "object"}')


class KiloHost:
    """Stands in for the bridge: every call gets a result of about 1 KB at once."""

    def __init__(self) -> None:
        self.runs = 0

    async def dispatch(self, request: ToolRequest, on_progress: object = None) -> Outcome:
        self.runs += 1
        return Outcome.success(json.dumps({"pad": "x" * 1000}))


async def until_idle() -> None:
    """Run the event loop until nothing is ready to run (what would move, has moved)."""
    for _ in range(200):
        await asyncio.sleep(0)


@pytest.mark.unit
async def test_a_stream_whose_results_go_unread_takes_no_more_calls_until_they_are() -> None:
    host = KiloHost()
    stream = CallStream(Invoker(AnyTool(), host, Ledger(MemoryLedgerStore())), pause_bytes=20_000)
    pulled = 0

    async def messages() -> AsyncIterator[invocation_pb2.InvokeToolsRequest]:
        nonlocal pulled
        for batch in range(100):
            pulled += 1
            calls = [streamed(batch * 10 + n, n=batch * 10 + n) for n in range(10)]
            yield invocation_pb2.InvokeToolsRequest(calls=calls)

    reader = asyncio.create_task(stream.read(messages()))
    await until_idle()
    # About 20 KB of results waiting (20 calls of 1 KB) and it stops, far from all 1,000.
    assert 2 <= pulled <= 4 and host.runs <= 40, (pulled, host.runs)
    answered = 0
    async for response in stream.responses():  # the caller reads: the rest follows
        answered += len(response.results)
    await reader
    assert (pulled, host.runs, answered) == (100, 1000, 1000)


@pytest.mark.unit
async def test_results_piling_up_beyond_the_cap_end_the_stream_with_results_not_read() -> None:
    release = asyncio.Event()

    class HeldHost(KiloHost):
        entered = 0

        async def dispatch(self, request: ToolRequest, on_progress: object = None) -> Outcome:
            self.entered += 1
            await release.wait()
            return await super().dispatch(request)

    host = HeldHost()
    invoker = Invoker(AnyTool(), host, Ledger(MemoryLedgerStore()))
    stream = CallStream(invoker, pause_bytes=20_000, max_bytes=100_000)

    async def messages() -> AsyncIterator[invocation_pb2.InvokeToolsRequest]:
        yield invocation_pb2.InvokeToolsRequest(calls=[streamed(n, n=n) for n in range(300)])
        await asyncio.Event().wait()  # the caller keeps the stream open

    reader = asyncio.create_task(stream.read(messages()))
    await eventually(lambda: host.entered == 300)
    release.set()  # 300 KB of results at once, none read
    await eventually(lambda: host.runs == 300)
    with pytest.raises(ToolmeshError) as raised:
        async for _ in stream.responses():
            pass
    assert raised.value.code is Code.RESULTS_NOT_READ and raised.value.retryable
    reader.cancel()  # as the stream's end does
    with contextlib.suppress(asyncio.CancelledError):
        await reader


# -- real servers ------------------------------------------------------------------------------


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
    host.on_tool("echo", lambda args, ctx: args)
    host.on_tool("large", lambda args, ctx: {"id": args["id"], "pad": "x" * 100_000})
    tools = [ToolSpec(name, "", '{"type": "object"}') for name in ("held", "echo", "large")]
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(SESSION, tools)
    await host.start(timeout=5)
    yield system, held
    await host.stop()
    await system.stop(0.5)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_a_message_with_too_many_calls_ends_the_stream_after_open_ones_are_answered(
    system: tuple[LocalSystem, Held],
) -> None:
    local, held = system
    held.started.clear()
    async with grpc.aio.insecure_channel(local.invocation_target) as channel:
        stream = invocation_pb2_grpc.InvocationServiceStub(channel).InvokeTools()
        await stream.write(
            invocation_pb2.InvokeToolsRequest(calls=[streamed(0, "held", key=uuid.uuid4().hex)])
        )
        await held.started.wait()
        too_many = [streamed(n, n=n) for n in range(1, MAX_CALLS_PER_MESSAGE + 2)]
        await stream.write(invocation_pb2.InvokeToolsRequest(calls=too_many))
        held.release.set()
        answered: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for response in stream:
                answered += [result.call_id for result in response.results]
        held.release.clear()
    assert answered == [0]  # the held call; none of the message's
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error_code(raised.value) is Code.INVALID_REQUEST
    assert f"At most {MAX_CALLS_PER_MESSAGE} calls per message" in (raised.value.details() or "")


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_a_dispatch_message_with_too_many_items_ends_the_stream(
    system: tuple[LocalSystem, Held],
) -> None:
    local, _ = system
    message = bridge_pb2.DispatchToolRequestsRequest(
        cancel_tool_request_ids=[f"tr_{n}" for n in range(MAX_CALLS_PER_MESSAGE + 1)]
    )
    async with grpc.aio.insecure_channel(local.bridge_internal_target) as channel:
        stream = bridge_pb2_grpc.BridgeServiceStub(channel).DispatchToolRequests()
        await stream.write(message)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stream:
                pass
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error_code(raised.value) is Code.INVALID_REQUEST


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_many_calls_at_once_travel_in_messages_within_the_limit(
    system: tuple[LocalSystem, Held],
) -> None:
    local, _ = system
    count = 3 * MAX_CALLS_PER_MESSAGE
    async with InvocationClient(local.invocation_target, multiplex=True) as client:
        results = await asyncio.gather(
            *(
                client.invoke(SESSION, "echo", {"n": n, "run": uuid.uuid4().hex}, turn_id="t")
                for n in range(count)
            )
        )
    assert all(result.outcome is not None and result.outcome.ok for result in results)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_a_caller_that_reads_nothing_gets_results_not_read_and_a_retry_replays(
    system: tuple[LocalSystem, Held], caplog: pytest.LogCaptureFixture
) -> None:
    local, _ = system
    run = uuid.uuid4().hex
    # Results of 100 KB each: the calls are all taken before any result exists, then pile up unread.
    # Three times the cap: the transport itself holds a few megabytes of what is sent.
    count = 3 * UNREAD_RESULTS_MAX_BYTES // 100_000
    calls = [streamed(n, "large", id=n, run=run) for n in range(count)]
    async with grpc.aio.insecure_channel(local.invocation_target) as channel:
        stream = invocation_pb2_grpc.InvocationServiceStub(channel).InvokeTools()
        await stream.write(invocation_pb2.InvokeToolsRequest(calls=calls))
        await eventually(lambda: logged(caplog.records, "stream results not read; dropped") == 1)
        got: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for response in stream:  # read only now: what the transport held, then the end
                got += [result.call_id for result in response.results]
    assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_code(raised.value) is Code.RESULTS_NOT_READ
    assert len(got) < count
    # Nothing is lost: the calls ran, and an exact retry of one that never came replays its outcome.
    missing = next(n for n in range(count) if n not in got)
    async with InvocationClient(local.invocation_target) as client:
        again = await client.invoke(SESSION, "large", {"id": missing, "run": run}, turn_id="t")
    assert again.replayed and again.outcome is not None and again.outcome.ok
