"""A Redis Cluster as the shared store: a session's keys in its slot, sessions over every primary."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import MovedError

from redis_testing import LocalCluster, new_prefix
from toolmesh.core.progress import ToolProgress
from toolmesh.invocation.progress_relay import ProgressRelay
from toolmesh.store import slots
from toolmesh.store.backends import describe_store, open_stores
from toolmesh.store.redis_cluster import parse_cluster_url
from toolmesh_testing import eventually

pytestmark = pytest.mark.integration


def test_the_cluster_url_names_its_nodes() -> None:
    address = parse_cluster_url("redis+cluster://u:p%40ss@a:7000,b:7001/0")
    assert address.nodes == (("a", 7000), ("b", 7001)) and address.password == "p@ss"
    assert describe_store("rediss+cluster://a:1,b:2") == "Redis Cluster at rediss+cluster://a:1,b:2"
    for bad in ("redis+cluster://a", "redis+cluster://a:1/2"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)
    with pytest.raises(ValueError):
        open_stores("redis+cluster://a:1", "{toolmesh}:")


def test_ids_carry_their_session_s_tag() -> None:
    tool_request_id = slots.tool_request_id("s1", "ab12")
    assert slots.id_tag(tool_request_id) == slots.session_tag("s1")
    assert slots.id_tag("tr_0123456789abcdef") is None  # minted before: no tag


async def test_sessions_spread_over_every_primary(redis_cluster: LocalCluster) -> None:
    prefix = new_prefix()
    stores = open_stores(redis_cluster.url, prefix)
    sessions = [f"session-{index}" for index in range(30)]
    try:
        for session in sessions:
            await stores.store.put(f"registry:tools:{session}", b"[]")
            tool_request_id = slots.tool_request_id(session, "00")
            await stores.ledger.claim(tool_request_id, b"r", f"{session}:t:d", 10)
    finally:
        await stores.close()
    holders: dict[str, set[int]] = {}
    primaries = redis_cluster.primary_ports()
    for port in primaries:
        node = Redis(port=port)
        try:
            keys = [key.decode() async for key in node.scan_iter(match=f"{prefix}*")]
        finally:
            await node.aclose()
        for key in keys:
            session = next(
                s for s in sessions if key.endswith(s) or f"{s}:" in key or slots.session_tag(s) in key
            )
            holders.setdefault(session, set()).add(port)
    assert all(len(ports) == 1 for ports in holders.values())  # a session's keys: one node
    assert {port for ports in holders.values() for port in ports} == set(primaries)


async def test_an_invocation_s_progress_travels_in_its_session_s_slot(redis_cluster: LocalCluster) -> None:
    """Written by the replica running it, watched by another (sharded pub/sub on the slot's node)."""
    prefix = new_prefix()
    owner, joiner = open_stores(redis_cluster.url, prefix), open_stores(redis_cluster.url, prefix)
    tool_request_id = slots.tool_request_id("progress-session", "cd34")
    seen: list[ToolProgress] = []
    following = asyncio.create_task(ProgressRelay(joiner.store).follow(tool_request_id, seen.append))
    relay = ProgressRelay(owner.store)
    try:
        relay.publish(ToolProgress(tool_request_id, 1, None, None), 30)
        await eventually(lambda: seen)
        relay.publish(ToolProgress(tool_request_id, 2, None, None), 30)
        await eventually(lambda: seen[-1].progress == 2)
    finally:
        following.cancel()
        await relay.aclose()
        await owner.close()
        await joiner.close()
    tag = slots.hash_tag(slots.session_tag("progress-session"))
    key = f"{prefix}invocation:progress:{tag}{tool_request_id}"
    holders = []
    for port in redis_cluster.primary_ports():
        node = Redis(port=port)
        try:
            if await node.exists(key):
                holders.append(port)
        except MovedError:
            pass  # not this node's slot
        finally:
            await node.aclose()
    assert len(holders) == 1 and key_slot(key.encode()) == key_slot(tag.encode())
