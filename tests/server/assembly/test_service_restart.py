"""Every service process killed with SIGKILL and started again on Redis: no tool and no ledger entry lost.

registry, bridge and invocation run as `python -m toolmesh.<service> --store redis://…`
processes (under a key prefix of this test's own on the shared Redis), with a
real host process counting its handler's executions in marker files.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.client import CallResult, InvocationClient, InvocationState, RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import ServiceProcess, start_host_process, start_service_process

SESSION = "restart"
TOOLS = [ToolSpec("count", "Counts its runs", '{"type": "object"}', timeout_ms=10_000)]

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def prefix() -> AsyncIterator[str]:
    chosen = new_prefix()
    yield chosen
    await delete_prefixed(SHARED_URL, chosen)


async def start_services(prefix: str, ports: dict[str, int]) -> list[ServiceProcess]:
    """The three services on `ports` (public, and internal for registry and bridge; a name missing:
    port 0), the ports they bound written back."""
    store = ["--store", SHARED_URL, "--store-prefix", prefix]
    registry, bridge = await asyncio.gather(
        *(
            start_service_process(
                name,
                *store,
                ports=ports,
            )
            for name in ("registry", "bridge")
        )
    )
    dependencies = ["--registry", registry.internal_target, "--bridge", bridge.internal_target]
    invocation = await start_service_process("invocation", *dependencies, *store, ports=ports)
    return [registry, bridge, invocation]


async def kill(services: list[ServiceProcess]) -> None:
    for service in services:
        service.process.kill()
        await service.process.wait()
        await service.stop()


def runs(marker_dir: Path, key: str) -> list[str]:
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


async def count(client: InvocationClient, key: str, **kwargs: Any) -> CallResult:
    return await client.invoke(SESSION, "count", {"key": key}, turn_id="turn", **kwargs)


async def until_host_serves(client: InvocationClient) -> CallResult:
    """A new call, once the host has found the new bridge (it reconnects with a backoff)."""
    while True:
        result = await count(client, "after")
        if result.outcome is None or result.outcome.code != Code.TOOL_HOST_UNAVAILABLE:
            return result
        await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
async def test_every_service_killed_and_restarted(prefix: str, marker_dir: Path) -> None:
    ports: dict[str, int] = {}  # bound on the first start, kept for the restart
    services = await start_services(prefix, ports)
    target = f"127.0.0.1:{ports['invocation']}"
    host = await start_host_process(
        f"127.0.0.1:{ports['bridge']}", SESSION, "ledger_handlers:HANDLERS", marker_dir
    )
    try:
        async with RegistryClient(f"127.0.0.1:{ports['registry']}") as registry:
            revision = await registry.put_tools(SESSION, TOOLS)
        async with InvocationClient(target) as client:
            unconfirmed = await count(client, "unconfirmed", confirm_delivery=False)
            keyed = await count(client, "keyed", idempotency_key="order-7")
            confirmed = await count(client, "confirmed")
            await client.flush_confirmations()
        assert unconfirmed.outcome is not None and keyed.outcome is not None

        await kill(services)
        services = await start_services(prefix, ports)

        async with RegistryClient(f"127.0.0.1:{ports['registry']}") as registry:
            tools = await registry.list_tools(SESSION)
        assert tools.revision == revision and [tool.name for tool in tools.tools] == ["count"]
        async with InvocationClient(target) as client:
            replayed = await count(client, "unconfirmed", confirm_delivery=False)
            assert replayed.replayed and replayed.tool_request_id == unconfirmed.tool_request_id
            assert replayed.outcome == unconfirmed.outcome
            again = await count(client, "keyed", idempotency_key="order-7")
            assert again.replayed and again.tool_request_id == keyed.tool_request_id
            record = await client.get_invocation(confirmed.tool_request_id or "")
            assert record.state is InvocationState.COMPLETED and record.delivered
            fresh = await asyncio.wait_for(until_host_serves(client), 30)
            assert fresh.outcome is not None and json.loads(fresh.outcome.result_json or "")["runs"] == 1
        for key in ("unconfirmed", "keyed", "confirmed"):
            assert len(runs(marker_dir, key)) == 1, key
    finally:
        await host.stop()
        for service in services:
            await service.stop()
