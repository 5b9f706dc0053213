"""On toolmesh's uvloop loop a subprocess is started by subprocess.Popen, not by libuv's fork().

(toolmesh.core.spawn.) uvloop's own spawn forks, which runs the process's
at-fork handlers: grpcio's start gRPC's threads again in the child, which
crashed it (SIGSEGV) within a few hundred spawns beside busy grpc.aio
channels. Each test runs its own loop, toolmesh's uvloop one, whatever
TOOLMESH_EVENT_LOOP the suite runs with.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Callable

import grpc
import pytest

from toolmesh.core import event_loop, spawn

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not spawn.available(), reason="no pidfds: uvloop spawns as it does"),
]

# Every fork of this process that runs Python's at-fork handlers (os.fork, uvloop's spawn) adds one.
FORKS: list[int] = []
os.register_at_fork(before=lambda: FORKS.append(os.getpid()))

TRUE = shutil.which("true") or "/bin/true"


@pytest.fixture
def uvloop_factory(monkeypatch: pytest.MonkeyPatch) -> Callable[[], asyncio.AbstractEventLoop]:
    monkeypatch.setenv(event_loop.ENV, "uvloop")
    factory = event_loop.loop_factory()
    assert factory is not None
    return factory


def test_a_subprocess_runs_no_fork_handler(uvloop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def main() -> tuple[int | None, bytes]:
        process = await asyncio.create_subprocess_exec(
            "cat", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await process.communicate(b"through the loop's pipes\n")
        return process.returncode, out

    FORKS.clear()
    assert event_loop.run(main(), uvloop_factory) == (0, b"through the loop's pipes\n")
    assert FORKS == []


def test_exit_statuses_a_shell_and_a_missing_program(
    uvloop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def main() -> tuple[int, int, int]:
        exits = await asyncio.create_subprocess_exec("sh", "-c", "exit 3")
        shell = await asyncio.create_subprocess_shell("exit 4")
        sleeper = await asyncio.create_subprocess_exec("sleep", "60")
        sleeper.kill()
        with pytest.raises(FileNotFoundError):
            await asyncio.create_subprocess_exec("/nonexistent/toolmesh-program")
        return await exits.wait(), await shell.wait(), await sleeper.wait()

    FORKS.clear()
    assert event_loop.run(main(), uvloop_factory) == (3, 4, -signal.SIGKILL)
    assert FORKS == []


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


def test_subprocesses_beside_busy_grpc_channels(
    uvloop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    spawns = 300

    async def main() -> tuple[list[int | None], int]:
        server = grpc.aio.server()
        echo: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(_echo)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {"Echo": echo}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(4)]
        calls = 0
        stop = asyncio.Event()

        async def caller(channel: grpc.aio.Channel) -> None:
            nonlocal calls
            method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/t.Echo/Echo")
            while not stop.is_set():
                await method(b"x" * 100, timeout=10)
                calls += 1

        callers = [asyncio.create_task(caller(channel)) for channel in channels for _ in range(2)]
        returncodes: list[int | None] = []
        try:
            for _ in range(spawns):
                process = await asyncio.create_subprocess_exec(
                    TRUE, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
                )
                await asyncio.wait_for(process.communicate(), 10)
                returncodes.append(process.returncode)
        finally:
            stop.set()
            await asyncio.gather(*callers, return_exceptions=True)
            for channel in channels:
                await channel.close()
            await server.stop(None)
        return returncodes, calls

    returncodes, calls = event_loop.run(main(), uvloop_factory)
    assert returncodes == [0] * spawns
    assert calls > 0
