"""A submit refused with a retryable code (the bridge's store is out) is tried again until the call's
deadline: the result is delivered once the bridge takes it, reported only when the deadline passes.

A scripted bridge sends one tool request and refuses its submits as told.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from scripted_bridge import ScriptedBridge

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import to_grpc_status
from toolmesh.host import HostError, ToolContext, ToolHost, engine
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc
from toolmesh_testing import eventually

pytestmark = pytest.mark.integration


class RefusingBridge(ScriptedBridge):
    """Sends one tool request; refuses the first `refusals` submits with `code`, then takes one."""

    def __init__(self, code: Code, refusals: int, timeout_ms: int) -> None:
        self.code = code
        self.refusals = refusals
        self.timeout_ms = timeout_ms
        self.submits = 0
        self.taken: list[str] = []

    async def OpenHostSession(self, request: Any, context: Any) -> AsyncIterator[Any]:
        opened = bridge_pb2.HostSessionOpened(host_session_id="hs_1", heartbeat_interval_ms=1000)
        yield bridge_pb2.OpenHostSessionResponse(opened=opened)
        yield bridge_pb2.OpenHostSessionResponse(
            tool_request=bridge_pb2.ToolRequest(
                session_id="s",
                turn_id="t",
                tool_request_id="tr_1",
                tool_name="quick",
                arguments_json="{}",
                timeout_ms=self.timeout_ms,
            )
        )
        while True:
            await asyncio.sleep(0.5)
            yield bridge_pb2.OpenHostSessionResponse(heartbeat=bridge_pb2.Heartbeat())

    async def SubmitToolResult(self, request: Any, context: Any) -> Any:
        self.submits += 1
        if self.submits <= self.refusals:
            refused = ToolmeshError(self.code, "", {"tool_request_id": request.tool_request_id})
            status = to_grpc_status(refused)
            await context.abort(status.code, status.details, status.trailing_metadata)
        self.taken.append(request.tool_request_id)
        return bridge_pb2.SubmitToolResultResponse()


@contextlib.asynccontextmanager
async def hosted(bridge: RefusingBridge) -> AsyncIterator[list[HostError]]:
    """A host serving `quick` on `bridge`; the reports it gives on_error."""
    server = grpc.aio.server()
    bridge_pb2_grpc.add_BridgeServiceServicer_to_server(bridge, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    host = ToolHost(f"127.0.0.1:{port}", "s")

    async def quick(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        return {"done": True}

    host.on_tool("quick", quick)
    reports: list[HostError] = []
    host.on_error(reports.append)
    await host.start(timeout=5)
    try:
        yield reports
    finally:
        await host.stop()
        await server.stop(0)


async def test_a_submit_refused_while_the_bridge_s_store_is_out_is_retried_and_delivered() -> None:
    bridge = RefusingBridge(Code.STORE_UNAVAILABLE, refusals=3, timeout_ms=10_000)
    async with hosted(bridge) as reports:
        await eventually(lambda: bridge.taken, timeout=10, message="the result was never taken")
        assert bridge.taken == ["tr_1"] and bridge.submits == 4
        assert reports == []


async def test_a_submit_refused_past_its_late_window_is_reported_with_its_cause(monkeypatch: Any) -> None:
    """Tried again past the deadline (a bridge that shares the ledger keeps a late result), for
    LATE_SUBMIT_S, then reported."""
    monkeypatch.setattr(engine, "LATE_SUBMIT_S", 1.0)
    bridge = RefusingBridge(Code.STORE_UNAVAILABLE, refusals=1_000, timeout_ms=1000)
    began = time.monotonic()
    async with hosted(bridge) as reports:
        await eventually(lambda: reports, timeout=10, message="the refused result was never reported")
        assert time.monotonic() - began >= 2.0  # the deadline (1 s), then the late window (1 s)
        assert [(r.code, r.cause, r.tool_request_id) for r in reports] == [
            (Code.SUBMIT_TOOL_RESULT_FAILED, "STORE_UNAVAILABLE", "tr_1")
        ]
        assert bridge.submits > 1 and bridge.taken == []


async def test_a_refusal_whose_code_is_not_retryable_is_reported_at_once() -> None:
    bridge = RefusingBridge(Code.REQUEST_UNKNOWN, refusals=1_000, timeout_ms=10_000)
    async with hosted(bridge) as reports:
        await eventually(lambda: reports, timeout=10, message="the refused result was never reported")
        assert [(r.code, r.cause) for r in reports] == [(Code.SUBMIT_TOOL_RESULT_FAILED, "REQUEST_UNKNOWN")]
        assert bridge.submits == 1
