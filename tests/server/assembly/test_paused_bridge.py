"""A bridge replica frozen (SIGSTOP) past its requests' deadlines starts none of them when it wakes.

The bridge is a process of its own, frozen and thawed with SIGSTOP/SIGCONT while the invocation
service's DispatchToolRequests messages queue in its socket. Its host either acknowledges starts
(a `toolmesh host` process, ledger_handlers) or not (a ToolHost here, as hosts were before): the
handlers of both write every start in a file. The invocation service tells the bridge to cancel a
request it gave up on, on the same stream, right after it: only a host that asks before starting
is fenced by that alone, so the other one shows whether the bridge keeps the invocation's deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_invocation, start_registry
from toolmesh.client import Invocation, InvocationClient, InvocationState, RegistryClient
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.host import HostError, ToolContext, ToolHost
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

SESSION = "paused-bridge"
OBJECT = '{"type": "object"}'
TOOLS = [
    ToolSpec("count", "Counts its runs", OBJECT, timeout_ms=10_000),
    ToolSpec("count_short", "Counts its runs, briefly", OBJECT, timeout_ms=1_000),
    ToolSpec("wait", "Returns when the test says", OBJECT, timeout_ms=3_000),
    ToolSpec(
        "count_read_only",
        "Counts its runs, briefly; read-only",
        OBJECT,
        timeout_ms=1_000,
        annotations=ToolAnnotations(read_only=True),
    ),
]


def runs(marker_dir: Path, key: str) -> list[str]:
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


@dataclass
class Deployment:
    bridge: ServiceProcess
    invocation: RunningServer
    host: HostProcess | ToolHost


def counting_host(bridge_target: str, marker_dir: Path) -> ToolHost:
    """A host that runs each request as it reads it (no start acknowledgements)."""
    host = ToolHost(bridge_target, SESSION, acknowledge_starts=False)

    async def count(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        with (marker_dir / f"runs-{args['key']}").open("a") as log:
            log.write(ctx.tool_request_id + "\n")
        return {"key": args["key"]}

    for tool in TOOLS:
        host.on_tool(tool.name, count)
    return host


@dataclass
class Services:
    bridge: ServiceProcess
    invocation: RunningServer


@pytest_asyncio.fixture
async def services() -> AsyncIterator[Services]:
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    bridge = await start_service_process("bridge", "--registry", registry_internal, env=env)
    invocation = await start_invocation(
        registry_internal, bridge.internal_target, stores=open_stores(SHARED_URL, prefix)
    )
    async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
        await client.put_tools(SESSION, TOOLS)
    try:
        yield Services(bridge, invocation)
    finally:
        bridge.process.send_signal(signal.SIGCONT)
        await bridge.stop()
        for server in (invocation, registry):
            await server.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)


@pytest_asyncio.fixture(params=["acknowledging starts", "not acknowledging starts"])
async def deployment(
    request: pytest.FixtureRequest, services: Services, tmp_path: Path
) -> AsyncIterator[Deployment]:
    target = services.bridge.target
    host: HostProcess | ToolHost
    if request.param == "acknowledging starts":
        host = await start_host_process(target, SESSION, "ledger_handlers:HANDLERS", tmp_path)
    else:
        host = counting_host(target, tmp_path)
        await host.start()
    try:
        yield Deployment(services.bridge, services.invocation, host)
    finally:
        services.bridge.process.send_signal(signal.SIGCONT)
        await host.stop()


async def test_requests_read_past_their_deadline_by_a_thawed_bridge_never_start(
    deployment: Deployment, tmp_path: Path
) -> None:
    bridge = deployment.bridge.process
    late = {tool: uuid.uuid4().hex for tool in ("count_short", "count_read_only")}
    async with InvocationClient(f"127.0.0.1:{deployment.invocation.port}") as client:
        # The dispatch stream is open: what follows queues in the bridge's socket.
        warm = await client.invoke(SESSION, "count", {"key": uuid.uuid4().hex}, turn_id="t")
        assert warm.outcome is not None and warm.outcome.ok, warm
        bridge.send_signal(signal.SIGSTOP)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(client.invoke(SESSION, tool, {"key": key}, turn_id="t") for tool, key in late.items())
            ),
            15,
        )
        for result in results:
            assert result.outcome is not None and result.outcome.code == "TOOL_TIMEOUT", result
        bridge.send_signal(signal.SIGCONT)
        # Read after the late ones, on the same stream, by the same host: once it has run, the
        # late ones were read and answered (with TOOL_TIMEOUT, on the bridge) before.
        after_key = uuid.uuid4().hex
        after = await client.invoke(SESSION, "count", {"key": after_key}, turn_id="t2")
        assert after.outcome is not None and after.outcome.ok, after
        assert runs(tmp_path, after_key) == [after.tool_request_id]
    for key in late.values():
        assert runs(tmp_path, key) == [], key


async def test_a_result_held_by_a_frozen_bridge_past_the_deadline_is_kept_beside_the_timeout(
    services: Services,
) -> None:
    """The caller is told TOOL_TIMEOUT (may have run) while the bridge is frozen; the host keeps
    handing its result in, and once the bridge thaws the ledger keeps it: GetInvocation shows
    what the handler did, and an exact retry gets it, without running the tool again."""
    bridge = services.bridge.process
    started = asyncio.Event()
    released = asyncio.Event()
    ran: list[str] = []
    errors: list[HostError] = []

    async def wait(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        ran.append(ctx.tool_request_id)
        started.set()
        await released.wait()
        return {"key": args["key"]}

    host = ToolHost(services.bridge.target, SESSION)
    host.on_tool("wait", wait)
    host.on_error(errors.append)
    await host.start()
    try:
        async with InvocationClient(f"127.0.0.1:{services.invocation.port}") as client:
            # Not confirmed, as by a caller whose answer was lost: its exact retry replays.
            calling = asyncio.create_task(
                client.invoke(SESSION, "wait", {"key": "k"}, turn_id="t", confirm_delivery=False)
            )
            await asyncio.wait_for(started.wait(), 10)
            bridge.send_signal(signal.SIGSTOP)
            released.set()  # the handler's result goes to a bridge that reads nothing
            result = await asyncio.wait_for(calling, 15)
            assert result.outcome is not None and result.outcome.code == "TOOL_TIMEOUT", result
            assert result.tool_request_id is not None
            bridge.send_signal(signal.SIGCONT)

            async def late() -> Invocation | None:
                shown = await client.get_invocation(str(result.tool_request_id))
                return shown if shown.late_outcome is not None else None

            shown = await eventually(late, timeout=30)
            assert shown.state is InvocationState.TIMED_OUT and shown.outcome == result.outcome
            assert shown.late_outcome is not None and shown.late_outcome.result_json == '{"key":"k"}'
            assert shown.to_json()["late"]["result"] == {"key": "k"}
            again = await client.invoke(SESSION, "wait", {"key": "k"}, turn_id="t")
            assert again.replayed and again.tool_request_id == result.tool_request_id
            assert again.outcome is not None and again.outcome.result_json == '{"key":"k"}'
    finally:
        bridge.send_signal(signal.SIGCONT)
        await host.stop()
    assert ran == [result.tool_request_id] and errors == []
