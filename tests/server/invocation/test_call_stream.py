"""InvokeTools: many calls on one stream, over real servers and a real host session.

The raw stub shows the contract (call ids, batches, per-call errors, the end
of the stream); InvocationClient(multiplex=True) shows what callers get.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.rpcstatus import error_code, grpc_code
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc
from toolmesh_testing import eventually, logged, start_service_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "streamed"
OBJECT = '{"type":"object"}'
JOINED = "joined a running invocation"  # what the invocation service logs for each call that joins


class Counted:
    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()
        self._ran = asyncio.Condition()

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        self.runs += 1
        async with self._ran:
            self._ran.notify_all()
        await self.release.wait()
        return {"runs": self.runs}

    async def ran_past(self, runs: int) -> None:
        """Wait until the handler has run more than `runs` times."""
        async with self._ran:
            await asyncio.wait_for(self._ran.wait_for(lambda: self.runs > runs), 5)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system() -> AsyncIterator[tuple[LocalSystem, Counted]]:
    system = await start_local_system()
    counted = Counted()
    host = ToolHost(system.bridge_target, SESSION)
    host.on_tool("echo", lambda args, ctx: args)
    host.on_tool("counted", counted)
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(SESSION, [ToolSpec("echo", "", OBJECT), ToolSpec("counted", "", OBJECT)])
    await host.start(timeout=5)
    yield system, counted
    await host.stop()
    for server in system.servers:
        await server.stop(0)


async def read(
    stream: grpc.aio.StreamStreamCall[invocation_pb2.InvokeToolsRequest, invocation_pb2.InvokeToolsResponse],
) -> invocation_pb2.InvokeToolsResponse:
    """The stream's next response (not its end)."""
    response = await stream.read()
    assert isinstance(response, invocation_pb2.InvokeToolsResponse), response
    return response


def streamed(call_id: int, tool: str = "echo", session: str = SESSION, **args: Any) -> Any:
    request = invocation_pb2.InvokeToolRequest(
        session_id=session, turn_id="turn", tool_name=tool, arguments_json=json.dumps(args)
    )
    return invocation_pb2.StreamedToolCall(call_id=call_id, request=request)


async def test_calls_in_one_message_each_get_their_result(system: tuple[LocalSystem, Counted]) -> None:
    async with grpc.aio.insecure_channel(system[0].invocation_target) as channel:
        stream = invocation_pb2_grpc.InvocationServiceStub(channel).InvokeTools()
        calls = [streamed(1, n=1), streamed(2, session="bad session!"), streamed(3, n=3)]
        await stream.write(invocation_pb2.InvokeToolsRequest(calls=calls))
        await stream.done_writing()
        results = {}
        async for response in stream:
            results.update({result.call_id: result for result in response.results})
    assert set(results) == {1, 2, 3}  # then the stream ended: every call was answered
    for call_id in (1, 3):
        assert json.loads(results[call_id].response.outcome.result_json) == {"n": call_id}
    refused = results[2].error
    assert refused.reason == "INVALID_REQUEST" and "session_id" in refused.message
    assert refused.metadata["field"] == "session_id"


async def test_a_call_id_still_open_is_refused_alone(system: tuple[LocalSystem, Counted]) -> None:
    _, counted = system
    async with grpc.aio.insecure_channel(system[0].invocation_target) as channel:
        stream = invocation_pb2_grpc.InvocationServiceStub(channel).InvokeTools()
        await stream.write(invocation_pb2.InvokeToolsRequest(calls=[streamed(7, "counted", key="open")]))
        await stream.write(invocation_pb2.InvokeToolsRequest(calls=[streamed(7, n=0)]))
        refusal = await read(stream)
        # Apart from the results: it is not the open call's result.
        assert list(refusal.results) == []
        duplicate = refusal.refused_duplicates[0]
        assert duplicate.call_id == 7 and duplicate.error.reason == "INVALID_REQUEST"
        assert duplicate.error.metadata["callId"] == "7"
        counted.release.set()
        answered = (await read(stream)).results[0]
        assert answered.call_id == 7 and answered.response.outcome.result_json
        counted.release.clear()
        stream.cancel()


async def test_identical_calls_on_the_stream_run_once(
    system: tuple[LocalSystem, Counted], caplog: pytest.LogCaptureFixture
) -> None:
    _, counted = system
    before = counted.runs
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    async with InvocationClient(system[0].invocation_target, multiplex=True) as client:
        calls = [client.invoke(SESSION, "counted", {"key": "storm"}, turn_id="turn") for _ in range(50)]
        pending = asyncio.gather(*calls)
        await eventually(lambda: logged(caplog.records, JOINED) == 49)  # one runs, the others wait on it
        counted.release.set()
        results = await pending
        counted.release.clear()
    assert counted.runs == before + 1
    assert len({result.tool_request_id for result in results}) == 1
    assert sum(result.joined for result in results) == 49


