"""Quick recovery: calls succeed again within about a second of a dependency coming back.

The registry and the bridge are real processes, killed with SIGKILL and
restarted on their ports after an outage long enough for gRPC's default
reconnect backoff to have grown past several seconds; the invocation service
and the host keep trying meanwhile.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from toolmesh.assembly.system import start_invocation
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.limits import RECONNECT_BACKOFF_MAX_MS
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolHost
from toolmesh_testing import ServiceProcess, eventually, start_service_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "recovering"
OUTAGE_S = 20.0
# Back within the backoff's cap, with room for a restarted process's first calls on a busy machine.
RECOVERED_WITHIN_S = 3 * RECONNECT_BACKOFF_MAX_MS / 1000
TOOLS = [ToolSpec("echo", "", '{"type": "object"}', timeout_ms=2000)]


def on_ports(service: str, ports: dict[str, int], *args: str) -> Callable[[], Awaitable[ServiceProcess]]:
    async def start() -> ServiceProcess:
        return await start_service_process(
            service,
            *args,
            ports=ports,
        )

    return start


@pytest.mark.timeout(120)
async def test_calls_succeed_within_a_second_or_so_of_registry_and_bridge_coming_back() -> None:
    ports: dict[str, int] = {}  # bound on the first start, kept for the restarts
    start_registry = on_ports("registry", ports)
    registry = await start_registry()
    registry_internal = registry.internal_target
    start_bridge = on_ports("bridge", ports, "--registry", registry_internal)
    bridge = await start_bridge()
    invocation = await start_invocation(registry_internal, f"127.0.0.1:{ports['bridge-internal']}")
    host = ToolHost(bridge.target, SESSION)
    host.on_tool("echo", lambda args, ctx: args)
    codes: list[tuple[float, str]] = []

    async def put_tools() -> None:
        async with RegistryClient(registry.target) as client:
            await client.put_tools(SESSION, TOOLS)

    async def probe(client: InvocationClient) -> None:
        while True:
            result = await client.invoke(SESSION, "echo", {"probe": uuid.uuid4().hex}, turn_id="t", timeout=1)
            code: Any = result.outcome.code if result.outcome is not None else result.code
            codes.append((time.monotonic(), str(code)))
            await asyncio.sleep(0.05)  # a caller trying again, not a tight loop

    def ok_after(moment: float) -> float | None:
        return next((at for at, code in codes if at > moment and code == "OK"), None)

    try:
        await put_tools()
        await host.start()
        async with InvocationClient(f"127.0.0.1:{invocation.port}") as client:
            prober = asyncio.create_task(probe(client))
            await eventually(lambda: ok_after(0.0))
            for process in (registry, bridge):
                process.process.kill()
                await process.stop()
            killed = time.monotonic()
            # Calls fail all along the outage, and the channels' backoff grows meanwhile.
            await eventually(lambda: time.monotonic() - killed > OUTAGE_S, timeout=OUTAGE_S + 5, interval=0.2)
            assert ok_after(killed) is None
            registry, bridge = await start_registry(), await start_bridge()
            await put_tools()
            back = time.monotonic()
            recovered = await eventually(lambda: ok_after(back), timeout=30, interval=0.05)
            prober.cancel()
        assert recovered - back < RECOVERED_WITHIN_S, f"{recovered - back:.2f} s after both were back"
    finally:
        await host.stop()
        await invocation.stop(0.5)
        await bridge.stop()
        await registry.stop()
