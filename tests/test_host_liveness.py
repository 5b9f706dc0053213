"""The host SDK notices a bridge that stopped talking, and reconnects.

The peer here is a deliberately broken bridge (it opens the stream, then never
sends a heartbeat), which the real bridge cannot be made to be.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from toolmesh.host import ToolHost
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc


class SilentBridge(bridge_pb2_grpc.BridgeServiceServicer):
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

    async def DispatchToolRequest(self, request: Any, context: Any) -> Any:
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
        for _ in range(100):
            if bridge.opened >= 2:
                break
            await asyncio.sleep(0.05)
        assert bridge.opened >= 2
        await host.wait_connected(5)
    finally:
        await host.stop()
        await server.stop(0)
