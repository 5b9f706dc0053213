"""Stopping a server ends every long-lived stream at once with SHUTTING_DOWN, well within its grace."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from toolmesh.assembly.system import start_local_system
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code
from toolmesh.v1 import (
    bridge_pb2,
    bridge_pb2_grpc,
    invocation_pb2,
    invocation_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

GRACE_S = 5.0


async def ending(stream: Any) -> Code | None:
    """Read `stream` to its end; the code it failed with."""
    try:
        while await stream.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as error:
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error
        return error_code(error)
    return None


async def test_every_stream_ends_with_shutting_down_and_the_stop_is_quick() -> None:
    system = await start_local_system(heartbeat_s=0.5)
    channels = [grpc.aio.insecure_channel(target) for target in (
        system.registry_target, system.bridge_target, system.invocation_target, system.bridge_internal_target
    )]  # fmt: skip
    registry, bridge, invocation, bridge_internal = channels
    try:
        watch = registry_pb2_grpc.RegistryServiceStub(registry).WatchTools(
            registry_pb2.WatchToolsRequest(session_id="s")
        )
        host = bridge_pb2_grpc.BridgeServiceStub(bridge).OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(session_id="s", handler_names=["t"])
        )
        # Dispatch is served on the bridge's internal listener: its streams end there too.
        dispatch = bridge_pb2_grpc.BridgeServiceStub(bridge_internal).DispatchToolRequests()
        calls = invocation_pb2_grpc.InvocationServiceStub(invocation).InvokeTools()
        # Each is open and answering before the stop.
        listed = await watch.read()
        assert isinstance(listed, registry_pb2.WatchToolsResponse) and listed.revision == 0
        opened = await host.read()
        assert isinstance(opened, bridge_pb2.OpenHostSessionResponse) and opened.opened.host_session_id
        await dispatch.write(bridge_pb2.DispatchToolRequestsRequest())
        await calls.write(invocation_pb2.InvokeToolsRequest())
        endings = [asyncio.ensure_future(ending(stream)) for stream in (watch, host, dispatch, calls)]
        started = time.monotonic()
        for server in system.servers:
            await server.stop(GRACE_S)
        took = time.monotonic() - started
        assert await asyncio.gather(*endings) == [Code.SHUTTING_DOWN] * 4
        # Not held for the grace by streams that never end on their own.
        assert took < GRACE_S / 2, took
    finally:
        for channel in channels:
            await channel.close()
