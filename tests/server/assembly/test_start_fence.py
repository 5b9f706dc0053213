"""A bridge replica SIGKILLed while it holds requests its host has not started: the start fence.

Bridge replicas are processes of their own on one Redis; the invocation service runs here. The
host the requests reach first acknowledges starts but asks START only when the test says (a
raw host session here, which runs nothing): so the test knows which requests were started when
their replica dies. A request never started goes, with its dispatch generation moved on, to a
`toolmesh host` process (ledger_handlers, which writes every execution in a file) on the other
replica, or on the same one restarted, and runs there once; one started keeps the outcome it had
before the fence (its host may have run it: not sent again).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_invocation, start_registry
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import open_stores
from toolmesh.v1 import bridge_pb2
from toolmesh_testing import AskingHost, ServiceProcess, eventually, start_host_process, start_service_process

pytestmark = pytest.mark.integration

SESSION = "start-fence"
OBJECT = '{"type": "object"}'
# Not read-only nor idempotent: only the start fence lets it go to another replica.
COUNT = ToolSpec("count", "Counts its runs", OBJECT, timeout_ms=20_000)
# Started before its replica dies: it ends when its owner is lost (deadline and grace), so short.
COUNT_SHORT = ToolSpec("count_short", "Counts its runs", OBJECT, timeout_ms=4_000)


def runs(marker_dir: Path, key: str) -> list[str]:
    """The tool request ids of every execution of `key` (ledger_handlers writes them)."""
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


@contextlib.asynccontextmanager
async def services(
    bridge_count: int,
) -> AsyncIterator[tuple[RunningServer, list[ServiceProcess], str, dict[str, str]]]:
    """A registry and the invocation service here, `bridge_count` bridge processes (the invocation
    service's default bridge is the first); yields them, the Redis prefix and the environment."""
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    bridges: list[ServiceProcess] = []
    invocation: RunningServer | None = None
    try:
        for _ in range(bridge_count):
            bridges.append(await start_service_process("bridge", "--registry", registry_internal, env=env))
        invocation = await start_invocation(
            registry_internal, bridges[0].internal_target, stores=open_stores(SHARED_URL, prefix)
        )
        async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
            await client.put_tools(SESSION, [COUNT, COUNT_SHORT])
        yield invocation, bridges, registry_internal, env
    finally:
        for bridge in bridges:
            if bridge.process.returncode is None:
                bridge.process.kill()
            await bridge.stop()
        for server in (invocation, registry):
            if server is not None:
                await server.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)


def succeeded(result: CallResult, marker_dir: Path, key: str) -> None:
    """It answered the one execution's result, which ran once, as the invocation the call made."""
    assert result.outcome is not None and result.outcome.failure is None, result
    assert json.loads(result.outcome.result_json or "")["runs"] == 1
    assert runs(marker_dir, key) == [result.tool_request_id]


async def test_requests_a_killed_bridge_replica_never_started_run_once_through_another(
    tmp_path: Path,
) -> None:
    async with services(2) as (invocation, (doomed, survivor), _, _):
        asking = AskingHost(doomed.target, SESSION, [COUNT.name, COUNT_SHORT.name])
        try:
            await asyncio.wait_for(asking.opened, 10)
            unstarted_key, started_key = uuid.uuid4().hex, uuid.uuid4().hex
            async with InvocationClient(f"127.0.0.1:{invocation.port}") as client:
                unstarted = asyncio.create_task(
                    client.invoke(SESSION, COUNT.name, {"key": unstarted_key}, turn_id="t")
                )
                started = asyncio.create_task(
                    client.invoke(SESSION, COUNT_SHORT.name, {"key": started_key}, turn_id="t")
                )
                await eventually(lambda: len(asking.received) == 2)
                by_tool = {
                    (await client.get_invocation(tool_request_id)).tool_name: tool_request_id
                    for tool_request_id in asking.received
                }
                assert await asking.start(by_tool[COUNT_SHORT.name]) == bridge_pb2.TOOL_START_VERDICT_START
                # Asked once more: the grant is given once.
                assert (
                    await asking.start(by_tool[COUNT_SHORT.name])
                    == bridge_pb2.TOOL_START_VERDICT_ALREADY_STARTED
                )
                waiting = await client.get_invocation(by_tool[COUNT.name])
                marked = await client.get_invocation(by_tool[COUNT_SHORT.name])
                assert waiting.started_at is None and marked.started_at is not None
                doomed.process.kill()
                host = await start_host_process(
                    survivor.target, SESSION, "ledger_handlers:HANDLERS", tmp_path
                )
                try:
                    ran = await asyncio.wait_for(unstarted, 30)
                    kept = await asyncio.wait_for(started, 30)
                finally:
                    await host.stop()
                record = await client.get_invocation(by_tool[COUNT.name])
        finally:
            await asking.close()
    succeeded(ran, tmp_path, unstarted_key)
    assert ran.tool_request_id == by_tool[COUNT.name] and not ran.joined
    assert record.started_at is not None and record.started_at >= waiting.created_at
    # Started on the lost replica's host: not sent again (it may have run), its outcome as before.
    assert kept.outcome is not None and kept.outcome.failure is not None, kept
    assert kept.outcome.failure.code == "TOOL_TIMEOUT"
    assert kept.outcome.failure.details is not None and kept.outcome.failure.details["ownerLost"] is True
    assert runs(tmp_path, started_key) == []


async def test_a_request_whose_only_bridge_restarted_waits_for_its_host_and_runs_once(
    tmp_path: Path,
) -> None:
    async with services(1) as (invocation, bridges, registry_internal, env):
        [bridge] = bridges
        asking = AskingHost(bridge.target, SESSION, [COUNT.name, COUNT_SHORT.name])
        try:
            await asyncio.wait_for(asking.opened, 10)
            key = uuid.uuid4().hex
            async with InvocationClient(f"127.0.0.1:{invocation.port}") as client:
                calling = asyncio.create_task(client.invoke(SESSION, COUNT.name, {"key": key}, turn_id="t"))
                await eventually(lambda: asking.received)
                bridge.process.kill()
                await bridge.stop()
                # The same addresses again; the request waits (within its time) for a host there.
                assert bridge.internal_port is not None
                ports = {"bridge": bridge.port, "bridge-internal": bridge.internal_port}
                restarted = await start_service_process(
                    "bridge", "--registry", registry_internal, env=env, ports=ports
                )
                bridges.append(restarted)
                host = await start_host_process(
                    restarted.target, SESSION, "ledger_handlers:HANDLERS", tmp_path
                )
                try:
                    result = await asyncio.wait_for(calling, 30)
                finally:
                    await host.stop()
        finally:
            await asking.close()
    succeeded(result, tmp_path, key)
    assert result.tool_request_id == asking.received[0]
