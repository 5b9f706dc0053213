"""Redis goes away and comes back: typed errors meanwhile, nothing lost or run twice, no restart needed.

A redis-server of this test's own (append-only file, fsync on every write) is
killed with SIGKILL while the services run on it, then started again on the
same port with the same files.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from redis_testing import RedisServer
from toolmesh.assembly.system import LocalSystem, start_invocation, start_local_system
from toolmesh.client import CallResult, Invocation, InvocationClient, InvocationState, RegistryClient
from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import open_stores
from toolmesh.v1 import registry_pb2, registry_pb2_grpc
from toolmesh_testing import HostProcess, eventually, logged, start_host_process

SESSION = "outage"
TOOLS = [
    ToolSpec("count", "Counts its runs", '{"type": "object"}', timeout_ms=10_000),
    # For calls that wait out their deadline and the owner's grace (5 s by default).
    ToolSpec("count_short", "Counts its runs, short deadline", '{"type": "object"}', timeout_ms=1000),
]

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def system(redis_server: RedisServer) -> AsyncIterator[LocalSystem]:
    running = await start_local_system(heartbeat_s=0.5, store_url=redis_server.url)
    async with RegistryClient(running.registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    yield running
    await running.stop(grace=0.5)


@pytest_asyncio.fixture
async def host(system: LocalSystem, marker_dir: Path) -> AsyncIterator[HostProcess]:
    process = await start_host_process(system.bridge_target, SESSION, "ledger_handlers:HANDLERS", marker_dir)
    yield process
    await process.stop()


def runs(marker_dir: Path, key: str) -> list[str]:
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


async def count(client: InvocationClient, key: str, sleep: float = 0.0, **kwargs: Any) -> CallResult:
    call = client.invoke(SESSION, "count", {"key": key, "sleep": sleep}, turn_id="turn", **kwargs)
    # Nothing may hang: a call answers within its bounded store timeouts, far below this.
    return await asyncio.wait_for(call, 15)


async def until_runs(marker_dir: Path, key: str) -> None:
    while True:
        if runs(marker_dir, key):
            return
        await asyncio.sleep(0.02)


async def until_recorded(client: InvocationClient, tool_request_id: str) -> Invocation:
    """The ledger's record once the outcome kept during the outage has been written."""
    while True:
        try:
            record = await client.get_invocation(tool_request_id)
        except grpc.aio.AioRpcError as error:
            assert error_code(error) is Code.STORE_UNAVAILABLE
        else:
            if record.state is not InvocationState.RUNNING:
                return record
        await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
async def test_redis_killed_and_restarted(
    redis_server: RedisServer, system: LocalSystem, host: HostProcess, marker_dir: Path
) -> None:
    async with (
        InvocationClient(system.invocation_target) as client,
        grpc.aio.insecure_channel(system.registry_target) as channel,
    ):
        registry = registry_pb2_grpc.RegistryServiceStub(channel)
        before = await count(client, "before", confirm_delivery=False)
        keyed = await count(client, "keyed", idempotency_key="order-1")
        watch = registry.WatchTools(registry_pb2.WatchToolsRequest(session_id="watched"))
        first = await asyncio.wait_for(watch.read(), 5)
        assert isinstance(first, registry_pb2.WatchToolsResponse) and first.revision == 0
        during = asyncio.ensure_future(count(client, "during", 1.0, confirm_delivery=False))
        await asyncio.wait_for(until_runs(marker_dir, "during"), 10)

        await redis_server.kill()

        # New calls fail at once with the typed, retryable error; nothing ran for them.
        refused = await count(client, "refused")
        assert refused.outcome is None and refused.code is Code.STORE_UNAVAILABLE
        assert runs(marker_dir, "refused") == []
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await registry.ListTools(registry_pb2.ListToolsRequest(session_id=SESSION), timeout=15)
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
        assert error_code(raised.value) is Code.STORE_UNAVAILABLE
        # The call that was running when Redis went away still gets its outcome.
        finished = await during
        assert finished.outcome is not None and json.loads(finished.outcome.result_json or "")["runs"] == 1

        await redis_server.start()

        # Everything recorded before is there; an exact retry replays, and runs nothing.
        retry = await count(client, "before", confirm_delivery=False)
        assert retry.replayed and retry.tool_request_id == before.tool_request_id
        again = await count(client, "keyed", idempotency_key="order-1")
        assert again.replayed and again.tool_request_id == keyed.tool_request_id
        # The outcome known during the outage was written once Redis was back.
        assert finished.tool_request_id is not None
        record = await asyncio.wait_for(until_recorded(client, finished.tool_request_id), 15)
        assert record.state is InvocationState.COMPLETED
        assert record.outcome is not None and record.outcome.result_json == finished.outcome.result_json
        replayed = await count(client, "during", 1.0)
        assert replayed.replayed and replayed.tool_request_id == finished.tool_request_id
        for key in ("before", "keyed", "during"):
            assert len(runs(marker_dir, key)) == 1, key
        # The watch opened before the outage is subscribed again: it sees a put made after.
        async with RegistryClient(system.registry_target) as writer:
            revision = await writer.put_tools("watched", TOOLS)
        seen = await asyncio.wait_for(watch.read(), 10)
        assert isinstance(seen, registry_pb2.WatchToolsResponse)
        assert seen.revision == revision and [t.name for t in seen.tools] == [t.name for t in TOOLS]
        watch.cancel()
        # New calls work again, without restarting anything.
        fresh = await count(client, "after")
        assert fresh.outcome is not None and fresh.outcome.failure is None


