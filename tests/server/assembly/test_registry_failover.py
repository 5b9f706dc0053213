"""Two registry replicas on one Redis, one killed: an invocation service given both fails no lookup.

The registries are processes of their own (SIGKILLed, not stopped); so is the invocation service,
started with `--registry a,b` as an operator would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_bridge
from toolmesh.client import CallResult, InvocationClient, RegistryClient
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

SESSION = "registry-replicas"
# Sessions whose first lookup comes after the kill: their tools are in Redis, no host serves them.
LATE_SESSIONS = [f"late-{i}" for i in range(5)]
TOOLS = [ToolSpec("count", "Counts its runs", '{"type": "object"}', timeout_ms=10_000)]


@dataclass
class Deployment:
    registries: list[ServiceProcess]
    bridge: RunningServer
    invocation: ServiceProcess
    host: HostProcess


@pytest_asyncio.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    prefix = new_prefix()
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    registries = [await start_service_process("registry", env=env) for _ in range(2)]
    bridge, _ = await start_bridge(stores=open_stores(SHARED_URL, prefix))
    both = ",".join(registry.internal_target for registry in registries)
    invocation = await start_service_process(
        "invocation", "--registry", both, "--bridge", f"127.0.0.1:{bridge.internal_port}", env=env
    )
    async with RegistryClient(registries[1].target) as client:
        for session in (SESSION, *LATE_SESSIONS):
            await client.put_tools(session, TOOLS)
    host = await start_host_process(f"127.0.0.1:{bridge.port}", SESSION, "ledger_handlers:HANDLERS", tmp_path)
    yield Deployment(registries, bridge, invocation, host)
    await host.stop()
    for process in (invocation, *registries):
        if process.process.returncode is None:
            process.process.kill()
        await process.stop()
    await bridge.stop(0.5)
    await delete_prefixed(SHARED_URL, prefix)


async def call(client: InvocationClient, session: str = SESSION) -> CallResult:
    return await client.invoke(session, "count", {"key": uuid.uuid4().hex}, turn_id="t", timeout=10)


def code_of(result: CallResult) -> str:
    if result.outcome is None:
        return (result.code.value if result.code else "none") + " (no outcome)"
    return "ok" if result.outcome.ok else result.outcome.code


async def test_a_registry_replica_killed_fails_no_call(deployment: Deployment) -> None:
    codes: Counter[str] = Counter()
    async with InvocationClient(deployment.invocation.target) as client:
        for _ in range(20):  # the session's watch is open, on the first registry (the preferred)
            codes[code_of(await call(client))] += 1
        assert codes == Counter(ok=20)
        stop = asyncio.Event()

        async def load() -> None:
            while not stop.is_set():
                codes[code_of(await call(client))] += 1

        loaders = [asyncio.create_task(load()) for _ in range(4)]
        await asyncio.sleep(0.5)
        deployment.registries[0].process.kill()  # SIGKILL, mid-load
        await asyncio.sleep(2.0)
        # First lookups after the kill: the dead replica refuses, the other answers.
        late = await asyncio.gather(*(call(client, session) for session in LATE_SESSIONS))
        stop.set()
        await asyncio.gather(*loaders)
    assert sum(count for code, count in codes.items() if "REGISTRY_UNAVAILABLE" in code) == 0, codes
    assert set(codes) == {"ok"}, codes
    # Found (no host serves them: the lookup passed, the dispatch did not).
    assert {code_of(result) for result in late} == {"TOOL_HOST_UNAVAILABLE"}
    # The broken watch kept its list while it reconnected to the other replica.
    await eventually(lambda: any("reconnecting" in line for line in deployment.invocation.output))


async def test_a_registry_replica_stopped_fails_no_first_lookup(deployment: Deployment) -> None:
    """SIGSTOPped, the preferred replica keeps its connections open and answers nothing: the first
    lookup of each session goes on to the other replica instead of waiting out its deadline."""
    stopped = deployment.registries[0].process
    stopped.send_signal(signal.SIGSTOP)
    try:
        async with InvocationClient(deployment.invocation.target) as client:
            late = await asyncio.gather(*(call(client, session) for session in LATE_SESSIONS))
            again = await asyncio.gather(*(call(client, session) for session in LATE_SESSIONS))
    finally:
        stopped.send_signal(signal.SIGCONT)
    # Found (no host serves them: the lookup passed, the dispatch did not).
    assert {code_of(result) for result in [*late, *again]} == {"TOOL_HOST_UNAVAILABLE"}
