"""Replicas that die mid-call on one Redis: the call still runs once and its outcome is not lost."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis_testing import SHARED_URL, delete_prefixed, new_prefix

from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.ledger import Ledger
from toolmesh.server.runtime import RunningServer
from toolmesh.server.system import start_bridge, start_invocation, start_registry
from toolmesh.store.backends import Stores, open_stores
from toolmesh_testing import (
    HostProcess,
    ServiceProcess,
    eventually,
    start_host_process,
    start_service_process,
)

pytestmark = pytest.mark.integration

SESSION = "crashes"
TOOLS = [ToolSpec("count", "Counts its runs", '{"type": "object"}', timeout_ms=20_000)]


def runs(marker_dir: Path, key: str) -> list[str]:
    """The tool request ids of every execution of `key` (ledger_handlers writes them)."""
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


@dataclass
class Replicas:
    prefix: str
    registry: RunningServer
    bridge: RunningServer
    # Invocation replica A is a process of its own, to kill; B runs here.
    doomed: ServiceProcess
    survivor: RunningServer
    stores: Stores
    host: HostProcess


@pytest_asyncio.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    bridge, _ = await start_bridge(registry_target=registry_internal, stores=open_stores(SHARED_URL, prefix))
    bridge_internal = f"127.0.0.1:{bridge.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    doomed = await start_service_process(
        "invocation", "--registry", registry_internal, "--bridge", bridge_internal, env=env
    )
    survivor = await start_invocation(
        registry_internal, bridge_internal, stores=open_stores(SHARED_URL, prefix)
    )
    async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
        await client.put_tools(SESSION, TOOLS)
    host = await start_host_process(f"127.0.0.1:{bridge.port}", SESSION, "ledger_handlers:HANDLERS", tmp_path)
    stores = open_stores(SHARED_URL, prefix)
    yield Replicas(prefix, registry, bridge, doomed, survivor, stores, host)
    await host.stop()
    if doomed.process.returncode is None:
        doomed.process.kill()
    await doomed.stop()
    for server in (survivor, bridge, registry):
        await server.stop(0.5)
    await stores.close()
    await delete_prefixed(SHARED_URL, prefix)


async def watchers(prefix: str, tool_request_id: str) -> int:
    """How many watch the invocation's record (a joiner subscribes to it)."""
    client = Redis.from_url(SHARED_URL)
    try:
        [(_, count)] = await client.pubsub_numsub(f"{prefix}ledger:inv:{tool_request_id}")
    finally:
        await client.aclose()
    return int(count)


@pytest.mark.parametrize("retry_when", ["running", "finished"])
async def test_a_retry_on_another_invocation_replica_gets_the_outcome_of_a_killed_one(
    replicas: Replicas, tmp_path: Path, retry_when: str
) -> None:
    key = uuid.uuid4().hex
    arguments = {"key": key, "hold": True}
    async with InvocationClient(replicas.doomed.target) as client:
        calling = asyncio.create_task(client.invoke(SESSION, "count", arguments, turn_id="t"))
        [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
        replicas.doomed.process.kill()
        lost = await calling
    assert lost.outcome is None and lost.code is not None, lost
    ledger = Ledger(replicas.stores.ledger)
    if retry_when == "finished":
        (tmp_path / f"release-{key}").touch()
        record = await asyncio.wait_for(ledger.wait_finished(tool_request_id), 10)
        assert record is not None and record.outcome is not None
    async with InvocationClient(f"127.0.0.1:{replicas.survivor.port}") as client:
        retrying = asyncio.create_task(client.invoke(SESSION, "count", arguments, turn_id="t"))
        if retry_when == "running":
            # Joined first, released after: the retry waits on the ledger for the bridge's record.
            await eventually(lambda: watchers(replicas.prefix, tool_request_id))
            (tmp_path / f"release-{key}").touch()
        retried = await asyncio.wait_for(retrying, 10)
    assert retried.outcome is not None and retried.outcome.failure is None, retried
    assert retried.tool_request_id == tool_request_id
    assert (retried.joined, retried.replayed) == (retry_when == "running", retry_when == "finished")
    assert json.loads(retried.outcome.result_json or "")["runs"] == 1
    assert runs(tmp_path, key) == [tool_request_id]


@dataclass
class Bridges:
    prefix: str
    registry: RunningServer
    # Two bridge replicas, processes of their own; the host connects to the first one first.
    bridges: list[ServiceProcess]
    invocation: RunningServer
    host: HostProcess


@pytest_asyncio.fixture
async def bridges(tmp_path: Path) -> AsyncIterator[Bridges]:
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    replicas = [
        await start_service_process("bridge", "--registry", registry_internal, env=env) for _ in range(2)
    ]
    invocation = await start_invocation(
        registry_internal, replicas[1].internal_target, stores=open_stores(SHARED_URL, prefix)
    )
    async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
        await client.put_tools(SESSION, TOOLS)
    targets = ",".join(replica.target for replica in replicas)
    host = await start_host_process(targets, SESSION, "ledger_handlers:HANDLERS", tmp_path)
    yield Bridges(prefix, registry, replicas, invocation, host)
    await host.stop()
    for replica in replicas:
        if replica.process.returncode is None:
            replica.process.kill()
        await replica.stop()
    for server in (invocation, registry):
        await server.stop(0.5)
    await delete_prefixed(SHARED_URL, prefix)


async def test_a_result_outlives_the_bridge_replica_that_sent_the_request(
    bridges: Bridges, tmp_path: Path
) -> None:
    key = uuid.uuid4().hex
    arguments = {"key": key, "hold": True}
    async with InvocationClient(f"127.0.0.1:{bridges.invocation.port}") as client:
        calling = asyncio.create_task(client.invoke(SESSION, "count", arguments, turn_id="t"))
        [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
        # The bridge replica holding the host (and the request) dies mid-handler.
        bridges.bridges[0].process.kill()
        # Connected again, to the other replica, while the handler still runs.
        await eventually(lambda: [r for r in bridges.host.logs() if r.get("msg") == "host connected"][1:])
        (tmp_path / f"release-{key}").touch()
        result = await asyncio.wait_for(calling, 15)
    assert result.outcome is not None and result.outcome.failure is None, result
    assert result.tool_request_id == tool_request_id
    assert json.loads(result.outcome.result_json or "")["runs"] == 1
    assert runs(tmp_path, key) == [tool_request_id]
