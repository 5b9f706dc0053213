"""Durable claims: a claim and a finish wait for a replica; a claim none confirms is refused, ended,
and the exact retry claims anew.

A replica that does not confirm is a real one stopped with SIGSTOP (it keeps its
connection, and answers nothing): on one Redis a replica of a test's own, on a
cluster the replica of the primary that serves the session's slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.crc import key_slot

from redis_testing import LocalCluster, RedisServer, new_prefix
from toolmesh.contracts.ledger import InvocationState, Ledger, LedgerPolicy
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.store import slots
from toolmesh.store.backends import describe_store, open_stores
from toolmesh.store.durability import DEFAULT_WAIT_MS, MAX_WAIT_MS, Durability, Mode, split_durability
from toolmesh.store.redis_cluster import parse_cluster_url
from toolmesh_testing import eventually

SESSION = "durable"
POLICY = LedgerPolicy(replay_window_s=5.0, record_retention_s=10.0)
WAIT = "durable_wait_ms=100"


@pytest.mark.unit
def test_the_durability_parameters_are_read_from_the_store_url() -> None:
    assert split_durability("redis://h:1/0") == ("redis://h:1/0", Durability())
    url, durability = split_durability("redis://h:1/0?durable=on&durable_wait_ms=250&ssl_cert_reqs=none")
    assert url == "redis://h:1/0?ssl_cert_reqs=none" and durability == Durability(Mode.ON, 250)
    assert parse_cluster_url("redis+cluster://a:1,b:2?durable=off").durability.mode is Mode.OFF
    assert Durability().wait_ms == DEFAULT_WAIT_MS and Durability().mode is Mode.AUTO
    assert describe_store("redis://h:1/0?durable=on") == "Redis at redis://h:1/0 (durable claims on)"
    assert describe_store("redis+cluster://a:1?durable=off").endswith("(durable claims off)")
    for bad in (
        "redis://h/0?durable=yes",
        "redis://h/0?durable_wait_ms=0",
        "redis://h/0?durable_wait_ms=5000",
    ):
        with pytest.raises(ValueError):
            describe_store(bad)
    with pytest.raises(ValueError):
        parse_cluster_url("redis+cluster://a:1?other=1")


def call(arguments: str = '{"a": 1}') -> ToolCall:
    return ToolCall(SESSION, "turn", "t", arguments)


def new_id(name: str) -> str:
    return slots.tool_request_id(SESSION, name)


async def refused_then_claimed_anew(
    ledger: Ledger, replica_stopped: contextlib.AbstractContextManager[None]
) -> None:
    """With the replica stopped a claim is refused (typed, retryable), its invocation ended with a
    retryable outcome; with the replica back the exact retry starts a new invocation."""
    with replica_stopped, pytest.raises(ToolmeshError) as raised:
        await ledger.claim(call(), new_id("refused"), 10_000)
    assert raised.value.code is Code.STORE_UNAVAILABLE
    ended = await ledger.get(new_id("refused"))
    assert ended is not None and ended.state is InvocationState.FAILED
    assert ended.outcome is not None and ended.outcome.failure is not None
    assert ended.outcome.failure.code == Code.STORE_UNAVAILABLE
    retry = await ledger.claim(call(), new_id("retry"), 10_000)
    assert retry.is_new and retry.record.tool_request_id == new_id("retry")
    assert await ledger.finish(new_id("retry"), Outcome.success("1"), claimed=retry.record)
    replay = await ledger.claim(call(), new_id("replay"), 10_000)
    assert not replay.is_new and replay.record.tool_request_id == new_id("retry")


@contextlib.contextmanager
def stopped(stop: Callable[[], None], resume: Callable[[], None]) -> Iterator[None]:
    """A process stopped (SIGSTOP) for a `with` block, continued after."""
    stop()
    try:
        yield
    finally:
        resume()


# ---- one Redis with a replica


@pytest_asyncio.fixture
async def primary_and_replica(tmp_path: Path) -> AsyncIterator[tuple[RedisServer, RedisServer]]:
    primary = RedisServer(tmp_path / "primary")
    primary.directory.mkdir()
    await primary.start()
    replica = RedisServer(tmp_path / "replica", options=("--replicaof", "127.0.0.1", str(primary.port)))
    replica.directory.mkdir()
    await replica.start()

    async def in_sync() -> bool:
        client = Redis(port=replica.port)
        try:
            return (await client.info("replication")).get("master_link_status") == "up"
        finally:
            await client.aclose()

    await eventually(in_sync)
    yield primary, replica
    await replica.stop()
    await primary.stop()


@pytest.mark.integration
async def test_one_redis_with_durable_on_refuses_a_claim_no_replica_confirms(
    primary_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    primary, replica = primary_and_replica
    stores = open_stores(f"{primary.url}?durable=on&{WAIT}", new_prefix())
    try:
        ledger = Ledger(stores.ledger, POLICY)
        first = await ledger.claim(call('{"warm": 1}'), new_id("warm"), 10_000)
        assert first.is_new
        await refused_then_claimed_anew(ledger, stopped(replica.pause, replica.resume))
    finally:
        await stores.close()


async def waits_run(port: int) -> int:
    client = Redis(port=port)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


@pytest.mark.integration
async def test_one_redis_s_claims_of_one_loop_turn_share_one_wait(
    primary_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    """Commands of one loop turn share a write; their WAIT too (it covers every earlier write).

    The longest wait a store allows: what is counted is the WAITs, and a replica on a loaded
    machine (the suite's other worker, a browser) once took longer than the default to confirm."""
    primary, _ = primary_and_replica
    stores = open_stores(f"{primary.url}?durable=on&durable_wait_ms={MAX_WAIT_MS}", new_prefix())
    try:
        ledger = Ledger(stores.ledger, POLICY)
        await ledger.claim(call('{"warm": 1}'), new_id("warm"), 10_000)  # connected
        before = await waits_run(primary.port)
        claims = await asyncio.gather(
            *(ledger.claim(call(f'{{"n": {n}}}'), new_id(f"n{n}"), 10_000) for n in range(20))
        )
        assert all(claimed.is_new for claimed in claims)
        assert await waits_run(primary.port) - before < len(claims)
    finally:
        await stores.close()


@pytest.mark.integration
async def test_one_redis_waits_for_no_replica_unless_told(
    primary_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    primary, replica = primary_and_replica
    stores = open_stores(f"{primary.url}?{WAIT}", new_prefix())
    try:
        replica.pause()
        try:
            claimed = await Ledger(stores.ledger, POLICY).claim(call(), new_id("auto"), 10_000)
        finally:
            replica.resume()
        assert claimed.is_new
    finally:
        await stores.close()


# ---- a cluster: the replica of the session's primary


def session_primary(cluster: LocalCluster) -> int:
    return cluster.primary_of(key_slot(slots.hash_tag(slots.session_tag(SESSION)).encode()))


@pytest.mark.integration
@pytest.mark.parametrize("durable", ["", "durable=on&"])
async def test_a_cluster_with_replicas_refuses_a_claim_no_replica_confirms(
    redis_cluster: LocalCluster, durable: str
) -> None:
    """`auto` (the default) and `on` alike, on a cluster whose primaries have replicas."""
    stores = open_stores(f"{redis_cluster.url}?{durable}{WAIT}", new_prefix())
    replica = redis_cluster.replica_of(session_primary(redis_cluster))
    try:
        ledger = Ledger(stores.ledger, POLICY)
        assert (await ledger.claim(call('{"warm": 1}'), new_id("warm"), 10_000)).is_new
        replica_stopped = stopped(lambda: redis_cluster.pause(replica), lambda: redis_cluster.resume(replica))
        await refused_then_claimed_anew(ledger, replica_stopped)
    finally:
        await stores.close()  # the cluster is this test process's own: its keys go with it


@pytest.mark.integration
async def test_a_cluster_with_durable_off_claims_without_a_replica(redis_cluster: LocalCluster) -> None:
    stores = open_stores(f"{redis_cluster.url}?durable=off", new_prefix())
    replica = redis_cluster.replica_of(session_primary(redis_cluster))
    try:
        with stopped(lambda: redis_cluster.pause(replica), lambda: redis_cluster.resume(replica)):
            claimed = await Ledger(stores.ledger, POLICY).claim(call(), new_id("off"), 10_000)
        assert claimed.is_new
    finally:
        await stores.close()
