"""The shared store on a Redis Cluster: sessions sharded over its primaries.

Every key of one session shares a hash slot (toolmesh.store.slots), so the
ledger's multi-key scripts run atomically on the node that owns it. Commands
go through redis-py's RedisCluster, which routes each script by its keys and
follows MOVED and ASK redirections (a redirected command did not run); a lost
connection or a reply late by the reply timeout is never retried (a script whose
reply was lost may have run): it is STORE_UNAVAILABLE, as on one Redis.

Watching is sharded pub/sub (SSUBSCRIBE, Redis 7.0+): the scripts publish with
SPUBLISH on the key's own name, in the key's slot, and a process keeps one
pub/sub connection per primary that serves a watched channel
(ClusterSubscriptions). When a node's connection is lost, or it says a channel's
slot is no longer its own (MOVED, or an unasked sunsubscribe after a slot
moved), the slot map is read again and each channel moves to the node that owns
its slot now; its watchers wait for the new subscription, then read again, so
a change made meanwhile is not missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.store.durability import Durability, Mode, NotReplicated, split_durability
from toolmesh.store.redis import CONNECT_TIMEOUT_S, DEFAULT_PREFIX, REPLY_TIMEOUT_S, Script
from toolmesh.store.redis_watch import (
    RECONNECT_CAP_S,
    RECONNECT_FIRST_S,
    Subscriptions,
    _Channel,
    join_channel,
    leave_channel,
)

log = logging.getLogger("toolmesh.store")

SCHEMES = ("redis+cluster", "rediss+cluster")
# What an unreachable or reconfiguring cluster looks like from redis-py.
UNAVAILABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterDownError,
    ClusterError,
    TryAgainError,
    RedisClusterException,
)
# How many redirections (MOVED, ASK, TRYAGAIN) a durable script follows, as redis-py's own commands.
REDIRECTIONS = RedisCluster.RedisClusterRequestTTL
TRY_AGAIN_PAUSE_S = 0.05
# `durable=auto` asks a primary again after this long whether it has a replica.
REPLICAS_FRESH_S = 10.0


@dataclass(frozen=True)
class ClusterAddress:
    """A redis+cluster:// URL: the nodes to start from, and how to connect to every node."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    durability: Durability = field(default_factory=Durability)

    def describe(self) -> str:
        scheme = SCHEMES[1] if self.tls else SCHEMES[0]
        mode = self.durability.mode
        durable = "" if mode is Mode.AUTO else f" (durable claims {mode.value})"
        return f"{scheme}://" + ",".join(f"{host}:{port}" for host, port in self.nodes) + durable


def parse_cluster_url(url: str) -> ClusterAddress:
    """redis+cluster://[user:password@]host:port[,host:port…][/0][?durable=…] (rediss+cluster:// with
    TLS; the durability parameters as toolmesh.store.durability says).

    ValueError for anything else; a cluster has only database 0.
    """
    url, durability = split_durability(url)
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"not a Redis Cluster URL: {parts.scheme}://")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes = []
    for node in hosts.split(","):
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError("a Redis Cluster URL names its nodes as host:port,host:port")
        nodes.append((host.strip("[]"), int(port)))
    if parts.path.strip("/") not in ("", "0") or parts.query:
        raise ValueError(
            "a Redis Cluster has only database 0, and takes no options in its URL but durable and "
            "durable_wait_ms"
        )
    return ClusterAddress(
        tuple(nodes),
        tls=parts.scheme == SCHEMES[1],
        username=unquote(username) or None,
        password=unquote(password) or None,
        durability=durability,
    )


