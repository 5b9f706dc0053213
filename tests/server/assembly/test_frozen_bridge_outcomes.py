"""A result whose bridge replica froze (SIGSTOP) while the handler ran still reaches its caller.

Two bridge replicas and an invocation replica as processes of their own on one Redis, a host
process that knows both bridges, and a second invocation replica here. The host's session is on
bridge 0, which also holds the request (its route names it); bridge 0 is SIGSTOPped while the
handler runs, so the result cannot be handed in there. The host hands a copy of the result to
bridge 1 (which records it in the shared ledger) and gives the frozen bridge up when its receipt
does not come; the invocation replica that
dispatched the request through the frozen bridge answers its caller with that result; or, when
that replica was SIGKILLed, an exact retry through the other one replays it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_invocation, start_registry
from toolmesh.client import InvocationClient, RegistryClient
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

pytestmark = pytest.mark.integration

SESSION = "frozen-bridge"
TIMEOUT_MS = 5_000
# Not idempotent: it must not run again, whatever the bridges do.
TOOLS = [ToolSpec("count_short", "Counts its runs", '{"type": "object"}', timeout_ms=TIMEOUT_MS)]


def runs(marker_dir: Path, key: str) -> list[str]:
    """The tool request ids of every execution of `key` (ledger_handlers writes them)."""
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


@dataclass
class Deployment:
    registry: RunningServer
    # The host connects to bridge 0 first; both are processes, to freeze.
    bridges: list[ServiceProcess]
    # Invocation replica 0 is a process, to kill; replica 1 runs here.
    invocations: tuple[ServiceProcess, RunningServer]
    host: HostProcess


@pytest_asyncio.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    bridges = [
        await start_service_process("bridge", "--registry", registry_internal, env=env) for _ in range(2)
    ]
    # Each invocation replica's default bridge is bridge 1: the route (bridge 0, where the host
    # is) decides where the request goes.
    doomed = await start_service_process(
        "invocation", "--registry", registry_internal, "--bridge", bridges[1].internal_target, env=env
    )
    survivor = await start_invocation(
        registry_internal, bridges[1].internal_target, stores=open_stores(SHARED_URL, prefix)
    )
    async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
        await client.put_tools(SESSION, TOOLS)
    targets = ",".join(bridge.target for bridge in bridges)
    host = await start_host_process(targets, SESSION, "ledger_handlers:HANDLERS", tmp_path)
    try:
        yield Deployment(registry, bridges, (doomed, survivor), host)
    finally:
        for bridge in bridges:
            bridge.process.send_signal(signal.SIGCONT)
        await host.stop()
        for process in (*bridges, doomed):
            if process.process.returncode is None:
                process.process.kill()
            await process.stop()
        for server in (survivor, registry):
            await server.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)


def connections(host: HostProcess) -> int:
    return len([record for record in host.logs() if record.get("msg") == "host connected"])


async def freeze_while_running(deployment: Deployment, tmp_path: Path, key: str) -> str:
    """Wait for the handler of `key` to start, freeze bridge 0 (holding the host and the request),
    then let the handler end; its tool request id."""
    [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
    deployment.bridges[0].process.send_signal(signal.SIGSTOP)
    (tmp_path / f"release-{key}").touch()
    return tool_request_id


@pytest.mark.parametrize("through", [0, 1])
async def test_a_result_for_a_frozen_bridge_replica_reaches_the_caller(
    deployment: Deployment, tmp_path: Path, through: int
) -> None:
    """Through the invocation replica that dispatched it (a process, or one in this process)."""
    doomed, survivor = deployment.invocations
    target = doomed.target if through == 0 else f"127.0.0.1:{survivor.port}"
    assert connections(deployment.host) == 1
    key = uuid.uuid4().hex
    arguments = {"key": key, "hold": True}
    async with InvocationClient(target) as client:
        began = time.monotonic()
        # Unconfirmed, as a caller that lost the answer: an exact retry replays it.
        invoking = client.invoke(SESSION, "count_short", arguments, turn_id="t", confirm_delivery=False)
        calling = asyncio.create_task(invoking)
        tool_request_id = await freeze_while_running(deployment, tmp_path, key)
        result = await asyncio.wait_for(calling, 15)
        took = time.monotonic() - began
    assert result.outcome is not None and result.outcome.failure is None, result
    assert result.tool_request_id == tool_request_id
    assert json.loads(result.outcome.result_json or "")["runs"] == 1
    # Answered by the call's deadline (the result was recorded well before it), not after it.
    assert took < TIMEOUT_MS / 1000, took
    # The other replica took a copy of the result; the host gives the frozen one up once its
    # receipt does not come (its attempt's share of the time, and a grace).
    await eventually(lambda: connections(deployment.host) == 2)
    # An exact retry replays it; the tool never runs again.
    async with InvocationClient(f"127.0.0.1:{survivor.port}") as client:
        retried = await asyncio.wait_for(client.invoke(SESSION, "count_short", arguments, turn_id="t"), 15)
    assert retried.outcome == result.outcome and retried.replayed, retried
    deployment.bridges[0].process.send_signal(signal.SIGCONT)
    assert runs(tmp_path, key) == [tool_request_id]


async def test_an_exact_retry_gets_the_result_when_the_dispatching_replica_died_too(
    deployment: Deployment, tmp_path: Path
) -> None:
    doomed, survivor = deployment.invocations
    key = uuid.uuid4().hex
    arguments = {"key": key, "hold": True}
    async with InvocationClient(doomed.target) as client:
        calling = asyncio.create_task(client.invoke(SESSION, "count_short", arguments, turn_id="t"))
        tool_request_id = await freeze_while_running(deployment, tmp_path, key)
        doomed.process.kill()
        lost = await asyncio.wait_for(calling, 15)
    assert lost.outcome is None and lost.code is not None, lost
    # Retried at once: it joins the running record, and gets the result the host hands in on bridge 1.
    async with InvocationClient(f"127.0.0.1:{survivor.port}") as client:
        retrying = client.invoke(SESSION, "count_short", arguments, turn_id="t", confirm_delivery=False)
        retried = await asyncio.wait_for(retrying, 15)
        again = await asyncio.wait_for(client.invoke(SESSION, "count_short", arguments, turn_id="t"), 15)
    assert retried.outcome is not None and retried.outcome.failure is None, retried
    assert retried.tool_request_id == tool_request_id
    assert json.loads(retried.outcome.result_json or "")["runs"] == 1
    assert again.outcome == retried.outcome and again.replayed, again
    deployment.bridges[0].process.send_signal(signal.SIGCONT)
    assert runs(tmp_path, key) == [tool_request_id]
