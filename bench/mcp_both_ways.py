"""MCP both ways: what toolmesh costs in front of MCP tools, in one run.

1. Gateway: the MCP SDK's client calls the no-op tool through `toolmesh mcp`
   (stdio, and streamable HTTP), which calls it through the invocation
   service, the bridge and a `bench.host` process; against the same client
   calling the MCP SDK's own server (`bench.mcp_peer`) directly.
2. Host: an MCP server (`bench.mcp_peer stdio`) behind `toolmesh host --mcp`,
   called with `InvocationClient` through the invocation service and bridge;
   against the MCP SDK's client calling that server directly.

Each way: p50/p99 of sequential calls (distinct arguments, so none joins or
replays) after a warm-up, and calls/s with CONCURRENCY calls in flight. The
ways are measured in alternating rounds, so that the machine's load weighs
on each alike; the figures are the medians of the rounds.

    python -m bench.mcp_both_ways [--calls N] [--seconds S] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

from bench import mcp_peer, procs, stack
from bench.measure import sequential, throughput
from bench.procs import REPO, Proc
from toolmesh.client import InvocationClient, RegistryClient

HOSTED_SESSION = "bench-mcp-hosted"
CONCURRENCY = 16
Call = Callable[[], Awaitable[None]]


def toolmesh_env(system: stack.Toolmesh) -> dict[str, str]:
    return {
        "TOOLMESH_REGISTRY_ADDR": system.registry.target,
        "TOOLMESH_INVOCATION_ADDR": system.invocation.target,
        "TOOLMESH_BRIDGE_ADDR": system.bridge.target,
    }


@asynccontextmanager
async def gateway_stdio(system: stack.Toolmesh) -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "toolmesh.cli.main", "mcp", "--session-id", stack.SESSION],
        env=toolmesh_env(system) | {"PATH": ""},
        cwd=REPO,
    )
    async with Client(params) as client:
        yield client


async def start_gateway_http(system: stack.Toolmesh) -> tuple[Proc, str]:
    gateway = await procs.start(
        "mcp-gateway",
        ["-m", "toolmesh.cli.main", "mcp", "--http", "--listen", "127.0.0.1:0"],
        env=toolmesh_env(system),
        port_line=False,
    )
    match = await gateway.wait_for(r"serving (http://127\.0\.0\.1:\d+)/sessions/")
    return gateway, f"{match.group(1)}/sessions/{stack.SESSION}/mcp"


async def start_mcp_host(system: stack.Toolmesh) -> Proc:
    server = f"{sys.executable} -m bench.mcp_peer stdio"
    host = await procs.start(
        "mcp-host",
        ["-m", "toolmesh.cli.main", "host", "--session-id", HOSTED_SESSION, "--mcp", server],
        env=toolmesh_env(system),
        port_line=False,
    )
    await host.wait_for("toolmesh host: ready")
    # bench.stack's bridge is not given the registry (the benchmark puts its tools itself), so
    # it keeps the host's declaration without putting it: put the same definition here.
    async with RegistryClient(system.registry.target) as registry:
        await registry.put_tools(HOSTED_SESSION, [stack.TOOLS[0]])
    return host


def mcp_call(client: Client) -> Call:
    counter = itertools.count()

    async def call() -> None:
        await mcp_peer.call_noop(client, next(counter))

    return call


def toolmesh_call(calls: InvocationClient) -> Call:
    counter = itertools.count()

    async def call() -> None:
        result = await calls.invoke(HOSTED_SESSION, "noop", {"n": next(counter)}, turn_id="bench")
        if result.outcome is None or result.outcome.result_json != '{"ok":true}':
            raise RuntimeError(f"toolmesh noop answered {result!r}")

    return call


async def measure(call: Call, calls: int, seconds: float) -> dict[str, float]:
    latency = await sequential(call, calls, warmup=max(20, calls // 10))
    load = await throughput(call, CONCURRENCY, seconds, warmup_s=0.5)
    return {"p50_ms": latency["p50_ms"], "p99_ms": latency["p99_ms"], "calls_per_s": load["calls_per_s"]}


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


PAIRS = {
    "gateway (stdio)": ("via toolmesh mcp", "MCP server direct"),
    "gateway (HTTP)": ("via toolmesh mcp --http", "MCP server direct (HTTP)"),
    "host --mcp": ("via toolmesh host --mcp", "MCP server direct"),
}


async def run(calls: int, seconds: float, rounds: int) -> dict[str, Any]:
    system = await stack.start_toolmesh()
    peer_http = await procs.start("mcp-http", ["-m", "bench.mcp_peer", "http"])
    gateway, gateway_url = await start_gateway_http(system)
    host = await start_mcp_host(system)
    results: dict[str, list[dict[str, float]]] = {}
    try:
        async with AsyncExitStack() as clients:
            ways: dict[str, Call] = {
                "via toolmesh mcp": mcp_call(await clients.enter_async_context(gateway_stdio(system))),
                "MCP server direct": mcp_call(await clients.enter_async_context(mcp_peer.connect_stdio())),
                "via toolmesh mcp --http": mcp_call(await clients.enter_async_context(Client(gateway_url))),
                "MCP server direct (HTTP)": mcp_call(
                    await clients.enter_async_context(mcp_peer.connect_http(peer_http.port))
                ),
                "via toolmesh host --mcp": toolmesh_call(
                    await clients.enter_async_context(InvocationClient(system.invocation.target))
                ),
            }
            for _ in range(rounds):
                for label, call in ways.items():
                    results.setdefault(label, []).append(await measure(call, calls, seconds))
    finally:
        await procs.stop_all([peer_http, gateway, host])
        await system.stop()
    figures = {label: median_of(measured) for label, measured in results.items()}
    ratios = {
        pair: {
            "p50": figures[through]["p50_ms"] / figures[direct]["p50_ms"],
            "calls_per_s": figures[through]["calls_per_s"] / figures[direct]["calls_per_s"],
        }
        for pair, (through, direct) in PAIRS.items()
    }
    return {"figures": figures, "ratios": ratios, "rounds": rounds, "calls": calls, "seconds": seconds}


def table(results: dict[str, Any]) -> str:
    lines = [
        f"MCP both ways: {results['calls']} sequential calls, {results['seconds']} s at {CONCURRENCY} "
        f"in flight, median of {results['rounds']} rounds",
        f"  {'way':<28} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9}",
    ]
    for label, figures in results["figures"].items():
        p50, p99, rate = figures["p50_ms"], figures["p99_ms"], figures["calls_per_s"]
        lines.append(f"  {label:<28} {p50:>8.2f} {p99:>8.2f} {rate:>9.0f}")
    lines.append(f"  {'through toolmesh / direct':<28} {'p50':>8} {'calls/s':>18}")
    for pair, ratio in results["ratios"].items():
        lines.append(f"  {pair:<28} {ratio['p50']:>7.2f}x {ratio['calls_per_s']:>17.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mcp_both_ways")
    parser.add_argument("--calls", type=int, default=500, help="sequential calls per way and round")
    parser.add_argument("--seconds", type=float, default=3.0, help="throughput window per way and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="where the JSON goes")
    args = parser.parse_args()
    results = asyncio.run(run(args.calls, args.seconds, args.rounds))
    print(table(results))
    out: Path = args.out / f"mcp_both_ways-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"figures: {out}")


if __name__ == "__main__":
    main()
