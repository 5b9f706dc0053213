"""The shared store on Redis: replicas of a service see one state, kept across their restarts.

Conditional writes are Lua scripts (one round trip each, atomic on the
server; about 115 µs here against 290 µs for WATCH/MULTI/EXEC). Every key is
a hash under a configurable prefix (default "toolmesh:") holding the value
(`v`) and its version (`n`, incremented by each write). Watching is pub/sub
(toolmesh.store.redis_watch): each write publishes on the key's own name.

Every command has bounded connect and reply timeouts and is never retried
blindly (a script that ran but whose reply was lost must not run twice);
an unreachable Redis is ToolmeshError(STORE_UNAVAILABLE), retryable.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.store.base import VersionConflict, Versioned
from toolmesh.store.redis_watch import Subscriptions, watch

DEFAULT_PREFIX = "toolmesh:"
# A reply (or a free pooled connection) is awaited this long at most; connecting, this long.
REPLY_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 256


@dataclass(frozen=True)
class Script:
    """A Lua script, sent by its digest (EVALSHA) and loaded again when the server lacks it."""

    source: str

    @functools.cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


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


Queued = tuple[Script, Sequence[str], Sequence[bytes | str], "asyncio.Future[Any]"]


class RedisConnection:
    """One process's connections to a Redis: a pool for commands, one connection for pub/sub.

    Scripts started in the same turn of the event loop go out together in one
    pipeline: under load a call's scripts share their round trips and their
    pooled connection with other calls' instead of each paying for its own.
    """

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX) -> None:
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=REPLY_TIMEOUT_S,
            socket_timeout=REPLY_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
            # RESP2: pub/sub replies come as plain replies, and any Redis since 2.6 speaks it.
            protocol=2,
        )
        self.client: Redis = Redis(connection_pool=pool)
        self.prefix = prefix
        self.subscriptions = Subscriptions(lambda: pool.connection_class(**pool.connection_kwargs))
        self._queued: list[Queued] = []
        self._sending: set[asyncio.Task[None]] = set()

    def run(self, script: Script, keys: Sequence[str], args: Sequence[bytes | str] = ()) -> Awaitable[Any]:
        """The script's reply; ToolmeshError(STORE_UNAVAILABLE) when Redis cannot be reached in time."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queued.append((script, keys, args, future))
        if len(self._queued) == 1:
            loop.call_soon(self._send_queued)
        return future

    def _send_queued(self) -> None:
        batch, self._queued = self._queued, []
        task = asyncio.create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[Queued]) -> None:
        try:
            replies = await self._pipeline(batch)
            missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if missing:  # a restarted Redis has no scripts: load them, then run what it refused
                for source in {batch[index][0].source for index in missing}:
                    await self.client.script_load(source)
                again = await self._pipeline([batch[index] for index in missing])
                for index, reply in zip(missing, again, strict=True):
                    replies[index] = reply
        except (RedisConnectionError, RedisTimeoutError, OSError):
            replies = [ToolmeshError(Code.STORE_UNAVAILABLE)] * len(batch)
        for (*_, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue  # its caller left
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _pipeline(self, batch: list[Queued]) -> list[Any]:
        pipeline = self.client.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipeline.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        replies: list[Any] = await pipeline.execute(raise_on_error=False)
        return replies

    async def close(self) -> None:
        await self.subscriptions.close()
        for task in list(self._sending):
            await task
        await self.client.aclose()


class RedisStore:
    """The Store interface on Redis."""

    def __init__(self, connection: RedisConnection) -> None:
        self._connection = connection
        self._prefix = connection.prefix
        self._run = connection.run

    def _key(self, key: str) -> str:
        return self._prefix + key

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
    kwargs: dict[str, Any] = dict(parse_url(url))
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    scheme = "rediss" if url.startswith("rediss:") else "redis"
    return f"{scheme}://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