async def test_a_reused_idempotency_key_raises_as_on_a_unary_call(
    system: tuple[LocalSystem, Counted],
) -> None:
    async with InvocationClient(system[0].invocation_target, multiplex=True) as client:
        first = await client.invoke(SESSION, "echo", {"n": 1}, turn_id="turn", idempotency_key="key-1")
        assert first.outcome is not None and first.outcome.ok
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.invoke(SESSION, "echo", {"n": 2}, turn_id="turn", idempotency_key="key-1")
    assert raised.value.code() is grpc_code(ERROR_TABLE[Code.IDEMPOTENCY_KEY_REUSED].status)
    assert error_code(raised.value) is Code.IDEMPOTENCY_KEY_REUSED


async def test_a_caller_that_leaves_is_joined_by_its_retry(
    system: tuple[LocalSystem, Counted], caplog: pytest.LogCaptureFixture
) -> None:
    _, counted = system
    before = counted.runs
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    async with InvocationClient(system[0].invocation_target, multiplex=True) as client:
        gone = await client.invoke(SESSION, "counted", {"key": "left"}, turn_id="turn", timeout=0.2)
        assert gone.outcome is None and gone.code is Code.CALLER_DEADLINE_EXCEEDED
        retry = asyncio.ensure_future(client.invoke(SESSION, "counted", {"key": "left"}, turn_id="turn"))
        await eventually(lambda: logged(caplog.records, JOINED) == 1)
        counted.release.set()
        joined = await retry
        counted.release.clear()
    assert joined.joined and joined.outcome is not None and joined.outcome.ok
    assert counted.runs == before + 1


async def test_a_broken_stream_fails_its_calls_and_the_next_call_reconnects(
    system: tuple[LocalSystem, Counted],
) -> None:
    local, counted = system
    ports: dict[str, int] = {}  # bound on the first start, kept for the restart
    args = ["--registry", local.registry_internal_target, "--bridge", local.bridge_internal_target]
    invocation = await start_service_process("invocation", *args, ports=ports)
    before = counted.runs
    try:
        async with InvocationClient(invocation.target, multiplex=True) as client:
            held = asyncio.ensure_future(client.invoke(SESSION, "counted", {"key": "broken"}, turn_id="turn"))
            await counted.ran_past(before)  # the call is held on the stream
            invocation.process.kill()  # gone without a word: the stream breaks under the held call
            await invocation.stop()
            broken = await asyncio.wait_for(held, 5)
            assert broken.outcome is None and broken.code is Code.TRANSPORT_FAILED
            assert broken.to_json()["error"]["retryable"] is True
            invocation = await start_service_process("invocation", *args, ports=ports)
            answered = await client.invoke(SESSION, "echo", {"again": True}, turn_id="turn")
            assert answered.outcome is not None and answered.outcome.result_json == '{"again":true}'
    finally:
        counted.release.set()
        await invocation.stop()
        counted.release.clear()


async def test_calls_go_on_when_their_stream_ends_and_a_retry_joins(
    system: tuple[LocalSystem, Counted], caplog: pytest.LogCaptureFixture
) -> None:
    local, counted = system
    before = counted.runs
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    async with grpc.aio.insecure_channel(local.invocation_target) as channel:
        stream = invocation_pb2_grpc.InvocationServiceStub(channel).InvokeTools()
        await stream.write(invocation_pb2.InvokeToolsRequest(calls=[streamed(1, "counted", key="orphan")]))
        await counted.ran_past(before)
        stream.cancel()
    async with InvocationClient(local.invocation_target) as client:
        retry = asyncio.ensure_future(client.invoke(SESSION, "counted", {"key": "orphan"}, turn_id="turn"))
        await eventually(lambda: logged(caplog.records, JOINED) == 1)
        counted.release.set()
        joined = await retry
        counted.release.clear()
    assert joined.joined and joined.outcome is not None and joined.outcome.ok
    assert counted.runs == before + 1


async def test_oversized_arguments_fail_alone_and_the_stream_goes_on(
    system: tuple[LocalSystem, Counted],
) -> None:
    _, counted = system
    before = counted.runs
    async with InvocationClient(system[0].invocation_target, multiplex=True) as client:
        held = asyncio.ensure_future(
            client.invoke(SESSION, "counted", {"key": "beside-huge"}, turn_id="turn")
        )
        await counted.ran_past(before)
        too_large = await client.invoke(SESSION, "echo", {"blob": "x" * (2 * 1024 * 1024)}, turn_id="turn")
        huge = await client.invoke(SESSION, "echo", {"blob": "x" * (5 * 1024 * 1024)}, turn_id="turn")
        counted.release.set()
        beside = await held
        counted.release.clear()
    assert too_large.outcome is not None and too_large.outcome.code == "TOOL_ARGS_INVALID"
    assert huge.outcome is None and huge.code is Code.TRANSPORT_FAILED  # larger than any message may be
    # The call open on the stream meanwhile was not hurt.
    assert beside.outcome is not None and beside.outcome.ok, beside
