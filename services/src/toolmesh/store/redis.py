"""The shared store on Redis: replicas of a service see one state, kept across their restarts.

Conditional writes are Lua scripts (one round trip each, atomic on the
server, where WATCH/MULTI/EXEC takes three and a retry loop). Every key is
a hash under a configurable prefix (default "toolmesh:") holding the value
(`v`) and its version (`n`, incremented by each write). Watching is pub/sub
(toolmesh.store.redis_watch): each write publishes on the key's own name.
Commands travel pipelined on one connection (toolmesh.store.redis_link).

Every command has bounded connect and reply timeouts and is never retried
blindly (a script that ran but whose reply was lost must not run twice);
an unreachable Redis is ToolmeshError(STORE_UNAVAILABLE), retryable.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.asyncio import ConnectionPool
from redis.asyncio.connection import AbstractConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from toolmesh.store import slots
from toolmesh.store.base import VersionConflict, Versioned
from toolmesh.store.durability import Mode, split_durability
from toolmesh.store.redis_link import Link
from toolmesh.store.redis_watch import Subscriptions, watch

if TYPE_CHECKING:
    from toolmesh.store.redis_cluster import ClusterConnection

DEFAULT_PREFIX = "toolmesh:"
# A reply is awaited this long at most; connecting, this long.
REPLY_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Script:
    """A Lua script, sent by its digest (EVALSHA) and loaded again when the server lacks it."""

    source: str

    @functools.cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()

    @functools.cached_property
    def sharded(self) -> Script:
        """The script for a cluster: it publishes with SPUBLISH, in the slot of the key it names."""
        return Script(self.source.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',"))


_PUT = Script("""
local current = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= current then return {0, current} end
local version = current + 1
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'n', version)
if ARGV[3] ~= '' then redis.call('PEXPIRE', KEYS[1], ARGV[3]) else redis.call('PERSIST', KEYS[1]) end
redis.call('PUBLISH', KEYS[1], version)
return {1, version}
""")

_CREATE = Script("""
local found = redis.call('HMGET', KEYS[1], 'v', 'n')
if found[2] then return found end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'n', 1)
if ARGV[2] ~= '' then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
redis.call('PUBLISH', KEYS[1], 1)
return false
""")

_DELETE = Script("""
if redis.call('DEL', KEYS[1]) == 1 then redis.call('PUBLISH', KEYS[1], 0) end
return 0
""")

# Compare and delete: another writer's value stays (a read then a DEL could remove it).
_DELETE_IF_VALUE = Script("""
if redis.call('HGET', KEYS[1], 'v') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', KEYS[1], 0)
return 1
""")

# The value, its version and its time to live in ms (-1: none, -2: absent), in one reply.
_READ = Script("""
local found = redis.call('HMGET', KEYS[1], 'v', 'n')
return {found[1], found[2], redis.call('PTTL', KEYS[1])}
""")


def milliseconds(seconds: float | None) -> str:
    """A ttl as a script argument: whole milliseconds, at least 1; '' for none."""
    return "" if seconds is None else str(max(1, round(seconds * 1000)))


def expires_in(pttl: int) -> float | None:
    return pttl / 1000 if pttl >= 0 else None


class RedisConnection:
    """One process's connections to a Redis: one for commands (toolmesh.store.redis_link), one for
    pub/sub (toolmesh.store.redis_watch)."""

    # Keys carry no slot tag (toolmesh.store.slots): one server holds them all.
    cluster = False

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX) -> None:
        url, durability = split_durability(url)
        # One Redis waits for a replica only when told to (`auto` is off: it may have none).
        self._wait = durability.wait_command() if durability.mode is Mode.ON else None
        # Whether a claim or finish may wait for a replica (durable claims).
        self.claims_replicated = self._wait is not None
        # The pool only turns the URL into a connection class and its settings; nothing is pooled.
        settings = ConnectionPool.from_url(
            url,
            socket_timeout=REPLY_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
            # RESP2: pub/sub replies come as plain replies, and any Redis since 2.6 speaks it.
            protocol=2,
        )

        def connect() -> AbstractConnection:
            return settings.connection_class(**settings.connection_kwargs)

        self.prefix = prefix
        self._link = Link(connect)
        self.subscriptions = Subscriptions(connect)

    async def run(
        self, script: Script, keys: Sequence[str], args: Sequence[bytes | str] = (), *, durable: bool = False
    ) -> Any:
        """The script's reply; ToolmeshError(STORE_UNAVAILABLE) when Redis cannot be reached in time.

        `durable` (a claim or a finish), with durable claims on: answered once a replica has it;
        NotReplicated when none confirmed in time (the script ran).
        """
        wait = self._wait if durable else None
        try:
            return await self._link.send("EVALSHA", script.sha, len(keys), *keys, *args, wait=wait)
        except NoScriptError:  # a restarted Redis has no scripts: load it (it did not run)
            await self._link.send("SCRIPT", "LOAD", script.source)
            return await self._link.send("EVALSHA", script.sha, len(keys), *keys, *args, wait=wait)

    async def close(self) -> None:
        await self.subscriptions.close()
        await self._link.close()


class RedisStore:
    """The Store interface on Redis."""

    def __init__(self, connection: RedisConnection | ClusterConnection) -> None:
        self._connection = connection
        self._prefix = connection.prefix
        self._run = connection.run
        self._cluster = connection.cluster

    def _key(self, key: str) -> str:
        # On a cluster a session's keys share its slot (its ledger's scripts are atomic there).
        return self._prefix + (slots.tagged_key(key) if self._cluster else key)

    async def get(self, key: str) -> Versioned | None:
        state, _ = await self._read_expiring(key)
        return state

    async def put(
        self, key: str, value: bytes, *, expected_version: int | None = None, ttl_s: float | None = None
    ) -> int:
        expected = "" if expected_version is None else str(expected_version)
        written, version = await self._run(_PUT, [self._key(key)], [value, expected, milliseconds(ttl_s)])
        if not written:
            assert expected_version is not None
            raise VersionConflict(key, expected_version, int(version))
        return int(version)

    async def create(self, key: str, value: bytes, *, ttl_s: float | None = None) -> Versioned | None:
        found = await self._run(_CREATE, [self._key(key)], [value, milliseconds(ttl_s)])
        return None if found is None else Versioned(found[0], int(found[1]))

    async def delete(self, key: str) -> None:
        await self._run(_DELETE, [self._key(key)])

    async def delete_if_value(self, key: str, value: bytes) -> bool:
        return bool(await self._run(_DELETE_IF_VALUE, [self._key(key)], [value]))

    async def _read_expiring(self, key: str) -> tuple[Versioned | None, float | None]:
        value, version, pttl = await self._run(_READ, [self._key(key)])
        if version is None:
            return None, None
        return Versioned(value, int(version)), expires_in(int(pttl))

    def watch(self, key: str) -> AsyncGenerator[Versioned | None, None]:
        channel = self._key(key).encode()
        return watch(self._connection.subscriptions, channel, lambda: self._read_expiring(key))

    async def close(self) -> None:
        """The connection is shared (RedisConnection.close closes it)."""


def describe(url: str) -> str:
    """The URL without its password, to show; ValueError when it is not a Redis URL."""
    url, durability = split_durability(url)
    kwargs: dict[str, Any] = dict(parse_url(url))
    durable = "" if durability.mode is Mode.AUTO else f" (durable claims {durability.mode.value})"
    if "path" in kwargs:
        return f"unix://{kwargs['path']}{durable}"
    scheme = "rediss" if url.startswith("rediss:") else "redis"
    host, port, db = kwargs.get("host", "localhost"), kwargs.get("port", 6379), kwargs.get("db", 0)
    return f"{scheme}://{host}:{port}/{db}{durable}"
