"""A TCP proxy between a page and a web port that cuts its RunTool calls on cue.

It forwards bytes both ways, and watches the page's requests for the start of a RunTool call
(`POST /toolmesh.v1.InvocationService/RunTool`, at the start of what the page sends on an
HTTP/1.1 connection). Cues:

- `cut()` closes the connections that carried a RunTool call: the call drops mid-way.
- `swallow_next_call()`: the body of the next RunTool call's response is kept from the page (in
  `swallowed`) until `cut()`: the outcome was produced but never arrived. Its head goes through,
  so the browser does not send the request again on its own (Chromium does, once, for a request
  on a kept-alive connection that closes before any answer).
- `drop_calls`: every RunTool call is closed as it arrives, before the service sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

RUN_TOOL = b"POST /toolmesh.v1.InvocationService/RunTool "


@dataclass(eq=False)
class _Connection:
    page: asyncio.StreamWriter
    service: asyncio.StreamWriter
    run_tool: bool = False
    swallowing: bool = False
    head_passed: bool = False

    def close(self) -> None:
        for writer in (self.page, self.service):
            writer.transport.abort()


@dataclass
class CuttingProxy:
    target_port: int
    port: int = 0
    # RunTool calls the page sent through the proxy (dropped ones included).
    calls: int = 0
    drop_calls: bool = False
    swallowed: bytearray = field(default_factory=bytearray)
    _swallow_next: bool = False
    _server: asyncio.Server | None = None
    _connections: set[_Connection] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def swallow_next_call(self) -> None:
        self._swallow_next = True
        self.swallowed.clear()

    def cut(self) -> int:
        """Close every connection that carried a RunTool call; how many were closed."""
        cut = [connection for connection in self._connections if connection.run_tool]
        for connection in cut:
            connection.close()
        return len(cut)

    async def start(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for connection in list(self._connections):
            connection.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, page_reader: asyncio.StreamReader, page: asyncio.StreamWriter) -> None:
        service_reader, service = await asyncio.open_connection("127.0.0.1", self.target_port)
        connection = _Connection(page, service)
        self._connections.add(connection)
        pumps = [
            asyncio.create_task(self._from_page(page_reader, connection)),
            asyncio.create_task(self._from_service(service_reader, connection)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            connection.close()
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            self._connections.discard(connection)

    async def _from_page(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        with contextlib.suppress(ConnectionError):
            async for chunk in _chunks(reader):
                if chunk.startswith(RUN_TOOL):
                    self.calls += 1
                    connection.run_tool = True
                    if self.drop_calls:
                        return
                    if self._swallow_next:
                        self._swallow_next = False
                        connection.swallowing = True
                connection.service.write(chunk)
                await connection.service.drain()

    async def _from_service(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        with contextlib.suppress(ConnectionError):
            async for chunk in _chunks(reader):
                if connection.swallowing:
                    head = 0
                    if not connection.head_passed:
                        end = chunk.find(b"\r\n\r\n")
                        head = len(chunk) if end < 0 else end + 4
                        connection.head_passed = end >= 0
                        connection.page.write(chunk[:head])
                    self.swallowed += chunk[head:]
                    continue
                connection.page.write(chunk)
                await connection.page.drain()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(65536):
        yield chunk


@contextlib.asynccontextmanager
async def cutting_proxy(target_port: int) -> AsyncIterator[CuttingProxy]:
    proxy = await CuttingProxy(target_port).start()
    try:
        yield proxy
    finally:
        await proxy.stop()