class ClusterConnection:
    """One process's connections to a Redis Cluster: RedisCluster for commands, one pub/sub
    connection per primary for watches (ClusterSubscriptions)."""

    cluster = True

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError(
                "on a Redis Cluster the store prefix takes no hash tag: keys are tagged by session"
            )
        address = parse_cluster_url(url)
        self.prefix = prefix
        self._settings: dict[str, Any] = {
            "username": address.username,
            "password": address.password,
            "socket_timeout": REPLY_TIMEOUT_S,
            "socket_connect_timeout": CONNECT_TIMEOUT_S,
            # Never sent twice: a script whose reply was lost may have run. MOVED and ASK are
            # still followed (the node that redirected did not run it).
            "retry": Retry(NoBackoff(), 0),
            "protocol": 2,
        }
        self._tls = address.tls
        self._durability = address.durability
        # Whether a claim or finish may wait for a replica (`auto`: where a slot's primary has one).
        self.claims_replicated = address.durability.mode is not Mode.OFF
        # A durable script's node was lost: read the slot map again before the next one.
        self._slots_stale = False
        # Whether each primary has a replica that is not failed, by node name, and when it was read.
        self._replicas: dict[str, tuple[bool, float]] = {}
        self.client = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in address.nodes],
            ssl=address.tls,
            **self._settings,
        )
        self.subscriptions = ClusterSubscriptions(self.client, self._node_connection)

    def _node_connection(self, host: str, port: int) -> AbstractConnection:
        kind = SSLConnection if self._tls else Connection
        return kind(host=host, port=port, **self._settings)

    async def run(
        self, script: Script, keys: Sequence[str], args: Sequence[bytes | str] = (), *, durable: bool = False
    ) -> Any:
        """The script's reply, run on the node of its keys' slot; STORE_UNAVAILABLE when it cannot be.

        `durable` (a claim or a finish), with durable claims on (or `auto` and the slot's primary has
        a replica): answered once a replica has it; NotReplicated when none confirmed in time (the
        script ran)."""
        sharded = script.sharded
        try:
            if durable and self._durability.mode is not Mode.OFF:
                slot = key_slot(keys[0].encode())
                if self._durability.mode is Mode.ON or await self._has_replica(slot):
                    return await self._run_waiting(sharded, slot, keys, args)
            try:
                return await self.client.execute_command("EVALSHA", sharded.sha, len(keys), *keys, *args)
            except NoScriptError:  # that node has not seen it (new, restarted, promoted): it did not run
                return await self.client.execute_command("EVAL", sharded.source, len(keys), *keys, *args)
        except (NoScriptError, NotReplicated):
            raise
        except UNAVAILABLE as error:
            self._slots_stale = True  # a durable script reads the slot map again before it runs
            if not isinstance(error, (RedisConnectionError, RedisTimeoutError, OSError)):
                log.warning("store cluster unavailable", extra={"error": type(error).__name__})
            raise ToolmeshError(Code.STORE_UNAVAILABLE) from error

    async def _has_replica(self, slot: int) -> bool:
        """Whether the slot's primary has a replica that is not failed, as the primary says
        (CLUSTER NODES, read again after REPLICAS_FRESH_S; CLUSTER SLOTS leaves out a replica
        that has not replicated a byte yet)."""
        await self._current_slots()
        primary = self.client.nodes_manager.get_node_from_slot(slot)
        known = self._replicas.get(primary.name)
        now = time.monotonic()
        if known is None or now - known[1] > REPLICAS_FRESH_S:
            nodes = await primary.execute_command("CLUSTER", "NODES")
            known = self._replicas[primary.name] = (_has_live_replica(bytes(nodes).decode()), now)
        return known[0]

    async def _current_slots(self) -> None:
        if self._slots_stale:
            self._slots_stale = False
            await self.client.nodes_manager.initialize()
        else:
            await self.client.initialize()  # nothing once initialized (unless redis-py asked again)

    async def _run_waiting(
        self, script: Script, slot: int, keys: Sequence[str], args: Sequence[bytes | str]
    ) -> Any:
        """The script, then WAIT, written together on one connection to the slot's primary (WAIT
        counts the replicas that have that connection's writes). Follows MOVED, ASK and TRYAGAIN
        (the script did not run) as redis-py does; a lost connection is never retried."""
        command: tuple[Any, ...] = ("EVALSHA", script.sha, len(keys), *keys, *args)
        asked: ClusterNode | None = None
        for _ in range(REDIRECTIONS):
            await self._current_slots()
            node = asked or self.client.nodes_manager.get_node_from_slot(slot)
            commands: list[tuple[Any, ...]] = [("ASKING",)] if asked else []
            commands += [command, self._durability.wait_command()]
            replies = await self._pipeline(node, commands)
            reply, acked = replies[-2], replies[-1]
            asked = None
            if isinstance(reply, NoScriptError):  # that node has not seen it: it did not run
                command = ("EVAL", script.source, len(keys), *keys, *args)
            elif isinstance(reply, MovedError):
                await self.client.nodes_manager.move_slot(reply)
            elif isinstance(reply, AskError):
                asked = self.client.nodes_manager.get_node(host=reply.host, port=reply.port)
                if asked is None:  # a node the map does not know yet
                    self._slots_stale = True
            elif isinstance(reply, TryAgainError):  # the slot is moving: its keys are on two nodes
                await asyncio.sleep(TRY_AGAIN_PAUSE_S)
            elif isinstance(reply, Exception):
                raise reply
            elif isinstance(acked, int) and acked >= 1:
                return reply
            elif isinstance(acked, (RedisConnectionError, RedisTimeoutError)):
                self._slots_stale = True
                raise acked  # the script ran; whether a replica has it is unknown
            else:
                raise NotReplicated(reply)
        raise ClusterError("too many redirections")

    async def _pipeline(self, node: ClusterNode, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Each command's reply (an error as an exception in its place); a lost connection raises."""
        pipeline = [PipelineCommand(position, *args) for position, args in enumerate(commands)]
        try:
            await node.execute_pipeline(pipeline)
        except UNAVAILABLE:
            self._slots_stale = True
            raise
        results = [command.result for command in pipeline]
        if any(isinstance(result, (RedisConnectionError, RedisTimeoutError)) for result in results[:-1]):
            self._slots_stale = True
            raise next(r for r in results if isinstance(r, (RedisConnectionError, RedisTimeoutError)))
        return results

    async def close(self) -> None:
        await self.subscriptions.close()
        await self.client.aclose()


def _has_live_replica(nodes: str) -> bool:
    """Whether the node whose CLUSTER NODES this is (`myself`) has a replica that is not failed."""
    me = ""
    replicas_of: list[str] = []
    for line in nodes.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        flags = fields[2].split(",")
        if "myself" in flags:
            me = fields[0]
        if "slave" in flags and "fail" not in flags:
            replicas_of.append(fields[3])
    return me in replicas_of


class ClusterSubscriptions:
    """The channels this process's watchers listen to, each on the pub/sub connection of the
    primary that owns its slot (a Subscriptions, sharded, per node)."""

    def __init__(self, client: RedisCluster, connect: Any) -> None:
        self._client = client
        self._connect = connect
        self._channels: dict[bytes, _Channel] = {}
        self._homes: dict[bytes, str] = {}  # channel -> the node name serving it
        self._nodes: dict[str, Subscriptions] = {}
        self._stale = asyncio.Event()
        self._refresh = False  # the slot map must be read again (a node was lost or refused)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def join(self, channel: bytes, wake: asyncio.Event) -> _Channel:
        entry, new = join_channel(self._channels, channel, wake)
        if new:
            self._rehome(refresh=False)
        return entry

    def leave(self, channel: bytes, wake: asyncio.Event) -> None:
        if leave_channel(self._channels, channel, wake):
            home = self._homes.pop(channel, None)
            if home is not None:
                self._nodes[home].release(channel)

    def _lost(self) -> None:
        self._rehome(refresh=True)

    def _rehome(self, *, refresh: bool) -> None:
        self._refresh = self._refresh or refresh
        self._stale.set()
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        pause = RECONNECT_FIRST_S
        while self._stale.is_set() and not self._closed:
            self._stale.clear()
            refresh, self._refresh = self._refresh, False
            try:
                if refresh:
                    await self._client.nodes_manager.initialize()
                else:
                    await self._client.initialize()
                self._assign(refresh)
                pause = RECONNECT_FIRST_S
            except Exception as error:  # unreachable, or a slot not covered yet: try again
                log.warning("store cluster slots unknown", extra={"error": type(error).__name__})
                self._refresh = True
                self._stale.set()
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECONNECT_CAP_S)

    def _assign(self, refresh: bool) -> None:
        """Each channel onto the node that owns its slot now (no await: join and leave wait); after a
        refresh, one not confirmed is subscribed again even where it was."""
        for channel, entry in list(self._channels.items()):
            node = self._client.nodes_manager.get_node_from_slot(key_slot(channel))
            home = self._homes.get(channel)
            if home == node.name and (entry.confirmed.is_set() or not refresh):
                continue
            if home is not None:
                self._nodes[home].release(channel)
            subscriptions = self._nodes.get(node.name)
            if subscriptions is None:
                subscriptions = self._nodes[node.name] = Subscriptions(
                    functools.partial(self._connect, node.host, node.port), sharded=True, on_lost=self._lost
                )
            self._homes[channel] = node.name
            subscriptions.adopt(channel, entry)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for subscriptions in self._nodes.values():
            await subscriptions.close()
