"""The host SDK against misbehaving bridges: silence, and submits lost in transport.

The peer here is a deliberately broken bridge (it opens the stream, then never
sends a heartbeat), which the real bridge cannot be made to be.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from scripted_bridge import ScriptedBridge

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import to_grpc_status
from toolmesh.host import BridgeUnreachable, HostError, ToolHost
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc
from toolmesh_testing import eventually, logged

pytestmark = pytest.mark.integration


class SilentBridge(ScriptedBridge):
    def __init__(self) -> None:
        self.opened = 0

    async def OpenHostSession(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.opened += 1
        yield bridge_pb2.OpenHostSessionResponse(
            opened=bridge_pb2.HostSessionOpened(
                host_session_id=f"hs_{self.opened}", heartbeat_interval_ms=100
            )
        )
        await asyncio.sleep(60)  # alive on the wire, silent in the protocol

    async def SubmitToolResult(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")


async def test_host_reconnects_when_heartbeats_stop() -> None:
    server = grpc.aio.server()
    bridge = SilentBridge()
    bridge_pb2_grpc.add_BridgeServiceServicer_to_server(bridge, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    host = ToolHost(f"127.0.0.1:{port}", "silent")
    try:
        await host.start(timeout=5)
        assert host.host_session_id == "hs_1"
        # Three missed heartbeats (0.3 s) end the stream; the host opens a new one.
        await eventually(lambda: bridge.opened >= 2)
        await host.wait_connected(5)
    finally:
        await host.stop()
        await server.stop(0)


class FlakyBridge(ScriptedBridge):
    """Sends one tool request; the first submit fails in transport, later ones answer as told."""

    def __init__(self, second_answer: str) -> None:
        self.submits = 0
        self.second_answer = second_answer

    async def OpenHostSession(self, request: Any, context: Any) -> AsyncIterator[Any]:
        opened = bridge_pb2.HostSessionOpened(host_session_id="hs_1", heartbeat_interval_ms=1000)
        yield bridge_pb2.OpenHostSessionResponse(opened=opened)
        yield bridge_pb2.OpenHostSessionResponse(
            tool_request=bridge_pb2.ToolRequest(
                session_id="flaky",
                turn_id="t",
                tool_request_id="tr_1",
                tool_name="echo",
                arguments_json="{}",
                timeout_ms=5000,
            )
        )
        await asyncio.sleep(60)

    async def SubmitToolResult(self, request: Any, context: Any) -> Any:
        self.submits += 1
        if self.submits == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        if self.second_answer == "ended":
            status = to_grpc_status(
                ToolmeshError(Code.REQUEST_ENDED, "", {"toolRequestId": "tr_1", "ended": "answered"})
            )
            await context.abort(status.code, status.details, status.trailing_metadata)
        return bridge_pb2.SubmitToolResultResponse()


@pytest.mark.parametrize("second_answer", ["ok", "ended"])
async def test_submit_retries_a_transport_failure_and_reports_nothing(second_answer: str) -> None:
    server = grpc.aio.server()
    bridge = FlakyBridge(second_answer)
    bridge_pb2_grpc.add_BridgeServiceServicer_to_server(bridge, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    host = ToolHost(f"127.0.0.1:{port}", "flaky")
    host.on_tool("echo", lambda args, ctx: {"ok": True})
    errors: list[HostError] = []
    host.on_error(errors.append)
    try:
        await host.start(timeout=5)
        await eventually(lambda: bridge.submits >= 2)
        # The call's task has ended: nothing more will be submitted or reported.
        await eventually(lambda: not host._active)
        # Retried once; "ended: answered" after a lost reply means the first one got through.
        assert bridge.submits == 2
        assert errors == []
    finally:
        await host.stop()
        await server.stop(0)


async def test_stop_does_not_wait_out_the_reconnect_backoff(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    host = ToolHost(f"127.0.0.1:{port}", "nobody-listens")
    with caplog.at_level(logging.WARNING, logger="toolmesh.host"), pytest.raises(BridgeUnreachable) as raised:
        await host.start(timeout=0.1)
    # Says where it looked, not only that time ran out.
    assert f"127.0.0.1:{port}" in str(raised.value) and isinstance(raised.value, TimeoutError)

    # The failures are log records: polling is the way to see them. After 6, the backoff is at its cap.
    await eventually(lambda: logged(caplog.records, "host stream ended") >= 6)
    started = time.monotonic()
    await host.stop()
    assert time.monotonic() - started < 0.5


async def test_serve_names_the_unreachable_bridge_and_stops() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    host = ToolHost(f"127.0.0.1:{port}", "nobody-listens")
    with pytest.raises(BridgeUnreachable) as raised:
        await host.serve(timeout=0.3)
    assert f"127.0.0.1:{port}" in str(raised.value) and "UNAVAILABLE" in str(raised.value)
    assert host._runner is not None and host._runner.done()


async def test_serve_serves_until_stopped_or_cancelled() -> None:
    server = grpc.aio.server()
    bridge = SilentBridge()
    bridge_pb2_grpc.add_BridgeServiceServicer_to_server(bridge, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        for ending in ("stop", "cancel"):
            host = ToolHost(f"127.0.0.1:{port}", "serving")
            serving = asyncio.create_task(host.serve(timeout=5))
            await host.wait_connected(5)
            assert not serving.done()  # connected, and still serving
            if ending == "stop":
                await host.stop()
                await asyncio.wait_for(serving, 5)
            else:
                serving.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(serving, 5)
            assert host._runner is not None and host._runner.done() and not host.connected
    finally:
        await server.stop(0)
