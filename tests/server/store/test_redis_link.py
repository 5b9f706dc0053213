"""The Redis link when its connection breaks: every command waiting fails with STORE_UNAVAILABLE, the
next one connects again, and a break is not logged as an error.

A scripted connection stands in for redis-py's: like it, it has a socket writer (which the link
writes to at the end of the event loop's turn) that its disconnect sets to None.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.store.redis_link import Link
from toolmesh_testing import eventually, logged

pytestmark = pytest.mark.unit


class Transport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing


class Writer:
    def __init__(self, written: list[Any]) -> None:
        self.written = written
        self.transport = Transport()

    def writelines(self, data: Any) -> None:
        self.written.append(data)


class ScriptedConnection:
    """Its writes go to a list; its reads wait for `reply` (a value, or an exception to raise)."""

    def __init__(self) -> None:
        self._writer: Writer | None = None
        self.replies: asyncio.Queue[Any] = asyncio.Queue()
        # Every write made, in order.
        self.written: list[Any] = []

    async def connect(self) -> None:
        self._writer = Writer(self.written)

    def pack_commands(self, commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return commands

    async def read_response(self, disconnect_on_error: bool = True) -> Any:
        reply = await self.replies.get()
        if isinstance(reply, Exception):
            if disconnect_on_error:
                await self.disconnect(nowait=True)
            raise reply
        return reply

    async def disconnect(self, nowait: bool = False) -> None:
        self._writer = None


async def one_command_written() -> tuple[list[ScriptedConnection], Link, asyncio.Future[Any]]:
    """A link, the connections it made (one so far), and a command written on the first."""
    connections: list[ScriptedConnection] = []

    def connect() -> Any:
        connections.append(ScriptedConnection())
        return connections[-1]

    link = Link(connect)
    first = link.send("GET", "a")
    await eventually(lambda: connections and connections[0].written)
    return connections, link, first


async def answered_on_a_new_connection(link: Link, connections: list[ScriptedConnection]) -> None:
    """The next command connects again, and is answered."""
    command = link.send("GET", "b")
    again: ScriptedConnection = await eventually(lambda: connections[1] if len(connections) > 1 else None)
    again.replies.put_nowait(b"b")
    assert await asyncio.wait_for(command, 1) == b"b"


async def test_commands_of_one_turn_go_in_one_write() -> None:
    connections, link, first = await one_command_written()
    connection = connections[0]
    second, third = link.send("GET", "b"), link.send("GET", "c")
    await eventually(lambda: len(connection.written) == 2)
    assert connection.written == [[("GET", "a")], [("GET", "b"), ("GET", "c")]]
    for reply in (b"a", b"b", b"c"):
        connection.replies.put_nowait(reply)
    assert list(await asyncio.wait_for(asyncio.gather(first, second, third), 1)) == [b"a", b"b", b"c"]
    await link.close()


async def test_a_connection_lost_fails_its_commands_quietly_and_the_next_connects_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    connections, link, first = await one_command_written()
    connection = connections[0]
    # The reader sees the connection break before the reply.
    connection.replies.put_nowait(RedisConnectionError("Connection closed by server."))
    with pytest.raises(ToolmeshError) as failed:
        await asyncio.wait_for(first, 1)
    assert failed.value.code is Code.STORE_UNAVAILABLE
    assert connection._writer is None  # closed
    assert logged(caplog.records, "store connection failed") == 0
    await answered_on_a_new_connection(link, connections)
    await link.close()


async def test_a_write_on_a_closing_connection_fails_its_commands_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    connections, link, first = await one_command_written()
    connection = connections[0]
    assert connection._writer is not None
    connection._writer.transport.closing = True  # the socket is going, the reader has not seen it yet
    second = link.send("GET", "b")
    for waiting in (first, second):
        with pytest.raises(ToolmeshError) as failed:
            await asyncio.wait_for(waiting, 1)
        assert failed.value.code is Code.STORE_UNAVAILABLE
    await eventually(lambda: connection._writer is None)  # closed
    assert logged(caplog.records, "store connection failed") == 0
    await answered_on_a_new_connection(link, connections)
    await link.close()
