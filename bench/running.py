"""The systems a bench measures, each with its ways of calling: the floor chain and toolmesh.

Imported by an A/B side (`python -m bench.ab side`) under a baseline commit's code first on
PYTHONPATH, so it imports no more of toolmesh than a call needs (bench.security's types only
when type-checking: an older tree has no `toolmesh.auth.service`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from bench import floor, measure, procs, stack
from toolmesh.client import InvocationClient

if TYPE_CHECKING:
    from bench.security import Secured


def pids_of(processes: list[procs.Proc]) -> dict[str, int]:
    return {proc.name: proc.pid for proc in processes} | {"caller": os.getpid()}


@dataclass
class Running:
    """A system under test and a way to call it for each way of calling."""

    calls: dict[str, measure.Call]
    pids: dict[str, int]


@contextlib.asynccontextmanager
async def running_floor(with_lookup: bool = False) -> AsyncIterator[Running]:
    """The floor chain and its one way of calling, `floor` (unary, distinct bytes each call)."""
    system = await stack.start_floor(with_lookup)
    channel = grpc.aio.insecure_channel(system.target)
    invoke: floor.BytesCall = channel.unary_unary(floor.INVOKE)
    counter = itertools.count()

    async def call() -> None:
        if await invoke(b'{"n":%d}' % next(counter), timeout=60) != floor.RESULT:
            raise RuntimeError("the floor answered something else")

    try:
        yield Running({"floor": call}, pids_of(system.procs))
    finally:
        await channel.close()
        await system.stop()


@contextlib.asynccontextmanager
async def running_toolmesh(
    env: dict[str, str] | None = None, secured: Secured | None = None
) -> AsyncIterator[Running]:
    """The system's callers: `toolmesh` (unary InvokeTool calls to an async no-op),
    `toolmesh-stream` (the same calls on one InvokeTools stream), `toolmesh-sync` (unary calls to
    a plain def handler). With `secured`, every hop uses TLS and every call carries a token."""
    access: dict[str, Any] = {}
    if secured is not None:
        env = {**(env or {}), **secured.env}
        access = {"credentials": secured.credentials, "token": secured.call_token}
    system = await stack.start_toolmesh(
        host_env=secured.host_env if secured else None,
        env=env,
        credentials=access.get("credentials"),
        admin_token=secured.admin_token if secured else None,
    )
    unary = InvocationClient(system.invocation.target, **access)
    streamed = InvocationClient(system.invocation.target, multiplex=True, **access)
    # Distinct arguments: identical calls in flight together would join one invocation.
    counter = itertools.count()

    def caller(client: InvocationClient, tool: str) -> measure.Call:
        async def call() -> None:
            result = await client.invoke(
                stack.SESSION, tool, {"n": next(counter)}, turn_id="turn-1", timeout=60
            )
            if result.outcome is None or result.outcome.result_json != '{"ok":true}':
                raise RuntimeError(f"toolmesh answered {result.to_json()}")

        return call

    try:
        yield Running(
            {
                "toolmesh": caller(unary, "noop"),
                "toolmesh-stream": caller(streamed, "noop"),
                "toolmesh-sync": caller(unary, "noop_sync"),
            },
            pids_of(list(system.services.values())),
        )
    finally:
        await unary.close()
        await streamed.close()
        await system.stop()
