"""A Redis Cluster that fails under load: a primary killed with SIGKILL (its replica promoted by the
cluster), a session's slot migrated between primaries. No call hangs, no tool runs twice, nothing is
lost, and the services serve again without a restart.

Each test has a cluster of its own (three primaries, three replicas: LocalCluster), since it breaks
it; the services run here, a host process runs the counting handlers (ledger_handlers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from redis.crc import key_slot

from redis_testing import LocalCluster
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.contracts.ledger import Claim, Ledger, LedgerPolicy
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import ERROR_TABLE, Code, ToolmeshError
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.store import slots
from toolmesh.store.backends import open_stores
from toolmesh.v1 import registry_pb2, registry_pb2_grpc
from toolmesh_testing import HostProcess, eventually, start_host_process

pytestmark = pytest.mark.integration

SESSION = "cluster-faults"
TIMEOUT_MS = 10_000
TOOLS = [ToolSpec("count", "Counts its runs", '{"type": "object"}', timeout_ms=TIMEOUT_MS)]
# One attempt of a call answers within the tool's deadline and the owner's grace (5 s), with the
# store's bounded timeouts on top: past this it hangs.
ATTEMPT_BOUND_S = TIMEOUT_MS / 1000 + 5 + 5
# A caller retries a retryable answer (the same call: an exact retry) for this long at most.
RETRYING_S = 60.0


def session_slot(session: str = SESSION) -> int:
    return key_slot(slots.hash_tag(slots.session_tag(session)).encode())


def runs(marker_dir: Path, key: str) -> list[str]:
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "cluster")
    try:
        local.start()
        yield local
    finally:
        local.stop()


@pytest_asyncio.fixture
async def system(cluster: LocalCluster) -> AsyncIterator[LocalSystem]:
    running = await start_local_system(heartbeat_s=0.5, store_url=cluster.url)
    async with RegistryClient(running.registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    yield running
    await running.stop(grace=0.5)


@pytest_asyncio.fixture
async def host(system: LocalSystem, marker_dir: Path) -> AsyncIterator[HostProcess]:
    process = await start_host_process(system.bridge_target, SESSION, "ledger_handlers:HANDLERS", marker_dir)
    yield process
    await process.stop()


async def call_until_answered(
    client: InvocationClient, key: str, sleep: float, *, confirm: bool = True
) -> CallResult:
    """One call, retried exactly (same arguments) while its answer is retryable; each attempt
    bounded by ATTEMPT_BOUND_S (an attempt past it fails the test: it hung)."""
    given_up = time.monotonic() + RETRYING_S
    while True:
        attempt = client.invoke(
            SESSION, "count", {"key": key, "sleep": sleep}, turn_id="turn", confirm_delivery=confirm
        )
        result = await asyncio.wait_for(attempt, ATTEMPT_BOUND_S)
        if result.outcome is not None or result.code is None or not ERROR_TABLE[result.code].retryable:
            return result
        assert time.monotonic() < given_up, f"{key}: still {result.code} after {RETRYING_S} s"
        await asyncio.sleep(0.1)  # a caller's pause between retries, not an ordering of events


def ran_once(result: CallResult, marker_dir: Path, key: str) -> bool:
    """The call's outcome is its tool's one execution."""
    assert result.outcome is not None and result.outcome.failure is None, (key, result.code, result.outcome)
    return json.loads(result.outcome.result_json or "")["runs"] == 1 and len(runs(marker_dir, key)) == 1


@pytest.mark.timeout(240)
async def test_a_primary_killed_under_load_runs_no_tool_twice_and_serves_again(
    cluster: LocalCluster, system: LocalSystem, host: HostProcess, marker_dir: Path
) -> None:
    doomed = cluster.primary_of(session_slot())
    async with (
        InvocationClient(system.invocation_target) as client,
        grpc.aio.insecure_channel(system.registry_target) as channel,
    ):
        warm = await call_until_answered(client, "warm", 0)
        assert ran_once(warm, marker_dir, "warm")
        # A watch on the session's tools: its shard channel is on the primary about to die.
        watch = registry_pb2_grpc.RegistryServiceStub(channel).WatchTools(
            registry_pb2.WatchToolsRequest(session_id=SESSION)
        )
        first = await asyncio.wait_for(watch.read(), 10)
        assert isinstance(first, registry_pb2.WatchToolsResponse)

        before = [asyncio.ensure_future(call_until_answered(client, f"k{n}", 0.5)) for n in range(12)]
        while not any(runs(marker_dir, f"k{n}") for n in range(12)):  # noqa: ASYNC110  # another process
            await asyncio.sleep(0.02)
        cluster.kill(doomed)
        during = [asyncio.ensure_future(call_until_answered(client, f"d{n}", 0.1)) for n in range(12)]
        results = dict(
            zip(
                [f"k{n}" for n in range(12)] + [f"d{n}" for n in range(12)],
                await asyncio.gather(*before, *during),
                strict=True,
            )
        )
        # No tool ran twice; every call that has an outcome got its tool's one execution.
        for key, result in results.items():
            assert len(runs(marker_dir, key)) <= 1, key
            if result.outcome is not None and result.outcome.failure is None:
                assert ran_once(result, marker_dir, key), key

        # The replica took over; the same services serve again, without a restart.
        await asyncio.to_thread(cluster.wait_healthy)
        assert cluster.primary_of(session_slot()) != doomed
        after = await call_until_answered(client, "after", 0)
        assert ran_once(after, marker_dir, "after")
        # The watch opened before the kill was subscribed again on the new primary.
        more = [*TOOLS, ToolSpec("extra", "Another tool", '{"type": "object"}')]
        async with RegistryClient(system.registry_target) as registry:

            async def put() -> int | None:
                # A write that meets the topology as it was before the failover fails
                # STORE_UNAVAILABLE, which the error table says to retry.
                try:
                    return await registry.put_tools(SESSION, more)
                except grpc.aio.AioRpcError as error:
                    code = error_code(error)
                    assert code is not None and ERROR_TABLE[code].retryable, error.details()
                    return None

            revision = await eventually(put, timeout=15, interval=0.2)
        while True:
            seen = await asyncio.wait_for(watch.read(), 15)
            assert isinstance(seen, registry_pb2.WatchToolsResponse)
            if seen.revision == revision:
                break
        watch.cancel()


@pytest.mark.timeout(240)
async def test_a_slot_migrated_between_primaries_under_load_loses_nothing(
    cluster: LocalCluster, system: LocalSystem, host: HostProcess, marker_dir: Path
) -> None:
    slot = session_slot()
    source = cluster.primary_of(slot)
    target = next(port for port in cluster.primary_ports() if port != source)
    async with InvocationClient(system.invocation_target) as client:
        # Left unconfirmed, so that an exact retry replays them.
        settled = [await call_until_answered(client, f"s{n}", 0, confirm=False) for n in range(5)]
        calls = [asyncio.ensure_future(call_until_answered(client, f"m{n}", 0.2)) for n in range(20)]
        # Key by key, so that calls meet the slot half moved (ASK, TRYAGAIN).
        await asyncio.to_thread(cluster.move_slot, slot, target)
        calls += [asyncio.ensure_future(call_until_answered(client, f"a{n}", 0)) for n in range(5)]
        moved = await asyncio.gather(*calls)
        assert cluster.primary_of(slot) == target
        for n, result in enumerate(settled):
            assert ran_once(result, marker_dir, f"s{n}")
        keys = [f"m{n}" for n in range(20)] + [f"a{n}" for n in range(5)]
        for key, result in zip(keys, moved, strict=True):
            assert ran_once(result, marker_dir, key), key
        # What was recorded before the move is there after it: an exact retry replays it.
        for n in range(5):
            again = await call_until_answered(client, f"s{n}", 0, confirm=False)
            assert again.replayed and again.tool_request_id == settled[n].tool_request_id
            assert len(runs(marker_dir, f"s{n}")) == 1


@contextlib.contextmanager
def stopped(cluster: LocalCluster, port: int) -> Iterator[None]:
    cluster.pause(port)
    try:
        yield
    finally:
        cluster.resume(port)


@pytest.mark.timeout(120)
async def test_a_call_no_replica_confirms_is_refused_before_it_runs_and_its_retry_runs_once(
    cluster: LocalCluster, system: LocalSystem, host: HostProcess, marker_dir: Path
) -> None:
    """Durable claims at their default on a cluster with replicas, through the services: the
    session's replica stopped, a call is refused (typed, retryable) and its tool does not run; with
    the replica back its exact retry runs it, once."""
    replica = cluster.replica_of(cluster.primary_of(session_slot()))
    async with InvocationClient(system.invocation_target) as client:
        assert ran_once(await call_until_answered(client, "before", 0), marker_dir, "before")
        with stopped(cluster, replica):
            refused = await asyncio.wait_for(
                client.invoke(SESSION, "count", {"key": "refused", "sleep": 0}, turn_id="turn"),
                ATTEMPT_BOUND_S,
            )
        assert refused.outcome is None and refused.code is Code.STORE_UNAVAILABLE
        assert "replica" in refused.detail
        assert runs(marker_dir, "refused") == []
        retry = await call_until_answered(client, "refused", 0)
        assert ran_once(retry, marker_dir, "refused") and retry.tool_request_id != refused.tool_request_id


@pytest.mark.timeout(120)
@pytest.mark.parametrize("durable", ["off", "auto"])
async def test_a_claim_the_promoted_replica_never_got(cluster: LocalCluster, durable: str) -> None:
    """What durable claims are for. The session's replica lags (stopped, its link cut); a claim is
    made; the primary dies; the replica is promoted. With durable claims off the claim was acknowledged and is
    gone: the exact retry starts the tool again. With them on (`auto`, the default: the primary had
    a replica) the claim was refused (nothing ran), and the retry on the new primary (which has no
    replica: `auto` does not wait there) is the one run."""
    primary = cluster.primary_of(session_slot())
    replica = cluster.replica_of(primary)
    stores = open_stores(f"{cluster.url}?durable={durable}&durable_wait_ms=100")
    ledger = Ledger(stores.ledger, LedgerPolicy())
    call = ToolCall(SESSION, "turn", "count", '{"key": "lost"}')
    try:
        # Connected, and (`auto`) told by the primary that it has a replica, before the replica lags:
        # stopped long enough, the cluster marks it failed, and `auto` would no longer wait for it.
        assert (
            await ledger.claim(
                ToolCall(SESSION, "turn", "count", "{}"), slots.tool_request_id(SESSION, "warm"), TIMEOUT_MS
            )
        ).is_new
        with stopped(cluster, replica):
            cluster.cut_replication(primary)
            claimed: Claim | ToolmeshError
            try:
                claimed = await ledger.claim(call, slots.tool_request_id(SESSION, "first"), TIMEOUT_MS)
            except ToolmeshError as error:
                claimed = error
            cluster.kill(primary)
        # The replica takes over (as the cluster would once the primary's timeout passes; at once here).
        await asyncio.to_thread(cluster.take_over, replica)
        retry = await eventually_claimed(ledger, call)
    finally:
        await stores.close()
    if durable == "off":
        assert isinstance(claimed, Claim) and claimed.is_new  # acknowledged: the tool would run
        assert retry.is_new  # and it runs again: twice
    else:
        assert isinstance(claimed, ToolmeshError) and claimed.code is Code.STORE_UNAVAILABLE  # nothing ran
        assert retry.is_new  # the one run


async def eventually_claimed(ledger: Ledger, call: ToolCall) -> Claim:
    """The exact retry's claim once the new primary serves (STORE_UNAVAILABLE until it does)."""
    given_up = time.monotonic() + 30
    while True:
        try:
            return await ledger.claim(call, slots.tool_request_id(SESSION, "retry"), TIMEOUT_MS)
        except ToolmeshError as error:
            assert error.code is Code.STORE_UNAVAILABLE and time.monotonic() < given_up
            await asyncio.sleep(0.1)
