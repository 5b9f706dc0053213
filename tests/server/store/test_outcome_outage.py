"""A host's outcome arrives while Redis is down and the invocation replica that ran the call is dead:
the bridge that got it keeps it and writes it once Redis is back, so the call's exact retry (on
another replica) gets that one outcome, not a TOOL_TIMEOUT for a lost owner, and the tool ran once.

Redis is a redis-server of this test's own (append-only file, fsync on every
write), killed with SIGKILL and started again on the same port and files.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from redis_testing import RedisServer
from toolmesh.assembly.system import start_bridge, start_invocation, start_registry
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import open_stores
from toolmesh_testing import (
    HostProcess,
    ServiceProcess,
    eventually,
    free_port,
    logged,
    start_host_process,
    start_service_process,
)

pytestmark = pytest.mark.integration

SESSION = "outcome-outage"
# Short, so that a lost outcome shows as the owner-lost TOOL_TIMEOUT within the test's time.
TOOLS = [ToolSpec("count", "Counts its runs", '{"type": "object"}', timeout_ms=4000)]


def runs(marker_dir: Path, key: str) -> list[str]:
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


@dataclass
class Services:
    redis: RedisServer
    bridge: RunningServer
    # Invocation replica A is a process of its own, to kill; B runs here.
    doomed: ServiceProcess
    survivor: RunningServer
    host: HostProcess


@pytest_asyncio.fixture
async def services(tmp_path: Path) -> AsyncIterator[Services]:
    redis = RedisServer(free_port(), tmp_path)
    await redis.start()
    registry = await start_registry(stores=open_stores(redis.url))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    bridge, _ = await start_bridge(registry_target=registry_internal, stores=open_stores(redis.url))
    bridge_internal = f"127.0.0.1:{bridge.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=redis.url)
    doomed = await start_service_process(
        "invocation", "--registry", registry_internal, "--bridge", bridge_internal, env=env
    )
    survivor = await start_invocation(registry_internal, bridge_internal, stores=open_stores(redis.url))
    async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
        await client.put_tools(SESSION, TOOLS)
    host = await start_host_process(f"127.0.0.1:{bridge.port}", SESSION, "ledger_handlers:HANDLERS", tmp_path)
    yield Services(redis, bridge, doomed, survivor, host)
    await host.stop()
    if doomed.process.returncode is None:
        doomed.process.kill()
    await doomed.stop()
    for server in (survivor, bridge, registry):
        await server.stop(0.5)
    await redis.stop()


@pytest.mark.timeout(90)
async def test_an_outcome_arriving_while_redis_and_its_invocation_replica_are_dead_is_kept(
    services: Services, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    key = uuid.uuid4().hex
    arguments = {"key": key, "hold": True}
    async with InvocationClient(services.doomed.target) as client:
        calling = asyncio.create_task(client.invoke(SESSION, "count", arguments, turn_id="t"))
        [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
        await services.redis.kill()
        services.doomed.process.kill()
        lost = await asyncio.wait_for(calling, 10)
    assert lost.outcome is None, lost
    # The handler ends now: its outcome reaches the bridge, which cannot read the ledger.
    (tmp_path / f"release-{key}").touch()
    handled = ("outcome kept until the store is back", "outcome not recorded")
    await eventually(lambda: any(logged(caplog.records, message) for message in handled))
    await services.redis.start()
    async with InvocationClient(f"127.0.0.1:{services.survivor.port}") as client:
        retried = await asyncio.wait_for(client.invoke(SESSION, "count", arguments, turn_id="t"), 20)
    assert retried.outcome is not None and retried.outcome.failure is None, retried
    assert retried.tool_request_id == tool_request_id and (retried.joined or retried.replayed)
    assert json.loads(retried.outcome.result_json or "")["runs"] == 1
    assert runs(tmp_path, key) == [tool_request_id]
    assert logged(caplog.records, "outcome not recorded") == 0
