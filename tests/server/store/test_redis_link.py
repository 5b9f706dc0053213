"""The Redis link when its connection breaks: every command waiting fails with STORE_UNAVAILABLE, the
next one connects again, and a break is not logged as an error.

A scripted connection stands in for redis-py's: like it, it writes through a
socket writer its disconnect sets to None.
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


class Writer:
    def __init__(self) -> None:
        self.written: list[Any] = []

    def writelines(self, data: Any) -> None:
        self.written.append(data)


class ScriptedConnection:
    """Its sends wait for `release`; its reads wait for `reply` (a value, or an exception to raise)."""

    def __init__(self) -> None:
        self._writer: Writer | None = None
        self.release = asyncio.Event()
        self.replies: asyncio.Queue[Any] = asyncio.Queue()

    async def connect(self) -> None:
        self._writer = Writer()

    def pack_commands(self, commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return commands

    async def send_packed_command(self, packed: Any, check_health: bool = True) -> None:
        await self.release.wait()
        self._writer.writelines(packed)  # type: ignore[union-attr]  # as redis-py's does

    async def read_response(self, disconnect_on_error: bool = True) -> Any:
        reply = await self.replies.get()
        if isinstance(reply, Exception):
            if disconnect_on_error:
                await self.disconnect(nowait=True)
            raise reply
        return reply

    async def disconnect(self, nowait: bool = False) -> None:
        self._writer = None


async def test_a_connection_lost_while_a_write_is_under_way_fails_its_commands_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    connections: list[ScriptedConnection] = []

    def connect() -> Any:
        connections.append(ScriptedConnection())
        return connections[-1]

    link = Link(connect)
    first = link.send("GET", "a")
    connection: ScriptedConnection = await eventually(
        lambda: connections[0] if connections else None
    )  # writing
    second = link.send("GET", "b")
    await asyncio.sleep(0.01)
    # The reader sees the connection break while the write of the first command is still under way.
    connection.replies.put_nowait(RedisConnectionError("Connection closed by server."))
    with pytest.raises(ToolmeshError) as failed:
        await asyncio.wait_for(first, 1)
    assert failed.value.code is Code.STORE_UNAVAILABLE
    connection.release.set()
    with pytest.raises(ToolmeshError):
        await asyncio.wait_for(second, 1)
    await asyncio.sleep(0.01)
    assert connection._writer is None  # closed once the write ended
    assert logged(caplog.records, "store connection failed") == 0
    # The next command connects again.
    third = link.send("GET", "c")
    again: ScriptedConnection = await eventually(lambda: connections[1] if len(connections) > 1 else None)
    again.release.set()
    again.replies.put_nowait(b"c")
    assert await asyncio.wait_for(third, 1) == b"c"
    await link.close()
