"""The host SDK on ExchangeHostWork: its start asks and results go on the stream, batched, and when
the stream breaks nothing starts without a START and no result is lost.

A scripted bridge serves the host stream and the host work stream, and breaks the latter as told;
the real bridge's side is tested in tests/server/bridge/test_host_work.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from scripted_bridge import ScriptedBridge, scripted

from toolmesh.core import telemetry
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import to_grpc_status
from toolmesh.host import HostError, ToolContext, ToolHost
from toolmesh.v1 import bridge_pb2
from toolmesh_testing import eventually, logged

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def untraced(monkeypatch: pytest.MonkeyPatch) -> None:
    """These are the untraced host's ways (a traced one hands results in as SubmitToolResult, for
    their spans): once another test of this process installed the SDK, tracing stays on."""
    monkeypatch.setattr(telemetry, "enabled", lambda: False)


START = bridge_pb2.TOOL_START_VERDICT_START


class WorkBridge(ScriptedBridge):
    """Sends `count` tool requests once the host's work stream is open; answers on that stream
    (START for each ask, a receipt for each result) unless told to break it on the first ask
    (`break_on`="ask") or result ("result"). The unary RPCs answer `unary_verdict`, and take
    a result unless `answered_before` (REQUEST_ENDED, ended "answered")."""

    def __init__(
        self,
        count: int,
        *,
        break_on: str = "",
        unary_verdict: bridge_pb2.ToolStartVerdict.ValueType = START,
        answered_before: bool = False,
    ) -> None:
        self.count = count
        self.break_on = break_on
        self.unary_verdict = unary_verdict
        self.answered_before = answered_before
        self.linked = asyncio.Event()
        self.messages: list[Any] = []
        self.unary_asked: list[str] = []
        self.unary_submitted: list[str] = []

    async def OpenHostSession(self, request: Any, context: Any) -> AsyncIterator[Any]:
        now_ms = int(time.time() * 1000)
        opened = bridge_pb2.HostSessionOpened(
            host_session_id="hs_1",
            heartbeat_interval_ms=1000,
            server_time_unix_ms=now_ms,
            starts_acknowledged=True,
            host_work_served=True,
        )
        yield bridge_pb2.OpenHostSessionResponse(opened=opened)
        await self.linked.wait()
        for index in range(self.count):
            yield bridge_pb2.OpenHostSessionResponse(
                tool_request=bridge_pb2.ToolRequest(
                    session_id="work",
                    turn_id="t",
                    tool_request_id=f"tr_{index}",
                    tool_name="echo",
                    arguments_json="{}",
                    timeout_ms=5000,
                    deadline_unix_ms=now_ms + 5000,
                )
            )
        while True:
            await asyncio.sleep(0.5)
            yield bridge_pb2.OpenHostSessionResponse(heartbeat=bridge_pb2.Heartbeat())

    async def ExchangeHostWork(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        self.linked.set()
        async for message in request_iterator:
            assert message.host_session_id == "hs_1"
            self.messages.append(message)
            if (self.break_on == "ask" and message.start_tool_request_ids) or (
                self.break_on == "result" and message.results
            ):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
            yield bridge_pb2.ExchangeHostWorkResponse(
                starts=[
                    bridge_pb2.ToolStart(tool_request_id=i, verdict=START)
                    for i in message.start_tool_request_ids
                ],
                receipts=[
                    bridge_pb2.ToolResultReceipt(tool_request_id=r.tool_request_id) for r in message.results
                ],
            )

    async def StartToolRequests(self, request: Any, context: Any) -> Any:
        self.unary_asked += request.tool_request_ids
        return bridge_pb2.StartToolRequestsResponse(
            starts=[
                bridge_pb2.ToolStart(tool_request_id=i, verdict=self.unary_verdict)
                for i in request.tool_request_ids
            ]
        )

    async def SubmitToolResult(self, request: Any, context: Any) -> Any:
        self.unary_submitted.append(request.tool_request_id)
        if self.answered_before:
            refused = ToolmeshError(Code.REQUEST_ENDED, "It ended (answered).", {"ended": "answered"})
            status = to_grpc_status(refused)
            await context.abort(status.code, status.details, status.trailing_metadata)
        return bridge_pb2.SubmitToolResultResponse()

    def on_stream(self, field: str) -> list[str]:
        """Every id asked (`start_tool_request_ids`) or result handed in (`results`) on the stream."""
        if field == "results":
            return [r.tool_request_id for m in self.messages for r in m.results]
        return [i for m in self.messages for i in m.start_tool_request_ids]


@contextlib.asynccontextmanager
async def hosted(bridge: WorkBridge, runs: list[str]) -> AsyncIterator[tuple[ToolHost, list[HostError]]]:
    """A host serving `echo` on `bridge`, recording each run, and the reports it gives on_error."""
    async with scripted(bridge) as target:
        host = ToolHost(target, "work")
        try:
            yield host, await _started(host, runs)
        finally:
            await host.stop()


async def _started(host: ToolHost, runs: list[str]) -> list[HostError]:
    async def echo(args: dict[str, Any], ctx: ToolContext) -> dict[str, bool]:
        runs.append(ctx.tool_request_id)
        return {"ran": True}

    host.on_tool("echo", echo)
    reports: list[HostError] = []
    host.on_error(reports.append)
    await host.start(timeout=5)
    return reports


async def test_asks_and_results_go_on_the_stream_in_fewer_messages_than_requests() -> None:
    bridge = WorkBridge(20)
    runs: list[str] = []
    async with hosted(bridge, runs) as (_host, reports):
        await eventually(lambda: len(bridge.on_stream("results")) == 20)
    every = sorted(f"tr_{index}" for index in range(20))
    assert sorted(runs) == every and reports == []
    assert sorted(bridge.on_stream("start_tool_request_ids")) == every  # each asked once
    assert sorted(bridge.on_stream("results")) == every
    assert bridge.unary_asked == [] and bridge.unary_submitted == []  # no call per request
    assert len(bridge.messages) < 40  # batched


async def test_asks_on_a_stream_that_broke_are_asked_again_and_not_run_unless_started(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The bridge read an ask and broke: a real one may have given START on the stream, so asked
    # again it says ALREADY_STARTED, and the host runs nothing (no start without START).
    bridge = WorkBridge(3, break_on="ask", unary_verdict=bridge_pb2.TOOL_START_VERDICT_ALREADY_STARTED)
    runs: list[str] = []
    with caplog.at_level(logging.INFO, logger="toolmesh.host"):
        async with hosted(bridge, runs):
            await eventually(lambda: logged(caplog.records, "tool request not started") == 3)
    assert sorted(bridge.unary_asked) == ["tr_0", "tr_1", "tr_2"]
    assert set(bridge.on_stream("start_tool_request_ids")) <= set(bridge.unary_asked)
    assert runs == []


async def test_asks_on_a_stream_that_broke_run_once_when_started_by_the_unary_call() -> None:
    bridge = WorkBridge(3, break_on="ask")
    runs: list[str] = []
    async with hosted(bridge, runs) as (_host, reports):
        await eventually(lambda: len(bridge.unary_submitted) == 3)
    assert sorted(runs) == ["tr_0", "tr_1", "tr_2"] and reports == []
    assert sorted(bridge.unary_asked) == sorted(runs)


async def test_a_result_whose_receipt_was_lost_is_handed_in_again_and_not_reported() -> None:
    # The stream broke after the bridge read the result: handed in again by SubmitToolResult,
    # which says the first one got through.
    bridge = WorkBridge(1, break_on="result", answered_before=True)
    runs: list[str] = []
    async with hosted(bridge, runs) as (host, reports):
        await eventually(lambda: bridge.unary_submitted == ["tr_0"])
        await eventually(lambda: not host._active)  # its submit has ended
        assert reports == []
    assert runs == ["tr_0"] and bridge.on_stream("results") == ["tr_0"]