async def test_a_caller_gone_during_its_claim_leaves_a_call_that_runs_once(
    redis_server: RedisServer, system: LocalSystem, host: HostProcess, marker_dir: Path
) -> None:
    """The claim is on its way to Redis when the caller's deadline passes: it goes on, and the
    invocation it made runs, so an exact retry joins or replays a call that really runs."""
    async with InvocationClient(system.invocation_target) as client:
        await count(client, "warm")  # the invocation service has the session's tools
        pauser = Redis.from_url(redis_server.url)
        await pauser.client_pause(500)
        await pauser.aclose()
        first = await count(client, "paused", timeout=0.2, confirm_delivery=False)
        assert first.outcome is None and first.code is Code.CALLER_DEADLINE_EXCEEDED
        await asyncio.wait_for(until_runs(marker_dir, "paused"), 10)
        retry = await count(client, "paused", confirm_delivery=False)
        assert retry.joined or retry.replayed
        assert runs(marker_dir, "paused") == [retry.tool_request_id]


async def test_a_redis_that_answers_nothing_fails_calls_in_bounded_time(
    redis_server: RedisServer, system: LocalSystem, host: HostProcess, marker_dir: Path
) -> None:
    async with InvocationClient(system.invocation_target) as client:
        await count(client, "warm")
        redis_server.pause()
        try:
            hung = await count(client, "hung")  # count() fails the test past 15 s: no hang
            assert hung.outcome is None and hung.code is Code.STORE_UNAVAILABLE
        finally:
            redis_server.resume()
        assert runs(marker_dir, "hung") == []
        resumed = await count(client, "resumed")
        assert resumed.outcome is not None and resumed.outcome.failure is None


@pytest_asyncio.fixture
async def second_invocation(redis_server: RedisServer, system: LocalSystem) -> AsyncIterator[RunningServer]:
    """Another invocation replica on the same Redis, registry and bridge."""
    replica = await start_invocation(
        f"127.0.0.1:{system.registry.internal_port}",
        f"127.0.0.1:{system.bridge.internal_port}",
        stores=open_stores(redis_server.url),
    )
    yield replica
    await replica.stop(0.5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("outage", ["killed", "stopped"])
async def test_a_call_waiting_on_the_ledger_when_redis_fails_is_told_the_tool_may_have_run(
    redis_server: RedisServer,
    system: LocalSystem,
    second_invocation: RunningServer,
    *,
    host: HostProcess,
    marker_dir: Path,
    caplog: pytest.LogCaptureFixture,
    outage: str,
) -> None:
    """The call runs on one replica; an identical call on another joins it and waits for its
    outcome in the ledger; Redis goes away (SIGKILL, or SIGSTOP) and the tool runs to its end. The
    joined call gets no outcome and a code that says the tool may have run, never one that says
    nothing ran; its exact retry gets the one outcome once Redis is back."""
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    arguments = {"key": outage, "hold": 1}
    async with (
        InvocationClient(system.invocation_target) as owner,
        InvocationClient(f"127.0.0.1:{second_invocation.port}") as joiner,
    ):
        running = asyncio.ensure_future(owner.invoke(SESSION, "count_short", arguments, turn_id="t"))
        await asyncio.wait_for(until_runs(marker_dir, outage), 10)
        waiting = asyncio.ensure_future(joiner.invoke(SESSION, "count_short", arguments, turn_id="t"))
        await eventually(lambda: logged(caplog.records, "joined a running invocation") == 1)
        if outage == "killed":
            await redis_server.kill()
        else:
            redis_server.pause()
        try:
            (marker_dir / f"release-{outage}").touch()
            ran = await asyncio.wait_for(running, 10)
            assert ran.outcome is not None and ran.outcome.failure is None  # its owner has it
            unknown = await asyncio.wait_for(waiting, 20)  # within deadline + the owner's grace
            assert unknown.outcome is None and unknown.code is Code.OUTCOME_UNAVAILABLE, unknown
            assert unknown.tool_request_id == ran.tool_request_id and unknown.attachment_id is not None
            assert unknown.retry_safe_until is not None  # the ErrorInfo says until when the retry is safe
            assert ERROR_TABLE[Code.OUTCOME_UNAVAILABLE].retryable
        finally:
            if outage == "killed":
                await redis_server.start()
            else:
                redis_server.resume()
        retry = await asyncio.wait_for(joiner.invoke(SESSION, "count_short", arguments, turn_id="t"), 15)
        assert retry.joined or retry.replayed, retry
        assert retry.tool_request_id == ran.tool_request_id and retry.outcome == ran.outcome
    assert runs(marker_dir, outage) == [ran.tool_request_id]
