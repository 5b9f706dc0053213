"""The store contract: every backend behind the Store interface must pass these.

Redis: the shared server at 127.0.0.1:6379, each test under a key prefix of its own; a Redis
Cluster: three primaries of the test process's own (the redis_cluster fixture).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.contracts.cancels import CancelBoard
from toolmesh.store.backends import open_stores
from toolmesh.store.base import Store, VersionConflict
from toolmesh.store.memory import InMemoryStore
from toolmesh_testing import eventually


# Each backend's marks: the in-process one is a unit test, one behind a server an integration test.
@pytest_asyncio.fixture(
    params=[
        pytest.param("memory", marks=pytest.mark.unit),
        pytest.param("redis", marks=pytest.mark.integration),
        pytest.param("cluster", marks=pytest.mark.integration),
    ]
)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        backend = InMemoryStore()
        yield backend
        await backend.close()
        return
    prefix = new_prefix()
    if request.param == "cluster":  # a cluster of this test process's own: its keys go with it
        stores = open_stores(request.getfixturevalue("redis_cluster").url, prefix)
        yield stores.store
        await stores.close()
        return
    stores = open_stores(SHARED_URL, prefix)
    yield stores.store
    await stores.close()
    await delete_prefixed(SHARED_URL, prefix)


async def test_put_get_and_versions(store: Store) -> None:
    assert await store.get("k") is None
    assert await store.put("k", b"a") == 1
    assert await store.put("k", b"b") == 2
    got = await store.get("k")
    assert got is not None and (got.value, got.version) == (b"b", 2)


async def test_conditional_put(store: Store) -> None:
    assert await store.put("c", b"a", expected_version=0) == 1
    with pytest.raises(VersionConflict) as raised:
        await store.put("c", b"b", expected_version=0)
    assert raised.value.actual == 1
    assert await store.put("c", b"b", expected_version=1) == 2


async def test_create_only_if_absent(store: Store) -> None:
    assert await store.create("n", b"first") is None
    existing = await store.create("n", b"second")
    assert existing is not None and existing.value == b"first"


async def test_delete(store: Store) -> None:
    await store.put("d", b"x")
    await store.delete("d")
    assert await store.get("d") is None
    await store.delete("d")


async def test_delete_if_value_removes_only_that_value(store: Store) -> None:
    await store.put("r", b"replica-a", ttl_s=10)
    assert not await store.delete_if_value("r", b"replica-b")
    found = await store.get("r")
    assert found is not None and found.value == b"replica-a"
    assert await store.delete_if_value("r", b"replica-a")
    assert await store.get("r") is None
    assert not await store.delete_if_value("r", b"replica-a")


async def test_delete_if_value_is_seen_by_watchers(store: Store) -> None:
    await store.put("w2", b"mine")
    updates = store.watch("w2")
    try:
        first = await anext(updates)
        assert first is not None and first.value == b"mine"
        assert await store.delete_if_value("w2", b"mine")
        assert await asyncio.wait_for(anext(updates), 5) is None
    finally:
        await updates.aclose()


async def test_expiry(store: Store) -> None:
    await store.put("e", b"x", ttl_s=0.05)
    assert await store.get("e") is not None
    await asyncio.sleep(0.1)  # past the TTL: the time passing is what is tested
    assert await store.get("e") is None
    assert await store.create("e", b"y", ttl_s=10) is None


async def test_watch_sees_current_then_changes(store: Store) -> None:
    await store.put("w", b"1")
    watcher = store.watch("w")
    first = await asyncio.wait_for(anext(watcher), 2)
    assert first is not None and first.value == b"1"
    await store.put("w", b"2")
    second = await asyncio.wait_for(anext(watcher), 2)
    assert second is not None and second.value == b"2"
    await store.delete("w")
    assert await asyncio.wait_for(anext(watcher), 2) is None
    await watcher.aclose()


async def test_watch_sees_expiry_and_a_key_written_later(store: Store) -> None:
    watcher = store.watch("later")
    assert await asyncio.wait_for(anext(watcher), 2) is None
    await store.put("later", b"x", ttl_s=0.2)
    written = await asyncio.wait_for(anext(watcher), 2)
    assert written is not None and written.value == b"x"
    # Nobody writes: the key expires, and the watcher is told.
    assert await asyncio.wait_for(anext(watcher), 2) is None
    await watcher.aclose()


async def test_a_put_without_ttl_keeps_the_key(store: Store) -> None:
    await store.put("v", b"1", ttl_s=0.2)
    await store.put("v", b"2")
    await asyncio.sleep(0.3)  # past the first put's expiry
    got = await store.get("v")
    assert got is not None and got.value == b"2"


@pytest.mark.unit
async def test_memory_store_forgets_expired_keys_it_never_reads() -> None:
    clock = [0.0]
    store = InMemoryStore(clock=lambda: clock[0])
    for index in range(1000):
        await store.put(f"k{index}", b"x", ttl_s=1)
    clock[0] = 5.0
    for index in range(600):
        await store.put(f"fresh{index}", b"y", ttl_s=100)
    assert len(store) < 700


async def test_cancellations_posted_anywhere_reach_every_follower(store: Store) -> None:
    board, other_replica = CancelBoard(store), CancelBoard(store)
    await board.post("tr_before")  # posted before anyone followed: not told again
    heard: list[str] = []
    ready = asyncio.Event()
    following = asyncio.create_task(other_replica.follow(heard.append, ready))
    await asyncio.wait_for(ready.wait(), 5)
    await asyncio.gather(*(board.post(f"tr_{n}") for n in range(20)))  # concurrent: none is lost
    await eventually(lambda: len(heard) >= 20)
    assert sorted(heard) == sorted(f"tr_{n}" for n in range(20))
    following.cancel()
