"""One connection to Redis carrying every command of a process, pipelined.

Commands issued in one turn of the event loop are written together; Redis
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
        self._writer: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        # The connection a write is under way on: one lost meanwhile is closed once the write ends,
        # not under it (redis-py would write on a closed socket's None writer).
        self._writing: AbstractConnection | None = None

    def send(self, *args: Any, wait: tuple[Any, ...] | None = None) -> asyncio.Future[Any]:
        """The command's reply, to await; ToolmeshError(STORE_UNAVAILABLE) when Redis cannot answer.

        With `wait` (a WAIT command), the reply comes once WAIT has answered: NotReplicated (holding
        the reply) when no replica confirmed.
        """
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queued.append((args, future, wait))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        return future

    async def _write(self) -> None:
        # This task first runs after the turn of the event loop that started it: every command
        # issued in that turn is queued by then, and goes out in one write.
        while self._queued:
            try:
                connection = self._connection or await self._open()
                batch, self._queued = self._queued, []
                commands = self._with_waits(batch)
                self._sent.set()
                packed = connection.pack_commands(commands)
                self._writing = connection
                try:
                    await connection.send_packed_command(packed, check_health=False)
                finally:
                    self._writing = None
                if connection is not self._connection:  # the reader lost it meanwhile
                    await connection.disconnect(nowait=True)
            except Exception as error:  # lost, or anything else: nothing waits for ever
                if not isinstance(error, LOST):
                    log.error("store connection failed", extra={"error": type(error).__name__})
                await self._lose()

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
                elif connection is not self._writing:
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
        if connection is not None and connection is not self._writing:
            await connection.disconnect(nowait=True)

    async def close(self) -> None:
        for task in (self._writer, self._reader):
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
