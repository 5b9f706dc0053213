"""CancelInvocation across invocation replicas on one Redis: a cancel taken by the replica that does
not run the invocation still ends it and reaches its host."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_bridge, start_invocation, start_registry
from toolmesh.client import InvocationClient, InvocationState, RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.tools import ToolSpec
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import open_stores
from toolmesh_testing import (
    HostProcess,
    ServiceProcess,
    eventually,
    start_host_process,
    start_service_process,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "cancel-replicas"
TOOLS = [ToolSpec("slow_async", "Waits, cancellable", '{"type": "object"}', timeout_ms=30_000)]


@dataclass
class Replicas:
    registry: RunningServer
    bridge: RunningServer
    # Invocation replica 0 is a process of its own; replica 1 runs here.
    process: ServiceProcess
    local: RunningServer
    host: HostProcess

    def invocation(self, index: int) -> str:
        return self.process.target if index == 0 else f"127.0.0.1:{self.local.port}"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def replicas(marker_dir: Path) -> AsyncIterator[Replicas]:
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    bridge, _ = await start_bridge(registry_target=registry_internal, stores=open_stores(SHARED_URL, prefix))
    bridge_internal = f"127.0.0.1:{bridge.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    process = await start_service_process(
        "invocation", "--registry", registry_internal, "--bridge", bridge_internal, env=env
    )
    local = await start_invocation(registry_internal, bridge_internal, stores=open_stores(SHARED_URL, prefix))
    async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
        await client.put_tools(SESSION, TOOLS)
    host = await start_host_process(f"127.0.0.1:{bridge.port}", SESSION, "e2e_handlers:HANDLERS", marker_dir)
    yield Replicas(registry, bridge, process, local, host)
    await host.stop()
    await process.stop()
    for server in (local, bridge, registry):
        await server.stop(0.5)
    await delete_prefixed(SHARED_URL, prefix)


@pytest.mark.parametrize(("runs_on", "cancelled_on"), [(0, 1), (1, 0)])
async def test_a_cancel_sent_to_the_other_replica_ends_the_call_and_reaches_the_host(
    replicas: Replicas, marker_dir: Path, runs_on: int, cancelled_on: int
) -> None:
    name = f"cancel-{uuid.uuid4().hex}"
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    async with (
        InvocationClient(replicas.invocation(runs_on)) as caller,
        InvocationClient(replicas.invocation(cancelled_on)) as canceller,
    ):
        calling = asyncio.ensure_future(
            caller.invoke(SESSION, "slow_async", {"marker": name}, turn_id="t", on_started=started.set_result)
        )
        tool_request_id = await asyncio.wait_for(started, 10)
        await eventually((marker_dir / f"started-{name}").exists)
        assert await canceller.cancel_invocation(tool_request_id) is True
        result = await asyncio.wait_for(calling, 10)
        assert result.outcome is not None and result.outcome.code == Code.TOOL_CANCELLED
        marker = marker_dir / f"cancelled-{name}"
        await eventually(lambda: marker.exists() and marker.read_text())
        assert marker.read_text() == "cancelled"
        for client in (caller, canceller):  # one ledger: both replicas see it ended
            assert (await client.get_invocation(tool_request_id)).state is InvocationState.CANCELLED
            assert await client.cancel_invocation(tool_request_id) is False
