"""Memory for many distinct session ids: the services' RSS before and after touching them.

The three services as `python -m toolmesh.*` processes (state in memory). A
warm-up touches 1,000 session ids; then each of N more (default 50,000) is
touched once: a WatchTools stream opened and closed and a ListTools on the
registry, a call of an unknown tool on one InvokeTools stream (the invocation
service watches the session's tools, at most 1,024 sessions at a time), and a
host session opened and closed on the bridge. It prints each process's VmRSS
after the warm-up and after the run, and its peak (VmHWM).

    python -m bench.session_memory [--sessions N]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from bench import procs
from toolmesh.v1 import (
    bridge_pb2,
    bridge_pb2_grpc,
    invocation_pb2,
    invocation_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)

PARALLEL = 64
PER_MESSAGE = 100


async def each(first: int, count: int, touch: Callable[[int], Awaitable[None]]) -> None:
    indexes = iter(range(first, first + count))

    async def worker() -> None:
        for index in indexes:
            await touch(index)

    await asyncio.gather(*(worker() for _ in range(PARALLEL)))


class Toucher:
    """Touches session ids on the three services' public ports."""

    def __init__(self, registry: str, invocation: str, bridge: str) -> None:
        self._channels = [grpc.aio.insecure_channel(target) for target in (registry, invocation, bridge)]
        self._registry = registry_pb2_grpc.RegistryServiceStub(self._channels[0])
        self._invocation = invocation_pb2_grpc.InvocationServiceStub(self._channels[1])
        self._bridge = bridge_pb2_grpc.BridgeServiceStub(self._channels[2])

    async def touch(self, first: int, count: int) -> None:
        await each(first, count, self._watch_list_and_host)
        await self._call_unknown_tools(first, count)

    async def _watch_list_and_host(self, index: int) -> None:
        session_id = f"bench-session-{index}"
        watch = self._registry.WatchTools(registry_pb2.WatchToolsRequest(session_id=session_id), timeout=30)
        await anext(aiter(watch))
        watch.cancel()
        await self._registry.ListTools(registry_pb2.ListToolsRequest(session_id=session_id), timeout=30)
        host = self._bridge.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(session_id=session_id, host_name="bench"), timeout=30
        )
        await anext(aiter(host))
        host.cancel()

    async def _call_unknown_tools(self, first: int, count: int) -> None:
        stream = self._invocation.InvokeTools(timeout=3600)
        answers = aiter(stream)
        for start in range(first, first + count, PER_MESSAGE):
            size = min(PER_MESSAGE, first + count - start)
            calls = [
                invocation_pb2.StreamedToolCall(
                    call_id=index + 1,
                    request=invocation_pb2.InvokeToolRequest(
                        session_id=f"bench-session-{index}", turn_id="t", tool_name="missing"
                    ),
                )
                for index in range(start, start + size)
            ]
            await stream.write(invocation_pb2.InvokeToolsRequest(calls=calls))
            answered = 0
            while answered < size:
                answered += len((await anext(answers)).results)
        await stream.done_writing()
        stream.cancel()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


async def run(sessions: int) -> None:
    listen = ["--listen", "127.0.0.1:0", "--internal-listen", "127.0.0.1:0"]
    registry, bridge = await asyncio.gather(
        procs.start("registry", ["-m", "toolmesh.registry", *listen]),
        procs.start("bridge", ["-m", "toolmesh.bridge", *listen, "--web-listen", "127.0.0.1:0"]),
    )
    dependencies = [
        "--registry",
        await registry.internal_target(),
        "--bridge",
        await bridge.internal_target(),
    ]
    invocation = await procs.start(
        "invocation", ["-m", "toolmesh.invocation", "--listen", "127.0.0.1:0", *dependencies]
    )
    running = [registry, bridge, invocation]
    toucher = Toucher(registry.target, invocation.target, bridge.target)
    try:
        warmup = 1_000
        await toucher.touch(0, warmup)
        before = {proc.name: procs.memory_kb(proc.pid)["VmRSS"] for proc in running}
        started = time.perf_counter()
        await toucher.touch(warmup, sessions)
        elapsed = time.perf_counter() - started
        after = {proc.name: procs.memory_kb(proc.pid) for proc in running}
    finally:
        await toucher.close()
        await procs.stop_all(running)
    print(f"{sessions} distinct session ids after {warmup} for warm-up, in {elapsed:.0f} s")
    print(f"{'process':<12}{'RSS warm MiB':>14}{'RSS after MiB':>15}{'growth MiB':>12}{'peak MiB':>10}")
    for name, warm in before.items():
        now = after[name]["VmRSS"]
        print(
            f"{name:<12}{warm / 1024:>14.1f}{now / 1024:>15.1f}{(now - warm) / 1024:>12.1f}"
            f"{after[name]['VmHWM'] / 1024:>10.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.session_memory")
    parser.add_argument(
        "--sessions", type=int, default=50_000, help="distinct session ids (default %(default)s)"
    )
    args = parser.parse_args()
    asyncio.run(run(args.sessions))


if __name__ == "__main__":
    main()
