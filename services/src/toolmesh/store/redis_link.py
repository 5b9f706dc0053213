"""One connection to Redis carrying every command of a process, pipelined.

Commands issued in one turn of the event loop are written together, by a
callback at the end of that turn (no task of its own: the bytes go to the
socket's buffer at once, so a lone command costs no extra turn); Redis
answers in order, and a single reader hands each reply to its command. So a
call's scripts cost no pool checkout and no connection of their own, and
under load many calls share each write and each read. A reply that does not
come within the reply timeout, or a broken connection, fails every command
still waiting (STORE_UNAVAILABLE) and the next command connects again:
replies are never matched to the wrong command, and a command is never sent
twice.

A durable command (toolmesh.store.durability) is answered only once a replica
has it: one WAIT follows the last durable command of a write, and covers every
write this connection made before it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.store.durability import NotReplicated

log = logging.getLogger("toolmesh.store")

# What a lost connection looks like, from redis-py and from the socket.
LOST = (RedisConnectionError, RedisTimeoutError, OSError)


class Link:
    def __init__(self, connect: Callable[[], AbstractConnection]) -> None:
        self._connect = connect
        self._connection: AbstractConnection | None = None
        # Commands not written yet (with the WAIT a durable one needs after it, else None), and the
        # replies awaited for those written, in order.
        self._queued: list[tuple[tuple[Any, ...], asyncio.Future[Any], tuple[Any, ...] | None]] = []
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._sent = asyncio.Event()
        # A write is due at the end of this turn of the event loop (a callback queued).
        self._flush_due = False
        # Connecting (the first command, or the first after a loss): commands queue meanwhile.
        self._opening: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        # Connections lost on a write, being closed.
        self._closing: set[asyncio.Task[None]] = set()

    def send(self, *args: Any, wait: tuple[Any, ...] | None = None) -> asyncio.Future[Any]:
        """The command's reply, to await; ToolmeshError(STORE_UNAVAILABLE) when Redis cannot answer.

        With `wait` (a WAIT command), the reply comes once WAIT has answered: NotReplicated (holding
        the reply) when no replica confirmed.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queued.append((args, future, wait))
        if not self._flush_due:
            self._flush_due = True
            # Runs after the callbacks already queued in this turn: every command they issue goes too.
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        """Write every queued command in one write (connecting first, in a task, when unconnected)."""
        self._flush_due = False
        if not self._queued or (self._opening is not None and not self._opening.done()):
            return  # nothing to write, or the connecting task writes them once connected
        connection = self._connection
        if connection is None:
            self._opening = asyncio.create_task(self._open_and_flush())
            return
        try:
            batch, self._queued = self._queued, []
            commands = self._with_waits(batch)
            self._sent.set()
            writer = connection._writer  # redis-py's StreamWriter: buffered, never blocks
            if writer is None or writer.transport.is_closing():
                raise RedisConnectionError("the connection to Redis is closed")
            # A Redis that stops reading leaves the bytes in the buffer: the reply timeout fails them.
            writer.writelines(connection.pack_commands(commands))
        except Exception as error:  # lost, or anything else: nothing waits for ever
            if not isinstance(error, LOST):
                log.error("store connection failed", extra={"error": type(error).__name__})
            lost = self._drop()
            if lost is not None:
                closing = asyncio.create_task(lost.disconnect(nowait=True))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)

    async def _open_and_flush(self) -> None:
        try:
            await self._open()
        except Exception as error:  # unreachable, or anything else: nothing waits for ever
            if not isinstance(error, LOST):
                log.error("store connection failed", extra={"error": type(error).__name__})
            await self._lose()
            return
        self._opening = None
        self._flush()

    def _with_waits(
        self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any], tuple[Any, ...] | None]]
    ) -> list[tuple[Any, ...]]:
        """The batch's commands, each awaited in order; one WAIT after the last durable one, which
        answers the durable ones (their replies held until then)."""
        commands = [args for args, _, _ in batch]
        durable = [(future, wait) for _, future, wait in batch if wait is not None]
        if not durable:
            self._waiting.extend(future for _, future, _ in batch)
            return commands
        replies: list[tuple[asyncio.Future[Any], asyncio.Future[Any]]] = []
        for _, future, wait in batch:
            if wait is None:
                self._waiting.append(future)
            else:
                reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                self._waiting.append(reply)
                replies.append((reply, future))
        # The longest wait any of them asked for (they share it).
        wait_command = max((wait for _, wait in durable), key=lambda command: command[-1])
        acked: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append(acked)
        acked.add_done_callback(lambda _: _answer_durable(replies, acked))
        return [*commands, wait_command]

    async def _open(self) -> AbstractConnection:
        connection = self._connect()
        await connection.connect()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
        self._connection = connection
        self._reader = asyncio.create_task(self._read(connection))
        return connection

    async def _read(self, connection: AbstractConnection) -> None:
        while True:
            if not self._waiting:
                self._sent.clear()
                await self._sent.wait()
                continue
            try:
                # Bounded by the socket timeout: a reply late by that much fails everything waiting.
                # Not disconnected by redis-py on an error: _lose does it, once no write is under way.
                reply: Any = await connection.read_response(disconnect_on_error=False)
            except ResponseError as error:
                reply = error
            except Exception as error:  # lost, or a reply it cannot parse: nothing waits for ever
                if not isinstance(error, LOST):
                    log.error("store connection failed", extra={"error": type(error).__name__})
                if connection is self._connection:
                    await self._lose()
                else:
                    await connection.disconnect(nowait=True)
                return
            future = self._waiting.popleft()
            if future.done():
                continue  # its caller left
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _lose(self) -> None:
        """Fail every command written or queued; the next command connects again."""
        connection = self._drop()
        if connection is not None:
            await connection.disconnect(nowait=True)

    def _drop(self) -> AbstractConnection | None:
        """Fail every command written or queued and stop the reader; the connection, to close."""
        connection, self._connection = self._connection, None
        failed = [*self._waiting, *(future for _, future, _ in self._queued)]
        self._waiting.clear()
        self._queued = []
        for future in failed:
            if not future.done():
                future.set_exception(ToolmeshError(Code.STORE_UNAVAILABLE))
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        return connection

    async def close(self) -> None:
        for task in (self._opening, self._reader, *self._closing):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._lose()


def _answer_durable(
    replies: list[tuple[asyncio.Future[Any], asyncio.Future[Any]]], acked: asyncio.Future[Any]
) -> None:
    """Answer each durable command from its reply and the WAIT's (replies come in order: every
    reply is in by the WAIT's)."""
    confirmed = not acked.exception() and isinstance(acked.result(), int) and acked.result() >= 1
    for reply, future in replies:
        if future.done():
            continue  # its caller left
        error = reply.exception() if reply.done() else ToolmeshError(Code.STORE_UNAVAILABLE)
        if error is None and acked.exception() is not None:
            error = acked.exception()  # the script ran; whether a replica has it is unknown
        if error is not None:
            future.set_exception(error)
        elif confirmed:
            future.set_result(reply.result())
        else:
            future.set_exception(NotReplicated(reply.result()))
