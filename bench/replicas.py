"""Replicas on one Redis: what a route costs, and what a second replica of each service gives.

Three systems, each its own processes and key prefix, all keeping state in the
Redis at TOOLMESH_BENCH_REDIS, measured in turns (bench.store.compare):
- "1+1": one invocation replica and one bridge replica, the host on it;
- "routed": one invocation replica, two bridge replicas, the host on the one the
  invocation replica does not default to: every call follows the session's route;
- "2+2": two of each, the host on the second bridge; the calls alternate between
  the two invocation replicas.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import measure, procs, stack, store
from bench.host import ERROR, READY
from toolmesh.client import InvocationClient, RegistryClient

LISTEN = ["--listen", "127.0.0.1:0", "--internal-listen", "127.0.0.1:0"]


@dataclass
class Replicated:
    processes: list[procs.Proc]
    invocations: list[procs.Proc]

    async def stop(self) -> None:
        await procs.stop_all(self.processes)


async def start(prefix: str, invocations: int, bridges: int) -> Replicated:
    """A registry, `bridges` bridge and `invocations` invocation replicas, and a host on the last
    bridge; every invocation replica defaults to the first bridge."""
    env = store.env_for(prefix)
    started: list[procs.Proc] = []
    try:
        registry = await procs.start("registry", ["-m", "toolmesh.registry", *LISTEN], env=env)
        started.append(registry)
        registry_internal = await registry.internal_target()
        bridge_procs = []
        for index in range(bridges):
            args = ["-m", "toolmesh.bridge", *LISTEN, "--web-listen", "off", "--registry", registry_internal]
            bridge_procs.append(await procs.start(f"bridge{index or ''}", args, env=env))
        started += bridge_procs
        default_bridge = await bridge_procs[0].internal_target()
        invocation_procs = []
        for index in range(invocations):
            args = ["-m", "toolmesh.invocation", "--listen", "127.0.0.1:0"]
            args += ["--registry", registry_internal, "--bridge", default_bridge]
            invocation_procs.append(await procs.start(f"invocation{index or ''}", args, env=env))
        started += invocation_procs
        host_args = ["-m", "bench.host", "--bridge", bridge_procs[-1].target, "--session", stack.SESSION]
        host = await procs.start("host", host_args, env=env, port_line=False, counted_prefix=ERROR)
        started.append(host)
        await host.wait_for(READY)
        async with RegistryClient(registry.target) as client:
            await client.put_tools(stack.SESSION, stack.TOOLS)
    except BaseException:
        await procs.stop_all(started)
        raise
    return Replicated(started, invocation_procs)


SYSTEMS = {"1+1": (1, 1), "routed": (1, 2), "2+2": (2, 2)}


async def measure_replicas(
    *, calls: int, warmup: int, concurrency: int, seconds: float, warmup_s: float, cpu_of_redis: int | None
) -> dict[str, Any]:
    prefixes = {name: store.new_prefix() for name in SYSTEMS}
    systems: dict[str, Replicated] = {}
    clients: list[InvocationClient] = []
    try:
        for name, (invocations, bridges) in SYSTEMS.items():
            systems[name] = await start(prefixes[name], invocations, bridges)
        counter = itertools.count()

        def caller(system: Replicated) -> measure.Call:
            mine = [InvocationClient(invocation.target) for invocation in system.invocations]
            clients.extend(mine)
            turn = itertools.cycle(mine)

            async def call() -> None:
                result = await next(turn).invoke(
                    stack.SESSION, "noop", {"n": next(counter)}, turn_id="turn-1", timeout=60
                )
                if result.outcome is None or result.outcome.result_json != '{"ok":true}':
                    raise RuntimeError(f"toolmesh answered {result.to_json()}")

            return call

        def pids(system: Replicated) -> dict[str, int]:
            found = {proc.name: proc.pid for proc in system.processes} | {"caller": os.getpid()}
            return found | ({"redis": cpu_of_redis} if cpu_of_redis is not None else {})

        measured = await store.compare(
            {name: (caller(system), pids(system)) for name, system in systems.items()},
            calls=calls,
            warmup=warmup,
            concurrency=concurrency,
            seconds=seconds,
            warmup_s=warmup_s,
        )
    finally:
        for client in clients:
            await client.close()
        for system in systems.values():
            await system.stop()
        for prefix in prefixes.values():
            await store.delete_prefixed(prefix)
    return measured | {"redis_cpu_counted": cpu_of_redis is not None, "rounds": store.ROUNDS}


def lines(replicated: dict[str, Any], figures: Callable[[dict[str, Any]], dict[str, float]]) -> list[str]:
    """The report's table of the replicas section."""
    out = [
        "",
        "Replicas: unary no-op calls on one Redis; 1+1 one invocation and one bridge replica; routed: the"
        " host on the bridge replica the invocation replica does not default to; 2+2 two of each",
        f"  {'system':<30} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} {'CPU ms/call':>12} {'under load':>11}",
    ]
    for label in SYSTEMS:
        shown = figures(replicated[label])
        sequential = replicated[label]["latency"]["cpu_ms_per_call"]["total"]
        loaded = replicated[label]["throughput"]["cpu_ms_per_call"]["total"]
        out.append(
            f"  {label:<30} {shown['p50_ms']:>8.2f} {shown['p99_ms']:>8.2f}"
            f" {shown['calls_per_s']:>9.0f} {sequential:>12.2f} {loaded:>11.2f}"
        )
    seen = "counts" if replicated["redis_cpu_counted"] else "is not seen (not on this machine)"
    out.append(f"  (CPU: every process of the system and the caller; the Redis server's {seen})")
    return out
