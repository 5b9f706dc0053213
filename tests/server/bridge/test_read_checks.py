"""Requests go to hosts that read their stream; a host that stops reading is taken for gone.

Real servers; hosts that hold their stream open and read nothing are raw
streams (one read, then none) and a real host process frozen with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.limits import READ_CHECK_TIMEOUT_MS
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, tool_pb2
from toolmesh_testing import eventually, start_host_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

OBJECT = '{"type": "object"}'


async def put(system: LocalSystem, session: str, tools: list[ToolSpec]) -> None:
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(session, tools)


@pytest_asyncio.fixture(loop_scope="module")
async def bridge(system: LocalSystem) -> AsyncIterator[bridge_pb2_grpc.BridgeServiceAsyncStub]:
    async with grpc.aio.insecure_channel(system.bridge_target) as channel:
        yield bridge_pb2_grpc.BridgeServiceStub(channel)


async def open_stalled(
    bridge: bridge_pb2_grpc.BridgeServiceAsyncStub, session: str, count: int, tool: str
) -> list[Any]:
    """Host sessions that read `opened`, then nothing more: alive on the wire, deaf in the protocol."""
    calls = []
    for n in range(count):
        call = bridge.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(
                session_id=session, host_name=f"stalled-{n}", handler_names=[tool]
            )
        )
        await call.read()
        calls.append(call)
    return calls


async def test_hosts_that_do_not_read_get_no_requests_while_one_that_does_is_there(
    system: LocalSystem, bridge: bridge_pb2_grpc.BridgeServiceAsyncStub
) -> None:
    session = f"stalled-{uuid.uuid4().hex[:8]}"
    await put(system, session, [ToolSpec("work", "", OBJECT, timeout_ms=2000)])
    host = ToolHost(system.bridge_target, session)
    host.on_tool("work", lambda args, ctx: {"done": args["n"]})
    await host.start()
    stalled = await open_stalled(bridge, session, 20, "work")
    try:
        async with InvocationClient(system.invocation_target) as client:
            for _ in range(2):
                results = await asyncio.gather(
                    *(
                        client.invoke(session, "work", {"n": n, "r": uuid.uuid4().hex}, turn_id="t")
                        for n in range(30)
                    )
                )
                codes = [r.outcome.code if r.outcome is not None else r.code for r in results]
                assert codes == ["OK"] * 30
    finally:
        for call in stalled:
            call.cancel()
        await host.stop()


async def test_a_host_that_answers_no_read_checks_still_serves_when_it_is_the_only_one(
    system: LocalSystem, bridge: bridge_pb2_grpc.BridgeServiceAsyncStub
) -> None:
    session = f"legacy-{uuid.uuid4().hex[:8]}"
    await put(system, session, [ToolSpec("work", "", OBJECT, timeout_ms=5000)])
    events = bridge.OpenHostSession(
        bridge_pb2.OpenHostSessionRequest(session_id=session, host_name="legacy", handler_names=["work"])
    )
    first = await events.read()
    assert isinstance(first, bridge_pb2.OpenHostSessionResponse)
    opened = first.opened

    async def serve() -> None:  # as a host built before read checks: answers requests, ignores checks
        while (event := await events.read()) is not grpc.aio.EOF:
            assert isinstance(event, bridge_pb2.OpenHostSessionResponse)
            if event.WhichOneof("event") == "tool_request":
                request = event.tool_request
                outcome = tool_pb2.ToolOutcome(result_json='{"legacy":true}')
                await bridge.SubmitToolResult(
                    bridge_pb2.SubmitToolResultRequest(
                        host_session_id=opened.host_session_id,
                        tool_request_id=request.tool_request_id,
                        outcome=outcome,
                    )
                )

    serving = asyncio.create_task(serve())
    try:
        async with InvocationClient(system.invocation_target) as client:
            result = await client.invoke(session, "work", {"r": uuid.uuid4().hex}, turn_id="t")
        assert result.outcome is not None and result.outcome.result_json == '{"legacy":true}'
    finally:
        events.cancel()
        serving.cancel()


@pytest.mark.timeout(60)
async def test_a_host_that_keeps_answering_requests_is_not_taken_for_gone(
    system: LocalSystem, bridge: bridge_pb2_grpc.BridgeServiceAsyncStub
) -> None:
    """Too busy to answer read checks, but its results show it reads past them."""
    session = f"busy-{uuid.uuid4().hex[:8]}"
    await put(system, session, [ToolSpec("work", "", OBJECT, timeout_ms=5000)])
    events = bridge.OpenHostSession(
        bridge_pb2.OpenHostSessionRequest(session_id=session, host_name="busy", handler_names=["work"])
    )
    first = await events.read()
    assert isinstance(first, bridge_pb2.OpenHostSessionResponse)
    host_session_id = first.opened.host_session_id
    answered_once = False
    ended: list[str] = []

    async def serve() -> None:
        nonlocal answered_once
        try:
            while (event := await events.read()) is not grpc.aio.EOF:
                assert isinstance(event, bridge_pb2.OpenHostSessionResponse)
                kind = event.WhichOneof("event")
                if kind == "heartbeat" and event.heartbeat.read_check and not answered_once:
                    answered_once = True  # one answer, then never again
                    await bridge.AnswerReadCheck(
                        bridge_pb2.AnswerReadCheckRequest(
                            host_session_id=host_session_id, read_check=event.heartbeat.read_check
                        )
                    )
                elif kind == "tool_request":
                    outcome = tool_pb2.ToolOutcome(result_json="true")
                    await bridge.SubmitToolResult(
                        bridge_pb2.SubmitToolResultRequest(
                            host_session_id=host_session_id,
                            tool_request_id=event.tool_request.tool_request_id,
                            outcome=outcome,
                        )
                    )
        except grpc.aio.AioRpcError as error:
            ended.append(error.code().name)

    serving = asyncio.create_task(serve())
    try:
        async with InvocationClient(system.invocation_target) as client:
            loop = asyncio.get_running_loop()
            until = loop.time() + 1.5 * READ_CHECK_TIMEOUT_MS / 1000
            while loop.time() < until:
                result = await client.invoke(session, "work", {"r": uuid.uuid4().hex}, turn_id="t")
                assert result.outcome is not None and result.outcome.ok, result
                await asyncio.sleep(0.2)  # a call now and then, as a busy host's callers make them
        assert answered_once and not ended  # its session is still open
    finally:
        events.cancel()
        serving.cancel()


class Quick:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        self.calls += 1
        return {"by": "second host"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("redeliverable", [True, False], ids=["read-only", "side-effecting"])
async def test_a_host_that_stops_reading_is_taken_for_gone(
    system: LocalSystem, marker_dir: Path, redeliverable: bool
) -> None:
    session = f"frozen-{uuid.uuid4().hex[:8]}"
    annotations = ToolAnnotations(read_only=redeliverable)
    await put(
        system, session, [ToolSpec("slow_async", "", OBJECT, timeout_ms=60_000, annotations=annotations)]
    )
    frozen = await start_host_process(system.bridge_target, session, "e2e_handlers:HANDLERS", marker_dir)
    second = ToolHost(system.bridge_target, session)
    quick = Quick()
    try:
        async with InvocationClient(system.invocation_target) as client:
            marker = uuid.uuid4().hex
            call = asyncio.create_task(
                client.invoke(session, "slow_async", {"marker": marker}, turn_id="t", timeout=70)
            )
            await eventually((marker_dir / f"started-{marker}").exists)  # it runs on the first host
            second.on_tool("slow_async", quick)
            await second.start()
            frozen.process.send_signal(signal.SIGSTOP)  # its stream is open; it reads nothing more
            started = asyncio.get_running_loop().time()
            result = await call
            waited = asyncio.get_running_loop().time() - started
        assert result.outcome is not None
        if redeliverable:
            assert result.outcome.code == "OK" and quick.calls == 1  # sent again, to the host that reads
        else:
            assert result.outcome.code == "TOOL_HOST_DISCONNECTED" and quick.calls == 0
        # Found out by its read checks (READ_CHECK_TIMEOUT_MS), not by the tool's deadline (60 s).
        assert waited < 30
    finally:
        frozen.process.send_signal(signal.SIGCONT)
        await second.stop()
        await frozen.stop()
