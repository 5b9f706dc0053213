"""Watching Redis keys through pub/sub: one connection per process, subscribed again after every loss.

Every write script publishes on the channel named like the key it wrote. A
watcher subscribes to that channel, and only once Redis has confirmed the
subscription does it read the key: a change after that read is announced to
it, one before is in what it read. When the connection drops, every channel
is subscribed again on a new connection and every watcher reads again, so a
change made during an outage is seen after it. (Keyspace notifications would
need CONFIG on the server, and on a cluster each node sends only its own.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.store.base import until_set

log = logging.getLogger("toolmesh.store")

# A connection quiet this long is pinged; one that stays quiet as long again is taken as lost.
PING_EVERY_S = 5.0
# Reconnecting: first pause, doubled up to the cap while Redis stays away.
RECONNECT_FIRST_S = 0.05
RECONNECT_CAP_S = 1.0
# A watcher whose read failed reads again after this long at most (or as soon as resubscribed).
REREAD_AFTER_S = 0.5
# Redis expires keys to the millisecond: reading just after a key's expiry sees it gone.
_EXPIRY_MARGIN_S = 0.005

T = TypeVar("T")


class _Channel:
    __slots__ = ("confirmed", "wakes")

    def __init__(self) -> None:
        self.wakes: set[asyncio.Event] = set()
        # Set while Redis has confirmed the subscription on the current connection.
        self.confirmed = asyncio.Event()

    def wake(self) -> None:
        for event in self.wakes:
            event.set()


def join_channel(
    channels: dict[bytes, _Channel], channel: bytes, wake: asyncio.Event
) -> tuple[_Channel, bool]:
    """Add a watcher's wake-up to `channel`'s entry; the entry, and whether it is new."""
    entry = channels.get(channel)
    new = entry is None
    if entry is None:
        entry = channels[channel] = _Channel()
    entry.wakes.add(wake)
    return entry, new


def leave_channel(channels: dict[bytes, _Channel], channel: bytes, wake: asyncio.Event) -> bool:
    """Remove a watcher's wake-up; whether that was the channel's last watcher (its entry dropped)."""
    entry = channels.get(channel)
    if entry is None:
        return False
    entry.wakes.discard(wake)
    if entry.wakes:
        return False
    del channels[channel]
    return True


class Subscriptions:
    """The channels this process's watchers listen to, on one pub/sub connection that it keeps up."""

    def __init__(
        self,
        connect: Callable[[], AbstractConnection],
        *,
        sharded: bool = False,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._connect = connect
        self._channels: dict[bytes, _Channel] = {}
        self._changed = asyncio.Event()  # the set of channels changed: (un)subscribe
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # Sharded (one cluster node's): SSUBSCRIBE, one channel per command (each its own slot's),
        # and `on_lost` told when the connection is lost or a channel's slot is no longer served here.
        self._sharded = sharded
        self._on_lost = on_lost
        self._subscribed: set[bytes] = set()
        self._resend: set[bytes] = set()

    def join(self, channel: bytes, wake: asyncio.Event) -> _Channel:
        entry, new = join_channel(self._channels, channel, wake)
        if new:
            self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return entry

    def leave(self, channel: bytes, wake: asyncio.Event) -> None:
        if leave_channel(self._channels, channel, wake):
            self._changed.set()

    def adopt(self, channel: bytes, entry: _Channel) -> None:
        """Take over a channel another node's subscriptions served (sharded: its slot moved here)."""
        entry.confirmed.clear()
        entry.wake()
        self._channels[channel] = entry
        self._resend.add(channel)
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    def release(self, channel: bytes) -> None:
        """Stop serving a channel (sharded: its slot moved to another node, or nobody watches it)."""
        if self._channels.pop(channel, None) is not None:
            self._changed.set()

    def served(self, channel: bytes) -> bool:
        return channel in self._channels

    async def close(self) -> None:
        # The flag and the wake-up too: a cancellation can be lost in a command's own timeout.
        self._closed = True
        self._changed.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        pause = RECONNECT_FIRST_S
        while not self._closed:
            connection = self._connect()
            try:
                await connection.connect()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                pause = RECONNECT_FIRST_S
                await self._serve(connection)
            except Exception as error:  # whatever it was, the watchers need the loop to go on
                log.warning("store subscriptions lost", extra={"error": type(error).__name__})
            finally:
                for entry in self._channels.values():
                    entry.confirmed.clear()
                    entry.wake()  # each watcher waits for its channel again, then reads again
                await connection.disconnect(nowait=True)
            if self._on_lost is not None:
                self._on_lost()  # the node may be gone for good: where do its channels live now?
                if not self._channels:
                    return  # all moved elsewhere: nothing to reconnect for (adopt starts it again)
            await asyncio.sleep(pause)
            pause = min(pause * 2, RECONNECT_CAP_S)

    async def _serve(self, connection: AbstractConnection) -> None:
        """Read messages; (un)subscribe whenever the set of channels changes. Returns when closed."""
        self._subscribed = set()
        self._resend.clear()
        self._changed.set()
        reading: asyncio.Task[Any] = asyncio.create_task(connection.read_response(timeout=PING_EVERY_S))
        changed: asyncio.Task[Any] = asyncio.create_task(self._changed.wait())
        pinged = False
        try:
            while not self._closed:
                if self._changed.is_set():
                    self._changed.clear()
                    changed.cancel()
                    changed = asyncio.create_task(self._changed.wait())
                    await self._subscribe(connection)
                await asyncio.wait({reading, changed}, return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    continue
                try:
                    message = reading.result()
                except ResponseError as error:
                    if not self._sharded:
                        raise
                    # MOVED: a channel's slot is served elsewhere; the channel stays unconfirmed
                    # until the cluster's subscriptions move it.
                    log.warning("store subscription refused", extra={"error": str(error).split(" ")[0]})
                    message = _REFUSED
                reading = asyncio.create_task(connection.read_response(timeout=PING_EVERY_S))
                if message is _REFUSED:
                    if self._on_lost is not None:
                        self._on_lost()
                    continue
                if message is None:  # quiet for PING_EVERY_S
                    if pinged:
                        raise RedisConnectionError("the store did not answer a ping")
                    await connection.send_command("PING", check_health=False)
                    pinged = True
                    continue
                pinged = False
                self._deliver(message)
        finally:
            reading.cancel()
            changed.cancel()

    async def _subscribe(self, connection: AbstractConnection) -> None:
        """Subscribe to the channels wanted and not subscribed (or to send again), leave the others."""
        subscribed = self._subscribed
        wanted = set(self._channels)
        joining, leaving = (wanted - subscribed) | (self._resend & wanted), subscribed - wanted
        self._resend.clear()
        if self._sharded:  # a shard channel per command: several in one must share a slot
            for channel in joining:
                await connection.send_command("SSUBSCRIBE", channel, check_health=False)
            for channel in leaving:
                await connection.send_command("SUNSUBSCRIBE", channel, check_health=False)
        else:
            if joining:
                await connection.send_command("SUBSCRIBE", *joining, check_health=False)
            if leaving:
                await connection.send_command("UNSUBSCRIBE", *leaving, check_health=False)
        subscribed.difference_update(leaving)
        subscribed.update(joining)

    def _deliver(self, message: Any) -> None:
        if not isinstance(message, list) or len(message) < 2:
            return  # a pong
        kind, channel = message[0], message[1]
        entry = self._channels.get(channel)
        if entry is None:
            return
        if kind in (b"subscribe", b"ssubscribe"):
            entry.confirmed.set()
            entry.wake()
        elif kind in (b"message", b"smessage"):
            entry.wake()
        elif kind == b"sunsubscribe":
            # Not asked for (the channel is still wanted): its slot moved to another node.
            entry.confirmed.clear()
            entry.wake()
            self._subscribed.discard(channel)
            if self._on_lost is not None:
                self._on_lost()


_NOTHING: Any = object()
_REFUSED: Any = object()


class Subscribing(Protocol):
    """What a watch needs: a channel to wait on, confirmed once subscribed (Subscriptions on one
    Redis, ClusterSubscriptions on a cluster)."""

    def join(self, channel: bytes, wake: asyncio.Event) -> _Channel: ...

    def leave(self, channel: bytes, wake: asyncio.Event) -> None: ...


async def watch(
    subscriptions: Subscribing, channel: bytes, read: Callable[[], Awaitable[tuple[T, float | None]]]
) -> AsyncGenerator[T, None]:
    """Yield what `read` gives (a state, and the seconds until it expires or None), first and after
    each change of it: on a message on `channel`, on expiry, and after every (re)subscription."""
    wake = asyncio.Event()
    entry = subscriptions.join(channel, wake)
    last: T = _NOTHING
    try:
        while True:
            await entry.confirmed.wait()
            wake.clear()
            try:
                state, expires_in_s = await read()
            except ToolmeshError as error:
                if error.code is not Code.STORE_UNAVAILABLE:
                    raise
                await until_set(wake, REREAD_AFTER_S)
                continue
            if state != last:
                last = state
                yield state
            await until_set(wake, None if expires_in_s is None else expires_in_s + _EXPIRY_MARGIN_S)
    finally:
        subscriptions.leave(channel, wake)
