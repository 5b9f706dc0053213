"""The floor: a bare grpc.aio chain of the same shape as a toolmesh call, with no logic in it.

caller -> front (unary) -> back (unary, held until the host answers)
back -> host (server stream) ; host -> back (unary submit) ; back -> front -> caller.

Each part runs as its own process: `python -m bench.floor front|back|lookup|host ...`.
`host --hold N` holds requests starting with HELD until N have arrived (the scale test's floor).
Messages are raw bytes (no serializers); the back server prefixes each request it
streams to a host with an 8-byte id, which the host's submit carries back.
`--lookup` makes the front also call a lookup server first, as the invocation
service asks the registry for the tool.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import struct
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench import loops

INVOKE = "/floor.Front/Invoke"
LOOKUP = "/floor.Lookup/Get"
DISPATCH = "/floor.Back/Dispatch"
OPEN = "/floor.Back/Open"
SUBMIT = "/floor.Back/Submit"
RESULT = b'{"ok":true}'
# With `host --hold`, requests starting with this are held; others are answered at once.
HELD = b"hold:"
SUBMIT_TIMEOUT_S = 30
# As toolmesh's host SDK: thousands of submits at once on one channel stall it.
MAX_SUBMITS_IN_FLIGHT = 256
_ID = struct.Struct("!Q")

# Raw bytes both ways: no serializers.
BytesCall = grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]


def _unary(handler: Any) -> grpc.RpcMethodHandler[bytes, bytes]:
    return grpc.unary_unary_rpc_method_handler(handler)


async def _serve(listen: str, handlers: list[grpc.GenericRpcHandler]) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(tuple(handlers))
    port = server.add_insecure_port(listen)
    await server.start()
    print(f"floor listening on port {port}", flush=True)
    await _until_signalled()
    await server.stop(1.0)


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


async def front(listen: str, back: str, lookup: str | None) -> None:
    channel = grpc.aio.insecure_channel(back)
    dispatch: BytesCall = channel.unary_unary(DISPATCH)
    get: BytesCall | None = grpc.aio.insecure_channel(lookup).unary_unary(LOOKUP) if lookup else None

    async def invoke(request: bytes, context: Any) -> bytes:
        if get is not None:
            await get(request)
        return await dispatch(request, timeout=context.time_remaining())

    await _serve(listen, [grpc.method_handlers_generic_handler("floor.Front", {"Invoke": _unary(invoke)})])


async def lookup_server(listen: str) -> None:
    async def get(request: bytes, context: Any) -> bytes:
        return request

    await _serve(listen, [grpc.method_handlers_generic_handler("floor.Lookup", {"Get": _unary(get)})])


async def back(listen: str) -> None:
    hosts: list[asyncio.Queue[bytes]] = []
    pending: dict[int, asyncio.Future[bytes]] = {}
    ids = itertools.count()

    async def dispatch(request: bytes, context: Any) -> bytes:
        if not hosts:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no host")
        request_id = next(ids)
        future = asyncio.get_running_loop().create_future()
        pending[request_id] = future
        hosts[request_id % len(hosts)].put_nowait(_ID.pack(request_id) + request)
        try:
            response: bytes = await future
        finally:
            pending.pop(request_id, None)
        return response

    async def open_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        hosts.append(queue)
        try:
            yield b""  # opened
            while True:
                yield await queue.get()
        finally:
            hosts.remove(queue)

    async def submit(request: bytes, context: Any) -> bytes:
        (request_id,) = _ID.unpack_from(request)
        future = pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(request[_ID.size :])
        return b""

    handlers = {
        "Dispatch": _unary(dispatch),
        "Open": grpc.unary_stream_rpc_method_handler(open_stream),
        "Submit": _unary(submit),
    }
    await _serve(listen, [grpc.method_handlers_generic_handler("floor.Back", handlers)])


@dataclass
class Hold:
    """Hold requests until `target` have arrived, then `seconds` more (the scale test)."""

    target: int
    seconds: float
    arrivals_file: Path
    arrived: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived >= self.target:
            self.released.set()
        if self.arrived % 50 == 0 or self.released.is_set():
            self.arrivals_file.write_text(str(self.arrived))
        await self.released.wait()
        await asyncio.sleep(self.seconds)


async def host(back_target: str, hold: Hold | None) -> None:
    """Receive requests on a server stream; answer each from its own task with a unary submit."""
    channel = grpc.aio.insecure_channel(back_target)
    submit: BytesCall = channel.unary_unary(SUBMIT)
    open_stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(OPEN)
    call = open_stream(b"")
    tasks: set[asyncio.Task[Any]] = set()
    reader = asyncio.create_task(_read(call, submit, tasks, hold))
    stopper = asyncio.create_task(_until_signalled())
    await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    call.cancel()
    reader.cancel()
    await channel.close()


async def _read(
    call: grpc.aio.UnaryStreamCall[bytes, bytes],
    submit: BytesCall,
    tasks: set[asyncio.Task[Any]],
    hold: Hold | None,
) -> None:
    submitting = asyncio.Semaphore(MAX_SUBMITS_IN_FLIGHT)
    async for message in call:
        if not message:
            print("floor host: connected", file=sys.stderr, flush=True)
            continue
        held = hold if hold is not None and message[_ID.size :].startswith(HELD) else None
        task = asyncio.create_task(_answer(submit, message[: _ID.size], held, submitting))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _answer(
    submit: BytesCall, request_id: bytes, hold: Hold | None, submitting: asyncio.Semaphore
) -> None:
    if hold is not None:
        await hold.wait()
    async with submitting:
        await submit(request_id + RESULT, timeout=SUBMIT_TIMEOUT_S)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor")
    parser.add_argument("role", choices=["front", "back", "lookup", "host"])
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--back")
    parser.add_argument("--lookup")
    parser.add_argument("--hold", type=int, help="host: hold requests until this many arrived")
    parser.add_argument("--hold-s", type=float, default=1.0, help="host: then hold them this long more")
    parser.add_argument("--arrivals", type=Path, help="host: where to keep the count of held requests")
    args = parser.parse_args()
    if args.role == "front":
        loops.run(front(args.listen, args.back, args.lookup))
    elif args.role == "back":
        loops.run(back(args.listen))
    elif args.role == "lookup":
        loops.run(lookup_server(args.listen))
    else:
        hold = Hold(args.hold, args.hold_s, args.arrivals) if args.hold else None
        loops.run(host(args.back, hold))


if __name__ == "__main__":
    main()
