"""A chat-completions server over real HTTP on port 0 that answers from a script.

Each request takes the next step of the script: a Reply, or an async callable
that gets the request body and returns one (it may wait, or change the world
first). When the script runs out, the server answers HTTP 500. With `cors=True` it also
answers preflights and allows every origin, so that a page can call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

Body = dict[str, Any]


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes = b""


Step = Reply | Callable[[Body], Awaitable[Reply]]


def _completion(message: Body) -> Reply:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "stop"}
    return Reply(
        200, json.dumps({"id": "chatcmpl-test", "object": "chat.completion", "choices": [choice]}).encode()
    )


def answer(text: str) -> Reply:
    return _completion({"content": text})


def tool_calls(*calls: tuple[str, Any]) -> Reply:
    """Tool calls by (name, arguments); arguments given as a str are sent as they are."""
    wire = [
        {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
        }
        for index, (name, args) in enumerate(calls)
    ]
    return _completion({"content": None, "tool_calls": wire})


def failure(status: int = 500) -> Reply:
    return Reply(status, b'{"error": {"message": "scripted failure"}}')


def raw(body: bytes) -> Reply:
    return Reply(200, body)


class Hold:
    """A step that waits until released (or forever), then replies."""

    def __init__(self, then: Reply | None = None) -> None:
        self.entered = asyncio.Event()
        self.released = asyncio.Event()
        self.then = then or answer("released")

    async def __call__(self, body: Body) -> Reply:
        self.entered.set()
        await self.released.wait()
        return self.then


def before(action: Callable[[], Awaitable[object]], reply: Reply) -> Step:
    """A step that runs `action` and then replies."""

    async def step(body: Body) -> Reply:
        await action()
        return reply

    return step


CORS_HEADERS = (
    "Access-Control-Allow-Origin: *\r\nAccess-Control-Allow-Headers: content-type\r\n"
    "Access-Control-Allow-Methods: POST\r\n"
)


class ScriptedModel:
    def __init__(self, *, cors: bool = False) -> None:
        self.cors = cors
        self.requests: list[Body] = []
        self._steps: deque[Step] = deque()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *steps: Step) -> None:
        self._steps = deque(steps)
        self.requests = []

    def tool_messages(self, request: int) -> list[Body]:
        return [m for m in self.requests[request]["messages"] if m["role"] == "tool"]

    async def start(self) -> ScriptedModel:
        self._server = await asyncio.start_server(self._track, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    async def _track(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            headers = dict(
                line.split(":", 1) for line in head.decode("latin-1").split("\r\n")[1:] if ":" in line
            )
            length = int({k.strip().lower(): v.strip() for k, v in headers.items()}.get("content-length", 0))
            if self.cors and head.startswith(b"OPTIONS "):
                writer.write(f"HTTP/1.1 204 X\r\n{CORS_HEADERS}Content-Length: 0\r\n\r\n".encode())
                await writer.drain()
                continue
            body: Body = json.loads(await reader.readexactly(length))
            self.requests.append(body)
            reply = await self._reply(body, reader)
            if reply is None:
                return  # the client went away while the step waited
            writer.write(
                f"HTTP/1.1 {reply.status} X\r\nContent-Type: application/json\r\n"
                f"{CORS_HEADERS if self.cors else ''}"
                f"Content-Length: {len(reply.body)}\r\n\r\n".encode()
                + reply.body
            )
            await writer.drain()

    async def _reply(self, body: Body, reader: asyncio.StreamReader) -> Reply | None:
        step = self._steps.popleft() if self._steps else failure(500)
        if isinstance(step, Reply):
            return step
        pending = asyncio.ensure_future(step(body))
        gone = asyncio.ensure_future(reader.read(1))
        await asyncio.wait({pending, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
            return None
        return pending.result()


@contextlib.asynccontextmanager
async def running_model(*, cors: bool = False) -> AsyncIterator[ScriptedModel]:
    server = await ScriptedModel(cors=cors).start()
    try:
        yield server
    finally:
        await server.stop()
