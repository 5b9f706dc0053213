"""The web port against slow and many clients: request read timeout, connection caps (finding 6)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from toolmesh.bridge.web import ConnectionLimits, start_web_server
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration]

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def ok(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole request, as the Connect application does, then answers "ok"."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Clients:
    """Raw TCP clients of one port, each from a chosen loopback address; all closed at the end."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.writers: list[asyncio.StreamWriter] = []

    async def connect(self, source: str = "127.0.0.1") -> Stream:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(source, 0))
        self.writers.append(writer)
        return reader, writer

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def serving(limits: ConnectionLimits) -> AsyncIterator[Clients]:
    server = await start_web_server(ok, "127.0.0.1:0", limits=limits)
    clients = Clients(server.port)
    try:
        yield clients
    finally:
        await clients.close()
        await server.stop(0)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (within 10 s) without answering anything."""
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        return True


async def answered(stream: Stream) -> bool:
    reader, writer = stream
    writer.write(REQUEST)
    status = await asyncio.wait_for(reader.readline(), 10)
    await asyncio.wait_for(reader.readuntil(b"ok"), 10)
    return status.startswith(b"HTTP/1.1 200")


async def test_a_half_sent_request_is_closed_after_the_read_timeout() -> None:
    async with serving(ConnectionLimits(request_read_s=0.3)) as clients:
        # A header that never ends (slowloris).
        reader, writer = await clients.connect()
        writer.write(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
        assert await closed_by_server(reader)
        # A body that never arrives whole.
        reader, writer = await clients.connect()
        writer.write(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\nx")
        assert await closed_by_server(reader)
        # After a response, the next request must arrive in time as well.
        stream = await clients.connect()
        assert await answered(stream)
        stream[1].write(b"GET / HTTP/1.1\r\nHost: 1")
        assert await closed_by_server(stream[0])


async def test_connections_are_capped_per_address_and_per_port() -> None:
    limits = ConnectionLimits(
        request_read_s=30, keep_alive_s=30, max_connections=3, max_connections_per_address=2
    )
    async with serving(limits) as clients:
        first = [await clients.connect() for _ in range(2)]
        for stream in first:
            assert await answered(stream)  # served, and kept open
        reader, _ = await clients.connect()
        assert await closed_by_server(reader)  # a third from 127.0.0.1
        assert await answered(await clients.connect("127.0.0.2"))  # another address still gets in
        reader, _ = await clients.connect("127.0.0.3")
        assert await closed_by_server(reader)  # the port's cap (3) is reached
        # A connection that ends makes room again.
        first[0][1].close()

        async def room() -> bool:
            try:
                return await answered(await clients.connect("127.0.0.3"))
            except (ConnectionResetError, asyncio.IncompleteReadError):
                return False

        assert await eventually(room)


async def test_served_connections_send_small_writes_at_once() -> None:
    # uvicorn writes a response's head and body apart: with Nagle's algorithm on, the second
    # waits for the client's delayed ACK (about 40 ms on Linux), on every request.
    server = await start_web_server(ok, "127.0.0.1:0")
    clients = Clients(server.port)
    try:
        assert await answered(await clients.connect())
        (connection,) = server.server.server_state.connections
        sock = connection.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        await clients.close()
        await server.stop(0)
