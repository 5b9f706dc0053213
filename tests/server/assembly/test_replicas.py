"""Two bridge replicas and two invocation replicas on one Redis: every call reaches the host,
whichever replicas it goes through."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_bridge, start_invocation, start_registry
from toolmesh.bridge.router import Router
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.contracts.routes import route_of
from toolmesh.core.calls import ToolRequest
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.remote import RoutedDispatcher
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import Stores, open_stores
from toolmesh_testing import (
    SUPPORT,
    HostProcess,
    eventually,
    logged,
    run_cli,
    start_host_process,
    toolmesh_command,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

OBJECT = '{"type": "object"}'
SESSION = "replicas"
TOOLS = [
    ToolSpec("echo", "Echo the arguments", OBJECT),
    ToolSpec("slow_async", "Waits, cancellable", OBJECT, timeout_ms=400),
    ToolSpec("slow_sync", "Sleeps in a thread", OBJECT, timeout_ms=10_000),
]


@dataclass
class Cluster:
    prefix: str
    registry: RunningServer
    bridges: list[tuple[RunningServer, Router]]
    invocations: list[RunningServer]
    stores: Stores

    def bridge_internal(self, index: int) -> str:
        return f"127.0.0.1:{self.bridges[index][0].internal_port}"

    def invocation(self, index: int) -> str:
        return f"127.0.0.1:{self.invocations[index].port}"


# Every replica test runs on one Redis and on a Redis Cluster (sessions sharded over its primaries).
@pytest_asyncio.fixture(loop_scope="module", scope="module", params=["redis", "cluster"])
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    prefix = new_prefix()
    url = request.getfixturevalue("redis_cluster").url if request.param == "cluster" else SHARED_URL

    def stores() -> Stores:
        return open_stores(url, prefix)

    registry = await start_registry(stores=stores())
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    bridges = [await start_bridge(registry_target=registry_internal, stores=stores()) for _ in range(2)]
    # Both invocation replicas default to bridge 0: only a route takes them to bridge 1.
    default = f"127.0.0.1:{bridges[0][0].internal_port}"
    invocations = [await start_invocation(registry_internal, default, stores=stores()) for _ in range(2)]
    reader = stores()
    yield Cluster(prefix, registry, bridges, invocations, reader)
    await reader.close()
    for server in [*invocations, *(bridge for bridge, _ in bridges), registry]:
        await server.stop(0.5)
    if url == SHARED_URL:
        await delete_prefixed(SHARED_URL, prefix)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def host(cluster: Cluster, marker_dir: Path) -> AsyncIterator[HostProcess]:
    """A host of SESSION on bridge 1 (not the invocation replicas' default)."""
    async with RegistryClient(f"127.0.0.1:{cluster.registry.port}") as registry:
        await registry.put_tools(SESSION, TOOLS)
    bridge = cluster.bridges[1][0]
    process = await start_host_process(
        f"127.0.0.1:{bridge.port}", SESSION, "e2e_handlers:HANDLERS", marker_dir
    )
    # The route is written right after the host opens.
    await eventually(lambda: route_of(cluster.stores.store, SESSION))
    yield process
    await process.stop()


async def test_the_route_names_the_bridge_replica_holding_the_host(
    cluster: Cluster, host: HostProcess
) -> None:
    assert await route_of(cluster.stores.store, SESSION) == cluster.bridge_internal(1)
    assert await route_of(cluster.stores.store, "nobody-home") is None


@pytest.mark.parametrize("through", [0, 1])
async def test_calls_through_either_invocation_replica_reach_the_host(
    cluster: Cluster, host: HostProcess, through: int
) -> None:
    async with InvocationClient(cluster.invocation(through)) as client:
        result = await client.invoke(SESSION, "echo", {"n": through}, turn_id="t")
    assert result.outcome is not None and result.outcome.failure is None, result
    assert json.loads(result.outcome.result_json or "") == {
        "echo": {"n": through},
        "turnId": "t",
        "toolRequestId": result.tool_request_id,
    }


async def test_a_session_without_a_route_goes_to_the_default_bridge(
    cluster: Cluster, host: HostProcess
) -> None:
    async with RegistryClient(f"127.0.0.1:{cluster.registry.port}") as registry:
        await registry.put_tools("nobody-home", TOOLS)
    async with InvocationClient(cluster.invocation(0)) as client:
        result = await client.invoke("nobody-home", "echo", {}, turn_id="t")
    assert result.outcome is not None and result.outcome.failure is not None
    assert result.outcome.failure.code == "TOOL_HOST_UNAVAILABLE"


@pytest.mark.parametrize("through", [0, 1])
async def test_a_timeout_reaches_the_host_across_replicas(
    cluster: Cluster, host: HostProcess, marker_dir: Path, through: int
) -> None:
    name = f"timeout-{uuid.uuid4().hex}"
    async with InvocationClient(cluster.invocation(through)) as client:
        result = await client.invoke(SESSION, "slow_async", {"marker": name}, turn_id="t")
    assert result.outcome is not None and result.outcome.failure is not None
    assert result.outcome.failure.code == "TOOL_TIMEOUT"
    marker = marker_dir / f"cancelled-{name}"
    await eventually(lambda: marker.exists() and marker.read_text())
    assert marker.read_text() == "timeout"


async def test_a_dispatch_given_up_cancels_the_request_on_the_routed_replica(
    cluster: Cluster, host: HostProcess, marker_dir: Path
) -> None:
    name = f"cancel-{uuid.uuid4().hex}"
    dispatcher = RoutedDispatcher(cluster.stores.store, cluster.bridge_internal(0))
    request = ToolRequest(
        session_id=SESSION,
        turn_id="t",
        tool_request_id=f"tr_{uuid.uuid4().hex}",
        tool_name="slow_async",
        arguments_json=f'{{"marker": "{name}"}}',
        timeout_ms=30_000,
    )
    dispatching = asyncio.create_task(dispatcher.dispatch(request))
    await eventually((marker_dir / f"started-{name}").exists)
    assert dispatcher.targets == [cluster.bridge_internal(1)]
    dispatching.cancel()
    with pytest.raises(asyncio.CancelledError):
        await dispatching
    marker = marker_dir / f"cancelled-{name}"
    await eventually(lambda: marker.exists() and marker.read_text())
    assert marker.read_text() == "cancelled"
    await dispatcher.aclose()


async def test_the_route_goes_when_the_last_host_of_the_session_leaves(
    cluster: Cluster, marker_dir: Path
) -> None:
    session = f"leaving-{uuid.uuid4().hex[:8]}"
    bridge = cluster.bridges[0][0]
    process = await start_host_process(
        f"127.0.0.1:{bridge.port}", session, "e2e_handlers:HANDLERS", marker_dir
    )
    await eventually(lambda: route_of(cluster.stores.store, session))
    assert await route_of(cluster.stores.store, session) == cluster.bridge_internal(0)
    await process.stop()

    async def gone() -> bool:
        return await route_of(cluster.stores.store, session) is None

    await eventually(gone)


COUNTED = "counted"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def counting_host(cluster: Cluster, marker_dir: Path) -> AsyncIterator[HostProcess]:
    """A host of COUNTED on bridge 1, whose handler counts its executions in marker files."""
    async with RegistryClient(f"127.0.0.1:{cluster.registry.port}") as registry:
        await registry.put_tools(COUNTED, [ToolSpec("count", "Counts its runs", OBJECT, timeout_ms=10_000)])
    bridge = cluster.bridges[1][0]
    process = await start_host_process(
        f"127.0.0.1:{bridge.port}", COUNTED, "ledger_handlers:HANDLERS", marker_dir
    )
    await eventually(lambda: route_of(cluster.stores.store, COUNTED))
    yield process
    await process.stop()


def runs(marker_dir: Path, key: str) -> list[str]:
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


async def count(client: InvocationClient, arguments: dict[str, object], key: str = "") -> CallResult:
    return await client.invoke(COUNTED, "count", arguments, turn_id="t", idempotency_key=key)


async def test_fifty_identical_calls_over_two_invocation_replicas_run_once(
    cluster: Cluster, counting_host: HostProcess, marker_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    key = uuid.uuid4().hex
    async with (
        InvocationClient(cluster.invocation(0)) as one,
        InvocationClient(cluster.invocation(1)) as other,
    ):
        pending = asyncio.gather(
            *(count(client, {"key": key, "hold": True}) for _ in range(25) for client in (one, other))
        )
        await eventually(lambda: logged(caplog.records, "joined a running invocation") == 49)
        (marker_dir / f"release-{key}").touch()
        calls = await pending
    [tool_request_id] = runs(marker_dir, key)
    assert {call.tool_request_id for call in calls} == {tool_request_id}
    assert {call.outcome for call in calls} == {calls[0].outcome}
    assert calls[0].outcome is not None and calls[0].outcome.result_json is not None
    assert json.loads(calls[0].outcome.result_json)["runs"] == 1
    assert sum(call.joined for call in calls) == 49


async def test_another_caller_s_confirmation_on_another_replica_does_not_make_a_retry_run_again(
    cluster: Cluster, counting_host: HostProcess, marker_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gives up on replica 0; B joins on replica 1, gets the outcome and confirms; A's exact
    retry (on replica 1) replays it: one run."""
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    key = uuid.uuid4().hex
    held = {"key": key, "hold": True}
    async with InvocationClient(cluster.invocation(0)) as a, InvocationClient(cluster.invocation(1)) as b:
        gave_up = await a.invoke(COUNTED, "count", held, turn_id="t", timeout=0.5)
        assert gave_up.outcome is None and gave_up.code is Code.CALLER_DEADLINE_EXCEEDED
        assert gave_up.tool_request_id is not None and gave_up.attachment_id is not None
        joining = asyncio.ensure_future(count(b, held))
        await eventually(lambda: logged(caplog.records, "joined a running invocation") == 1)
        (marker_dir / f"release-{key}").touch()
        joined = await joining
        assert joined.joined and joined.tool_request_id == gave_up.tool_request_id
        await b.flush_confirmations()
    async with InvocationClient(cluster.invocation(1)) as a_again:
        # A's retry from a client that does not know its first attachment: the outcome is still there.
        retry = await count(a_again, held)
        assert retry.replayed and retry.tool_request_id == gave_up.tool_request_id
    assert runs(marker_dir, key) == [gave_up.tool_request_id]


async def test_get_invocation_and_idempotency_keys_work_from_every_replica(
    cluster: Cluster, counting_host: HostProcess, marker_dir: Path
) -> None:
    key = uuid.uuid4().hex
    async with (
        InvocationClient(cluster.invocation(0)) as one,
        InvocationClient(cluster.invocation(1)) as other,
    ):
        first = await count(one, {"key": key}, key=f"k-{key}")
        again = await count(other, {"key": key}, key=f"k-{key}")
        assert first.tool_request_id is not None
        assert again.replayed and again.tool_request_id == first.tool_request_id
        assert again.outcome == first.outcome
        with pytest.raises(grpc.aio.AioRpcError) as reused:
            await count(other, {"key": f"{key}-other"}, key=f"k-{key}")
        assert error_code(reused.value) is Code.IDEMPOTENCY_KEY_REUSED
        for client in (one, other):
            found = await client.get_invocation(first.tool_request_id)
            assert found.tool_request_id == first.tool_request_id and found.session_id == COUNTED
    assert runs(marker_dir, key) == [first.tool_request_id]


async def test_up_starts_replicas_of_each_service_on_one_store(marker_dir: Path) -> None:
    prefix = new_prefix()
    ports = ["--registry-port", "0", "--invocation-port", "0", "--bridge-port", "0", "--web-port", "0"]
    store = ["--store", SHARED_URL, "--store-prefix", prefix]
    up = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "up",
        *ports,
        *store,
        "--replicas",
        "2",
        stdout=asyncio.subprocess.PIPE,
        cwd=SUPPORT,
    )
    try:
        assert up.stdout is not None
        lines = [(await asyncio.wait_for(up.stdout.readline(), 20)).decode() for _ in range(6)]
        first = dict(line.split() for line in lines[1:4])
        words = lines[5].split()
        assert words[:2] == ["replica", "2:"], lines
        second = dict(zip(words[2::2], words[3::2], strict=True))
        # Tools put on one registry replica, the host on the second bridge replica, the call through
        # the first invocation replica: the route takes it there.
        env = dict(
            os.environ,
            TOOLMESH_REGISTRY_ADDR=second["registry"],
            TOOLMESH_INVOCATION_ADDR=first["invocation"],
        )
        async with RegistryClient(second["registry"]) as registry:
            await registry.put_tools("up-replicas", TOOLS)
        host = await start_host_process(second["bridge"], "up-replicas", "e2e_handlers:HANDLERS", marker_dir)
        try:
            code, out, err = await run_cli(
                "tool-call", "--thread-id", "up-replicas", "--tool", "echo", "--args", "{}", env=env
            )
            assert code == 0 and json.loads(out)["ok"] is True, (out, err)
        finally:
            await host.stop()
    finally:
        up.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(up.wait(), 20) == 0
        await delete_prefixed(SHARED_URL, prefix)


async def test_up_refuses_replicas_without_a_shared_store() -> None:
    code, _, err = await run_cli("up", "--replicas", "2", "--store", "memory", env=dict(os.environ))
    assert code == 2 and "needs a shared --store" in err


async def test_a_host_that_moves_to_another_bridge_replica_is_found_at_once(
    cluster: Cluster, marker_dir: Path
) -> None:
    session = f"moving-{uuid.uuid4().hex[:8]}"
    # Routes kept longer than the test: the second dispatch finds the first one's route stale.
    dispatcher = RoutedDispatcher(cluster.stores.store, cluster.bridge_internal(0), route_cache_s=600)
    try:
        for index in (0, 1):
            bridge = cluster.bridges[index][0]
            process = await start_host_process(
                f"127.0.0.1:{bridge.port}", session, "e2e_handlers:HANDLERS", marker_dir
            )
            try:

                async def routed(index: int = index) -> bool:
                    return await route_of(cluster.stores.store, session) == cluster.bridge_internal(index)

                await eventually(routed)
                request = ToolRequest(session, "t", f"tr_{uuid.uuid4().hex}", "echo", "{}", timeout_ms=5000)
                outcome = await dispatcher.dispatch(request)
                assert outcome.failure is None, outcome
            finally:
                await process.stop()
        assert cluster.bridge_internal(1) in dispatcher.targets
    finally:
        await dispatcher.aclose()
