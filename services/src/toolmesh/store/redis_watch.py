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
from typing import Any, TypeVar

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

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


class Subscriptions:
    """The channels this process's watchers listen to, on one pub/sub connection that it keeps up."""

    def __init__(self, connect: Callable[[], AbstractConnection]) -> None:
        self._connect = connect
        self._channels: dict[bytes, _Channel] = {}
        self._changed = asyncio.Event()  # the set of channels changed: (un)subscribe
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def join(self, channel: bytes, wake: asyncio.Event) -> _Channel:
        entry = self._channels.get(channel)
        if entry is None:
            entry = self._channels[channel] = _Channel()
            self._changed.set()
        entry.wakes.add(wake)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return entry

    def leave(self, channel: bytes, wake: asyncio.Event) -> None:
        entry = self._channels.get(channel)
        if entry is None:
            return
        entry.wakes.discard(wake)
        if not entry.wakes:
            del self._channels[channel]
            self._changed.set()

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
            await asyncio.sleep(pause)
            pause = min(pause * 2, RECONNECT_CAP_S)

    async def _serve(self, connection: AbstractConnection) -> None:
        """Read messages; (un)subscribe whenever the set of channels changes. Returns when closed."""
        subscribed: set[bytes] = set()
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
                    wanted = set(self._channels)
                    if wanted - subscribed:
                        await connection.send_command("SUBSCRIBE", *(wanted - subscribed), check_health=False)
                    if subscribed - wanted:
                        await connection.send_command(
                            "UNSUBSCRIBE", *(subscribed - wanted), check_health=False
                        )
                    subscribed = wanted
                await asyncio.wait({reading, changed}, return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    continue
                message = reading.result()
                reading = asyncio.create_task(connection.read_response(timeout=PING_EVERY_S))
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

    def _deliver(self, message: Any) -> None:
        if not isinstance(message, list) or len(message) < 2:
            return  # a pong
        kind, channel = message[0], message[1]
        entry = self._channels.get(channel)
        if entry is None:
            return
        if kind == b"subscribe":
            entry.confirmed.set()
            entry.wake()
        elif kind == b"message":
            entry.wake()


_NOTHING: Any = object()


async def watch(
    subscriptions: Subscriptions, channel: bytes, read: Callable[[], Awaitable[tuple[T, float | None]]]
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
