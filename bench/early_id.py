"""What InvokeTool's early id costs: the invocation's id sent as initial metadata ahead of the outcome.

Two systems in this process, identical but for that: one as served (the id
announced once a call has waited 50 ms on its invocation), one whose
InvokeTool answers without announcing it (the baseline). With the id sent at
once on every call, this measured 1.13x the baseline's CPU per no-op call
(one more HTTP/2 frame each way); held back 50 ms, a fast call sends none.
Each system has an in-process host with a no-op tool. Sequential unary calls
go to each in alternating rounds, so that a busy machine weighs on both
alike; it prints the median latency and the process's CPU time per call of
each, and their ratio.

    python -m bench.early_id [--calls N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolHost
from toolmesh.invocation import servicer as invocation_servicer
from toolmesh.invocation.messages import call_from_pb, response_to_pb

SESSION = "bench-early-id"
TOOL = ToolSpec("noop", "", '{"type":"object"}')


async def _silent_invoke(self: Any, request: Any, context: Any) -> Any:
    """InvokeTool as it was before the early id: the outcome alone."""
    result = await self._invoker.invoke(
        call_from_pb(request), request.idempotency_key, request.confirmed_tool_request_ids
    )
    return response_to_pb(result)


@contextmanager
def without_early_id() -> Iterator[None]:
    announcing = invocation_servicer.InvocationServicer.InvokeTool
    invocation_servicer.InvocationServicer.InvokeTool = _silent_invoke  # type: ignore[method-assign]
    try:
        yield
    finally:
        invocation_servicer.InvocationServicer.InvokeTool = announcing  # type: ignore[method-assign]


async def _ready(system: LocalSystem) -> ToolHost:
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(SESSION, [TOOL])
    host = ToolHost(system.bridge_target, SESSION)
    host.on_tool("noop", lambda args, ctx: {"ok": True})
    await host.start()
    return host


async def _round(client: InvocationClient, calls: int, latencies: list[float]) -> float:
    """Make `calls` sequential calls (distinct arguments: no replays); the process CPU seconds they took."""
    cpu = time.process_time()
    for index in range(calls):
        started = time.perf_counter()
        result = await client.invoke(SESSION, "noop", {"n": index, "t": started}, turn_id="t")
        latencies.append(time.perf_counter() - started)
        assert result.outcome is not None and result.outcome.ok, result
    return time.process_time() - cpu


async def main(calls: int, rounds: int) -> None:
    announcing = await start_local_system()
    with without_early_id():
        silent = await start_local_system()
    hosts = [await _ready(announcing), await _ready(silent)]
    figures: dict[str, tuple[list[float], list[float]]] = {"early id": ([], []), "baseline": ([], [])}
    async with (
        InvocationClient(announcing.invocation_target) as with_id,
        InvocationClient(silent.invocation_target) as without_id,
    ):
        await _round(with_id, 50, [])  # warm up both
        await _round(without_id, 50, [])
        for _ in range(rounds):
            for name, client in (("early id", with_id), ("baseline", without_id)):
                latencies, cpu = figures[name]
                cpu.append(await _round(client, calls, latencies) / calls)
    for host in hosts:
        await host.stop()
    for system in (announcing, silent):
        await system.stop(0.5)
    print(f"{calls} sequential unary calls x {rounds} rounds each, alternating; all in one process")
    print(f"{'':12} {'p50 ms':>8} {'CPU ms/call':>12}")
    medians = {
        name: (statistics.median(lat) * 1000, statistics.median(cpu) * 1000)
        for name, (lat, cpu) in figures.items()
    }
    for name, (p50, cpu_ms) in medians.items():
        print(f"{name:12} {p50:8.3f} {cpu_ms:12.3f}")
    (p50, cpu_ms), (base_p50, base_cpu) = medians["early id"], medians["baseline"]
    print(f"{'ratio':12} {p50 / base_p50:7.2f}x {cpu_ms / base_cpu:11.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per system (default %(default)s)")
    options = parser.parse_args()
    asyncio.run(main(options.calls, options.rounds))
