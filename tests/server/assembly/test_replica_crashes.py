"""Replicas that die mid-call on one Redis: the call still runs once and its outcome is not lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from redis_testing import SHARED_URL, RedisServer, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_bridge, start_invocation, start_registry
from toolmesh.client import InvocationClient, InvocationState, RegistryClient
from toolmesh.contracts.ledger import Ledger
from toolmesh.core.errors import Code
from toolmesh.core.progress import ToolProgress
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import Stores, open_stores
from toolmesh_testing import (
    AskingHost,
    HostProcess,
    ServiceProcess,
    closed_address,
    eventually,
    logged,
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


@contextlib.asynccontextmanager
async def running_replicas(
    tmp_path: Path, store_url: str, prefix: str, session: str = SESSION, tools: list[ToolSpec] = TOOLS
) -> AsyncIterator[Replicas]:
    registry = await start_registry(stores=open_stores(store_url, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    bridge, _ = await start_bridge(registry_target=registry_internal, stores=open_stores(store_url, prefix))
    bridge_internal = f"127.0.0.1:{bridge.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=store_url, TOOLMESH_STORE_PREFIX=prefix)
    doomed = await start_service_process(
        "invocation", "--registry", registry_internal, "--bridge", bridge_internal, env=env
    )
    survivor = await start_invocation(
        registry_internal, bridge_internal, stores=open_stores(store_url, prefix)
    )
    async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
        await client.put_tools(session, tools)
    host = await start_host_process(f"127.0.0.1:{bridge.port}", session, "ledger_handlers:HANDLERS", tmp_path)
    stores = open_stores(store_url, prefix)
    try:
        yield Replicas(prefix, registry, bridge, doomed, survivor, stores, host)
    finally:
        await host.stop()
        if doomed.process.returncode is None:
            doomed.process.kill()
        await doomed.stop()
        for server in (survivor, bridge, registry):
            await server.stop(0.5)
        await stores.close()


@pytest_asyncio.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    prefix = new_prefix()
    async with running_replicas(tmp_path, SHARED_URL, prefix) as running:
        yield running
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


@contextlib.asynccontextmanager
async def running_bridges(
    tmp_path: Path, store_url: str, prefix: str, session: str = SESSION, tools: list[ToolSpec] = TOOLS
) -> AsyncIterator[Bridges]:
    registry = await start_registry(stores=open_stores(store_url, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=store_url, TOOLMESH_STORE_PREFIX=prefix)
    replicas = [
        await start_service_process("bridge", "--registry", registry_internal, env=env) for _ in range(2)
    ]
    invocation = await start_invocation(
        registry_internal, replicas[1].internal_target, stores=open_stores(store_url, prefix)
    )
    async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
        await client.put_tools(session, tools)
    targets = ",".join(replica.target for replica in replicas)
    host = await start_host_process(targets, session, "ledger_handlers:HANDLERS", tmp_path)
    try:
        yield Bridges(prefix, registry, replicas, invocation, host)
    finally:
        await host.stop()
        for replica in replicas:
            if replica.process.returncode is None:
                replica.process.kill()
            await replica.stop()
        for server in (invocation, registry):
            await server.stop(0.5)


@pytest_asyncio.fixture
async def bridges(tmp_path: Path) -> AsyncIterator[Bridges]:
    prefix = new_prefix()
    async with running_bridges(tmp_path, SHARED_URL, prefix) as running:
        yield running
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


async def test_a_result_left_unanswered_by_a_frozen_bridge_replica_is_taken_by_the_other(
    bridges: Bridges, tmp_path: Path
) -> None:
    """The host's replica freezes while the handler runs: a copy of the result goes to the other
    replica, which records it, and the caller has it long before the host would leave the frozen
    one (its attempt's share of the 20 s: 5 s), so a host killed meanwhile loses nothing."""
    key = uuid.uuid4().hex
    arguments = {"key": key, "hold": True}
    frozen = bridges.bridges[0].process
    async with InvocationClient(f"127.0.0.1:{bridges.invocation.port}") as client:
        calling = asyncio.create_task(client.invoke(SESSION, "count", arguments, turn_id="t"))
        [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
        frozen.send_signal(signal.SIGSTOP)
        try:
            (tmp_path / f"release-{key}").touch()
            result = await asyncio.wait_for(calling, 4)
        finally:
            frozen.send_signal(signal.SIGCONT)
    assert result.outcome is not None and result.outcome.failure is None, result
    assert result.tool_request_id == tool_request_id
    assert json.loads(result.outcome.result_json or "")["runs"] == 1
    assert runs(tmp_path, key) == [tool_request_id]
    assert [
        r
        for r in bridges.host.logs()
        if r.get("msg") == "result receipt late; copies to the other bridge replicas"
    ]


async def test_a_host_whose_every_bridge_replica_froze_stays_and_hands_its_result_in_after(
    bridges: Bridges, tmp_path: Path
) -> None:
    """Both replicas freeze while the handler runs: the copies go nowhere, and when the receipt's
    wait runs out no other replica answers a health check, so the host stays on its own replica.
    Once that one thaws it takes the result. Had the host left, the thawed replica would have ended
    the request TOOL_HOST_DISCONNECTED and refused the result after (bench.chaos seed 137)."""
    key = uuid.uuid4().hex
    frozen = [replica.process for replica in bridges.bridges]

    def staying() -> bool:
        message = "bridge silent and no other replica answers; staying"
        return any(record.get("msg") == message for record in bridges.host.logs())

    async with InvocationClient(f"127.0.0.1:{bridges.invocation.port}") as client:
        calling = asyncio.create_task(
            client.invoke(SESSION, "count", {"key": key, "hold": True}, turn_id="t")
        )
        [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
        for process in frozen:
            process.send_signal(signal.SIGSTOP)
        try:
            (tmp_path / f"release-{key}").touch()
            await eventually(staying, timeout=12)
        finally:
            for process in frozen:
                process.send_signal(signal.SIGCONT)
        result = await asyncio.wait_for(calling, 10)
    assert result.outcome is not None and result.outcome.failure is None, result
    assert result.tool_request_id == tool_request_id
    assert json.loads(result.outcome.result_json or "")["runs"] == 1
    assert runs(tmp_path, key) == [tool_request_id]
    assert not [
        r for r in bridges.host.logs() if r.get("msg") == "result receipt unanswered; leaving the bridge"
    ]


READ_ONLY = ToolSpec(
    "count_read_only",
    "Counts its runs",
    '{"type": "object"}',
    timeout_ms=20_000,
    annotations=ToolAnnotations(read_only=True),
)
# Not redeliverable, with a short deadline: its owner-lost rule ends it soon.
WRITES = ToolSpec("count_short", "Counts its runs", '{"type": "object"}', timeout_ms=5_000)


async def test_requests_held_by_a_dead_bridge_replica_go_to_another_when_redeliverable(
    bridges: Bridges, tmp_path: Path
) -> None:
    async with RegistryClient(f"127.0.0.1:{bridges.registry.port}") as registry:
        await registry.put_tools(SESSION, [*TOOLS, READ_ONLY, WRITES])
    # The fixture's host serves on replica 0 too: only the silent host may get these requests.
    await bridges.host.stop()
    doomed, survivor = bridges.bridges
    silent = AskingHost(doomed.target, SESSION, [READ_ONLY.name, WRITES.name], acknowledges_starts=False)
    try:
        await asyncio.wait_for(silent.opened, 10)
        keys = [uuid.uuid4().hex for _ in range(5)]
        writes_key = uuid.uuid4().hex
        async with InvocationClient(f"127.0.0.1:{bridges.invocation.port}") as client:
            reads = [
                asyncio.create_task(client.invoke(SESSION, READ_ONLY.name, {"key": key}, turn_id="t"))
                for key in keys
            ]
            writes = asyncio.create_task(
                client.invoke(SESSION, WRITES.name, {"key": writes_key}, turn_id="t")
            )
            # All six reached the silent host through replica 0 (the only one with a route).
            await eventually(lambda: len(silent.received) == 6)
            doomed.process.kill()
            # A host that runs them joins the other replica, which names itself in the route at once.
            host = await start_host_process(survivor.target, SESSION, "ledger_handlers:HANDLERS", tmp_path)
            try:
                results = await asyncio.wait_for(asyncio.gather(*reads), 30)
                # Not redeliverable, it may have run: not sent again; it ends when its owner is lost.
                written = await asyncio.wait_for(writes, 30)
            finally:
                await host.stop()
    finally:
        await silent.close()
    for key, result in zip(keys, results, strict=True):
        assert result.outcome is not None and result.outcome.failure is None, result
        assert runs(tmp_path, key) == [result.tool_request_id]  # once, on the other replica's host
    assert written.outcome is not None and written.outcome.failure is not None
    assert written.outcome.failure.code == "TOOL_TIMEOUT"
    assert (
        written.outcome.failure.details is not None and written.outcome.failure.details["ownerLost"] is True
    )
    assert runs(tmp_path, writes_key) == []


async def test_a_call_whose_bridge_is_down_ends_at_once_and_its_exact_retry_runs(tmp_path: Path) -> None:
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    # Its bridge is down (nothing listens there) and no route names another replica yet.
    invocation = await start_invocation(
        registry_internal, closed_address(), stores=open_stores(SHARED_URL, prefix)
    )
    bridge: RunningServer | None = None
    host: HostProcess | None = None
    key = uuid.uuid4().hex
    slow = ToolSpec("count", "Counts its runs", '{"type": "object"}', timeout_ms=60_000)
    try:
        async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
            await client.put_tools(SESSION, [slow])
        async with InvocationClient(f"127.0.0.1:{invocation.port}") as client:
            # Well before its 60 s deadline (and the owner-lost grace after it): the request never left.
            first = await asyncio.wait_for(client.invoke(SESSION, "count", {"key": key}, turn_id="t"), 15)
            assert first.outcome is not None and first.outcome.failure is not None, first
            failure = first.outcome.failure
            assert failure.code == "TOOL_HOST_UNAVAILABLE" and failure.retryable
            assert failure.details == {"sessionId": SESSION, "bridge": "unreachable"}
            assert runs(tmp_path, key) == []
            # A bridge replica with a host comes up; the route takes the exact retry there, and it runs.
            bridge, _ = await start_bridge(
                registry_target=registry_internal, stores=open_stores(SHARED_URL, prefix)
            )
            host = await start_host_process(
                f"127.0.0.1:{bridge.port}", SESSION, "ledger_handlers:HANDLERS", tmp_path
            )
            await host.wait_for_log(msg="host connected")
            retry = await client.invoke(SESSION, "count", {"key": key}, turn_id="t")
    finally:
        if host is not None:
            await host.stop()
        for server in (invocation, bridge, registry):
            if server is not None:
                await server.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)
    assert retry.outcome is not None and retry.outcome.failure is None, retry
    assert not retry.replayed and not retry.joined
    assert runs(tmp_path, key) == [retry.tool_request_id]


# A host's outcome arrives while Redis is down and the invocation replica that ran the call is dead:
# the bridge that got it keeps it and writes it once Redis is back, so the call's exact retry (on
# another replica) gets that one outcome, not a TOOL_TIMEOUT for a lost owner. Redis is one of the
# test's own (append-only, fsync on every write), killed with SIGKILL and started again.
OUTAGE_SESSION = "outcome-outage"
# Short, so that a lost outcome would show as the owner-lost TOOL_TIMEOUT within the test's time.
OUTAGE_TOOLS = [ToolSpec("count_short", "Counts its runs", '{"type": "object"}', timeout_ms=4000)]


@pytest_asyncio.fixture
async def on_own_redis(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Replicas]:
    async with running_replicas(tmp_path, redis_server.url, "", OUTAGE_SESSION, OUTAGE_TOOLS) as running:
        yield running


@pytest.mark.timeout(90)
async def test_an_outcome_arriving_while_redis_and_its_invocation_replica_are_dead_is_kept(
    on_own_redis: Replicas, redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    key = uuid.uuid4().hex
    arguments = {"key": key, "hold": True}
    async with InvocationClient(on_own_redis.doomed.target) as client:
        calling = asyncio.create_task(client.invoke(OUTAGE_SESSION, "count_short", arguments, turn_id="t"))
        [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
        await redis_server.kill()
        on_own_redis.doomed.process.kill()
        lost = await asyncio.wait_for(calling, 10)
    assert lost.outcome is None, lost
    # The handler ends now: its outcome reaches the bridge, which cannot read the ledger.
    (tmp_path / f"release-{key}").touch()
    handled = ("outcome kept until the store is back", "outcome not recorded")
    await eventually(lambda: any(logged(caplog.records, message) for message in handled))
    await redis_server.start()
    async with InvocationClient(f"127.0.0.1:{on_own_redis.survivor.port}") as client:
        retried = await asyncio.wait_for(
            client.invoke(OUTAGE_SESSION, "count_short", arguments, turn_id="t"), 20
        )
    assert retried.outcome is not None and retried.outcome.failure is None, retried
    assert retried.tool_request_id == tool_request_id and (retried.joined or retried.replayed)
    assert json.loads(retried.outcome.result_json or "")["runs"] == 1
    assert runs(tmp_path, key) == [tool_request_id]
    assert logged(caplog.records, "outcome not recorded") == 0


@pytest.mark.timeout(90)
async def test_a_result_handed_in_on_another_bridge_replica_during_a_redis_outage_is_taken(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The bridge replica holding the request dies and the host moves to the other one; Redis is
    down when the handler ends, so that replica cannot read the ledger to adopt the result: it
    refuses it with STORE_UNAVAILABLE, and the host tries again until Redis is back: the call gets
    the one result."""
    key = uuid.uuid4().hex
    arguments = {"key": key, "hold": True}
    async with running_bridges(tmp_path, redis_server.url, "") as bridges:
        async with InvocationClient(f"127.0.0.1:{bridges.invocation.port}") as client:
            calling = asyncio.create_task(client.invoke(SESSION, "count", arguments, turn_id="t"))
            [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
            bridges.bridges[0].process.kill()
            await eventually(lambda: [r for r in bridges.host.logs() if r.get("msg") == "host connected"][1:])
            await redis_server.kill()
            (tmp_path / f"release-{key}").touch()
            # The bridge replica cannot read the ledger to adopt the result: the host is told to try again.
            await bridges.host.wait_for_log(msg="submit refused; trying again", cause="STORE_UNAVAILABLE")
            await redis_server.start()
            result = await asyncio.wait_for(calling, 30)
        host_logs = bridges.host.logs()
    assert result.outcome is not None and result.outcome.failure is None, result
    assert result.tool_request_id == tool_request_id
    assert json.loads(result.outcome.result_json or "")["runs"] == 1
    assert runs(tmp_path, key) == [tool_request_id]
    assert [r for r in host_logs if r.get("msg") == "submit failed"] == []


# The invocation replica that runs a call dies; another one takes its cancellation. The bridge
# replica holding the request follows the store's cancellations: the handler hears it at once.
UNTIL_CANCELLED = ToolSpec(
    "report_until_cancelled", "Reports progress until cancelled", '{"type": "object"}', timeout_ms=30_000
)


async def test_a_cancel_reaches_the_host_when_the_replica_running_the_call_died(tmp_path: Path) -> None:
    prefix = new_prefix()
    key = uuid.uuid4().hex
    try:
        async with running_replicas(tmp_path, SHARED_URL, prefix, tools=[UNTIL_CANCELLED]) as replicas:
            async with InvocationClient(replicas.doomed.target) as client:
                calling = asyncio.create_task(
                    client.invoke(SESSION, UNTIL_CANCELLED.name, {"key": key}, turn_id="t")
                )
                [tool_request_id] = await eventually(lambda: runs(tmp_path, key))
                replicas.doomed.process.kill()
                lost = await asyncio.wait_for(calling, 10)
            assert lost.outcome is None, lost
            marker = tmp_path / f"cancelled-{key}"
            async with InvocationClient(f"127.0.0.1:{replicas.survivor.port}") as other:
                asked_at = time.time()
                assert await other.cancel_invocation(tool_request_id) is True
                await eventually(lambda: marker.exists() and marker.read_text(), timeout=5)
                seen_at, reason = marker.read_text().split()
                record = await other.get_invocation(tool_request_id)
                retried = await other.invoke(SESSION, UNTIL_CANCELLED.name, {"key": key}, turn_id="t")
    finally:
        await delete_prefixed(SHARED_URL, prefix)
    # Within a second (same machine clock), long before the 30 s deadline would have ended it.
    assert reason == "cancelled" and float(seen_at) - asked_at < 1.0
    assert record.state is InvocationState.CANCELLED
    assert retried.outcome is not None and retried.outcome.code == Code.TOOL_CANCELLED and retried.replayed
    assert runs(tmp_path, key) == [tool_request_id]


async def test_progress_reaches_a_caller_that_joined_through_another_invocation_replica(
    tmp_path: Path,
) -> None:
    """Two invocation replicas, processes of their own: a RunTool caller on each, the second an
    exact retry that joins the invocation the first replica runs."""
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    bridge, _ = await start_bridge(registry_target=registry_internal, stores=open_stores(SHARED_URL, prefix))
    bridge_internal = f"127.0.0.1:{bridge.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    invocations = [
        await start_service_process(
            "invocation", "--registry", registry_internal, "--bridge", bridge_internal, env=env
        )
        for _ in range(2)
    ]
    host: HostProcess | None = None
    key = uuid.uuid4().hex
    # 150 reports 10 ms apart: the bridge forwards at most one per 100 ms.
    arguments = {"key": key, "steps": 150}
    seen: list[list[tuple[float, float]]] = [[], []]
    try:
        async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
            await client.put_tools(SESSION, [UNTIL_CANCELLED])
        bridge_target = f"127.0.0.1:{bridge.port}"
        host = await start_host_process(bridge_target, SESSION, "ledger_handlers:HANDLERS", tmp_path)
        async with (
            InvocationClient(invocations[0].target) as first,
            InvocationClient(invocations[1].target) as second,
        ):

            def noting(index: int) -> Callable[[ToolProgress], None]:
                return lambda progress: seen[index].append((time.monotonic(), progress.progress))

            running = asyncio.create_task(
                first.invoke(SESSION, UNTIL_CANCELLED.name, arguments, turn_id="t", on_progress=noting(0))
            )
            await eventually(lambda: seen[0])
            joined_at = time.monotonic()
            joining = asyncio.create_task(
                second.invoke(SESSION, UNTIL_CANCELLED.name, arguments, turn_id="t", on_progress=noting(1))
            )
            ran, joined = await asyncio.wait_for(asyncio.gather(running, joining), 30)
            ended_at = time.monotonic()
    finally:
        if host is not None:
            await host.stop()
        for invocation in invocations:
            await invocation.stop()
        for server in (bridge, registry):
            await server.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)
    assert ran.outcome is not None and ran.outcome.failure is None, ran
    assert joined.joined and joined.tool_request_id == ran.tool_request_id and joined.outcome == ran.outcome
    assert runs(tmp_path, key) == [ran.tool_request_id]
    values = [value for _, value in seen[1]]
    # Several reports reached the joined caller, newer ones only, no more than one per 100 ms.
    assert len(values) >= 3 and values == sorted(set(values)), values
    assert len(values) <= (ended_at - joined_at) / 0.1 + 2, values
