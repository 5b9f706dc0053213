"""Choosing where a service keeps its state: the embedded memory (the default) or a shared Redis."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from toolmesh.store.base import Store
from toolmesh.store.ledger import LedgerStore
from toolmesh.store.memory import InMemoryStore, MemoryLedgerStore
from toolmesh.store.redis import DEFAULT_PREFIX, RedisConnection, RedisStore, describe
from toolmesh.store.redis_cluster import SCHEMES, ClusterConnection, parse_cluster_url
from toolmesh.store.redis_ledger import RedisLedgerStore

STORE_ENV = "TOOLMESH_STORE"
PREFIX_ENV = "TOOLMESH_STORE_PREFIX"
MEMORY = "memory"


@dataclass
class Stores:
    """One process's state: its key-value store, its ledger store, and how to let go of them."""

    store: Store
    ledger: LedgerStore
    close: Callable[[], Awaitable[None]]
    # Other processes see this state (Redis), not only this one (memory).
    shared: bool = False


def store_url(flag: str | None) -> str:
    """The store a process uses: its --store flag, else TOOLMESH_STORE, else the embedded memory."""
    return flag or os.environ.get(STORE_ENV) or MEMORY


def open_stores(url: str = MEMORY, prefix: str | None = None) -> Stores:
    """The stores behind `url`: "memory", redis://host:port/db (rediss:// with TLS, unix://path), or a
    Redis Cluster, redis+cluster://host:port,host:port (rediss+cluster:// with TLS: sessions sharded
    over its primaries, toolmesh.store.redis_cluster).

    `prefix` namespaces every Redis key (default TOOLMESH_STORE_PREFIX, else "toolmesh:").
    Raises ValueError for any other URL. Connects lazily: an unreachable Redis
    shows as STORE_UNAVAILABLE on the calls that need it, not here.
    """
    if url == MEMORY:
        store = InMemoryStore()
        return Stores(store, MemoryLedgerStore(), store.close)
    describe_store(url)  # checks the URL
    prefix = prefix or os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX
    connection: RedisConnection | ClusterConnection = (
        ClusterConnection(url, prefix) if is_cluster(url) else RedisConnection(url, prefix)
    )
    return Stores(RedisStore(connection), RedisLedgerStore(connection), connection.close, shared=True)


def describe_store(url: str) -> str:
    """What `url` names, to show (never a password); ValueError unless open_stores can open it."""
    if url == MEMORY:
        return "embedded in-memory store"
    if is_cluster(url):
        return f"Redis Cluster at {parse_cluster_url(url).describe()}"
    return f"Redis at {describe(url)}"


def is_cluster(url: str) -> bool:
    return url.partition("://")[0] in SCHEMES
