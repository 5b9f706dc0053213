"""Every handler run ends delivered or reported to on_error, whatever arrives when.

Real registry, bridge and invocation processes, the bridge frozen with SIGSTOP
while a finished handler's result is on its way to it; and a scripted bridge
that makes the same race happen every time.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from scripted_bridge import ScriptedBridge

from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import to_grpc_status
from toolmesh.core.tools import ToolSpec
from toolmesh.host import HostError, ToolContext, ToolHost
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc
from toolmesh_testing import ServiceProcess, eventually, start_service_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

TIMEOUT_MS = 1500


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def services() -> AsyncIterator[dict[str, ServiceProcess]]:
    registry = await start_service_process("registry")
    bridge = await start_service_process("bridge", "--registry", registry.internal_target)
    invocation = await start_service_process(
        "invocation", "--registry", registry.internal_target, "--bridge", bridge.internal_target
    )
    yield {"registry": registry, "bridge": bridge, "invocation": invocation}
    for process in (invocation, bridge, registry):
        if process.process.returncode is None:
            process.process.send_signal(signal.SIGCONT)
        await process.stop()


class Held:
    """An async handler that finishes only when released, and remembers its call."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.ctx: ToolContext | None = None

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        self.ctx = ctx
        self.started.set()
        await self.release.wait()
        return {"done": True}


async def test_a_result_the_frozen_bridge_refuses_after_its_timeout_is_reported(
    services: dict[str, ServiceProcess],
) -> None:
    session = f"frozen-{uuid.uuid4().hex[:8]}"
    async with RegistryClient(services["registry"].target) as registry:
        await registry.put_tools(session, [ToolSpec("held", "", '{"type": "object"}', timeout_ms=TIMEOUT_MS)])
    handler = Held()
    host = ToolHost(services["bridge"].target, session)
    host.on_tool("held", handler)
    reports: list[HostError] = []
    host.on_error(reports.append)
    bridge = services["bridge"].process
    await host.start()
    try:
        async with InvocationClient(services["invocation"].target) as client:
            call = asyncio.create_task(client.invoke(session, "held", {}, turn_id="t", timeout=20))
            await handler.started.wait()
            bridge.send_signal(signal.SIGSTOP)
            try:
                handler.release.set()  # the handler ends; its submit waits on the frozen bridge
                ctx = handler.ctx
                assert ctx is not None
                # Thawed once the tool's deadline has passed: the bridge's timer and
                # the submit race, and the timeout's cancellation reaches the host.
                await eventually(lambda: time.monotonic() > ctx.deadline + 0.3, timeout=5)
            finally:
                bridge.send_signal(signal.SIGCONT)
            result = await call
        assert result.outcome is not None
        if result.outcome.ok:
            return  # the submit won the race: delivered
        assert result.outcome.code == "TOOL_TIMEOUT"
        # Not delivered: then reported, once, with the bridge's reason.
        await eventually(lambda: reports, timeout=10, message="the refused result was never reported")
        assert [(r.code, r.cause, r.tool_request_id) for r in reports] == [
            (Code.SUBMIT_TOOL_RESULT_FAILED, "REQUEST_ENDED", result.tool_request_id)
        ]
    finally:
        await host.stop()


class RacingBridge(ScriptedBridge):
    """Sends one tool request; holds its submit, cancelling the request meanwhile, then answers as told.

    The real bridge does this only when its timer and a submit race (above);
    this one does it every time.
    """

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.submitted = asyncio.Event()
        self.cancel = asyncio.Event()

    async def OpenHostSession(self, request: Any, context: Any) -> AsyncIterator[Any]:
        opened = bridge_pb2.HostSessionOpened(host_session_id="hs_1", heartbeat_interval_ms=1000)
        yield bridge_pb2.OpenHostSessionResponse(opened=opened)
        yield bridge_pb2.OpenHostSessionResponse(
            tool_request=bridge_pb2.ToolRequest(
                session_id="racing",
                turn_id="t",
                tool_request_id="tr_1",
                tool_name="quick",
                arguments_json="{}",
                timeout_ms=5000,
            )
        )
        await self.cancel.wait()
        yield bridge_pb2.OpenHostSessionResponse(
            cancelled=bridge_pb2.ToolRequestCancelled(
                tool_request_id="tr_1", reason=bridge_pb2.CANCEL_REASON_TIMEOUT
            )
        )
        while True:
            await asyncio.sleep(0.5)
            yield bridge_pb2.OpenHostSessionResponse(heartbeat=bridge_pb2.Heartbeat())

    async def SubmitToolResult(self, request: Any, context: Any) -> Any:
        self.submitted.set()
        self.cancel.set()
        if self.answer == "never":
            await asyncio.Event().wait()
        await asyncio.sleep(0.5)  # the cancellation is on the host's stream by now
        status = to_grpc_status(
            ToolmeshError(Code.REQUEST_ENDED, "", {"tool_request_id": "tr_1", "ended": "timed_out"})
        )
        await context.abort(status.code, status.details, status.trailing_metadata)


Racing = tuple[RacingBridge, ToolHost, list[HostError]]


@pytest_asyncio.fixture(loop_scope="module")
async def racing_host(request: pytest.FixtureRequest) -> AsyncIterator[Racing]:
    server = grpc.aio.server()
    bridge = RacingBridge(request.param)
    bridge_pb2_grpc.add_BridgeServiceServicer_to_server(bridge, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    host = ToolHost(f"127.0.0.1:{port}", "racing")

    async def quick(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        return {"done": True}

    host.on_tool("quick", quick)
    reports: list[HostError] = []
    host.on_error(reports.append)
    await host.start(timeout=5)
    yield bridge, host, reports
    await host.stop()
    await server.stop(0)


@pytest.mark.parametrize("racing_host", ["ended"], indirect=True)
async def test_a_cancellation_during_the_submit_does_not_drop_its_report(
    racing_host: Racing,
) -> None:
    _, _, reports = racing_host
    await eventually(lambda: reports, timeout=10, message="the refused result was never reported")
    assert [(r.code, r.cause, r.tool_request_id) for r in reports] == [
        (Code.SUBMIT_TOOL_RESULT_FAILED, "REQUEST_ENDED", "tr_1")
    ]


@pytest.mark.parametrize("racing_host", ["never"], indirect=True)
async def test_a_result_still_on_its_way_when_the_host_stops_is_reported(
    racing_host: Racing,
) -> None:
    bridge, host, reports = racing_host
    await bridge.submitted.wait()
    await host.stop()  # the bridge never answers this submit
    assert [(r.code, r.cause, r.tool_request_id) for r in reports] == [
        (Code.SUBMIT_TOOL_RESULT_FAILED, "SHUTTING_DOWN", "tr_1")
    ]
