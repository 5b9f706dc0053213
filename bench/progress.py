"""What progress costs: a call that asks for it (RunTool) against the plain call (InvokeTool), and a
handler that floods reports against one that reports nothing.

One system in this process with an in-process host, called with sequential
calls in alternating rounds, so that a busy machine weighs on every kind
alike. Prints the median latency and the process's CPU time per call of each
kind, their ratios to the plain call, and how many of the flood's reports
reached the caller (the bridge forwards at most one per 100 ms).

- `plain`: `invoke` without callbacks, a unary InvokeTool to a no-op tool.
- `run`: the same no-op tool with `on_progress`, a RunTool stream.
- `flood`: a RunTool to a tool that makes FLOOD reports, then answers.

    python -m bench.progress [--calls N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from toolmesh.assembly.system import start_local_system
from toolmesh.client import InvocationClient, RegistryClient, ToolProgress
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost

SESSION = "bench-progress"
FLOOD = 20
TOOLS = [ToolSpec("noop", "", '{"type":"object"}'), ToolSpec("flood", "", '{"type":"object"}')]


async def _flood(args: dict[str, Any], ctx: ToolContext) -> dict[str, bool]:
    for step in range(1, FLOOD + 1):
        await ctx.report_progress(step, FLOOD)
    return {"ok": True}


async def _round(
    client: InvocationClient, kind: str, calls: int, latencies: list[float], heard: list[int]
) -> float:
    """Make `calls` sequential calls of `kind` (distinct arguments: no replays); the CPU seconds they took."""
    tool = "flood" if kind == "flood" else "noop"
    cpu = time.process_time()
    for index in range(calls):
        reports: list[ToolProgress] = []
        on_progress = None if kind == "plain" else reports.append
        started = time.perf_counter()
        result = await client.invoke(
            SESSION, tool, {"n": index, "t": started}, turn_id="t", on_progress=on_progress
        )
        latencies.append(time.perf_counter() - started)
        assert result.outcome is not None and result.outcome.ok, result
        heard.append(len(reports))
    return time.process_time() - cpu


async def main(calls: int, rounds: int) -> None:
    system = await start_local_system()
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    host = ToolHost(system.bridge_target, SESSION)
    host.on_tool("noop", lambda args, ctx: {"ok": True})
    host.on_tool("flood", _flood)
    await host.start()
    kinds = ("plain", "run", "flood")
    figures: dict[str, tuple[list[float], list[float], list[int]]] = {kind: ([], [], []) for kind in kinds}
    async with InvocationClient(system.invocation_target) as client:
        for kind in kinds:  # warm up
            await _round(client, kind, 20, [], [])
        for _ in range(rounds):
            for kind in kinds:
                latencies, cpu, heard = figures[kind]
                cpu.append(await _round(client, kind, calls, latencies, heard) / calls)
    await host.stop()
    await system.stop(0.5)
    print(f"{calls} sequential calls x {rounds} rounds of each kind, alternating; all in one process")
    header = ("p50 ms", "CPU ms/call", "x plain p50", "x plain CPU", "reports heard")
    print(f"{'':8} {header[0]:>8} {header[1]:>12} {header[2]:>12} {header[3]:>12} {header[4]:>14}")
    base_p50 = statistics.median(figures["plain"][0])
    base_cpu = statistics.median(figures["plain"][1])
    for kind, (latencies, cpu, heard) in figures.items():
        p50, cpu_call = statistics.median(latencies), statistics.median(cpu)
        print(
            f"{kind:8} {p50 * 1000:8.3f} {cpu_call * 1000:12.3f} {p50 / base_p50:11.2f}x "
            f"{cpu_call / base_cpu:11.2f}x {statistics.mean(heard):14.2f}"
        )
    print(f"(the flood handler makes {FLOOD} reports per call)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per kind (default %(default)s)")
    options = parser.parse_args()
    asyncio.run(main(options.calls, options.rounds))
