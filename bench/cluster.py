"""Sessions sharded over a Redis Cluster against one Redis, in one run (issue 24's targets).

Three `toolmesh` systems side by side, called with the same unary no-op calls
in alternating turns (bench/store.py's `compare`): `redis`, state in the Redis
at TOOLMESH_BENCH_REDIS under a key prefix of its own; `cluster`, state in a
local Redis Cluster of three primaries and three replicas (tests/support's
LocalCluster, on free ports, stopped after) with durable claims off; and
`cluster-durable`, the same cluster with durable claims on (its default: each
claim and finish waits for a replica). CPU per call counts every Redis process
on this machine (the one Redis, or all six nodes).

Then how evenly sessions spread: 1,000 sessions each make the keys of one call
(their tool list, a claim and its finish) and each primary's share of the keys
is compared with an even third.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from bench import measure, stack, store
from redis_testing import LocalCluster
from toolmesh.client import InvocationClient
from toolmesh.store import slots
from toolmesh.store.backends import open_stores

# Issue 24's targets.
MAX_P50_CLUSTER_VS_REDIS = 1.2
MAX_KEYS_OFF_EVEN = 0.15
MAX_P50_DURABLE_VS_CLUSTER = 1.3
SESSIONS = 1000


def caller(client: InvocationClient) -> measure.Call:
    counter = itertools.count()

    async def call() -> None:
        result = await client.invoke(
            stack.SESSION, "noop", {"n": next(counter)}, turn_id="turn-1", timeout=60
        )
        if result.outcome is None or result.outcome.result_json != '{"ok":true}':
            raise RuntimeError(f"toolmesh answered {result.to_json()}")

    return call


def pids_of(system: stack.Toolmesh) -> dict[str, int]:
    """The processes whose CPU counts: the system's, and this one (the caller)."""
    return {proc.name: proc.pid for proc in system.services.values()} | {"caller": os.getpid()}


async def spread(cluster: LocalCluster, sessions: int) -> dict[str, Any]:
    """Each primary's share of the keys that `sessions` sessions' calls make, against an even share."""
    prefix = store.new_prefix()
    stores = open_stores(cluster.url + "?durable=off", prefix)
    try:
        for index in range(sessions):
            session = f"bench-spread-{index}"
            tool_request_id = slots.tool_request_id(session, "0")
            await stores.store.put(f"registry:tools:{session}", b"[]")
            await stores.ledger.claim(tool_request_id, b"r", f"{session}:t:d", 60)
            await stores.ledger.finish(tool_request_id, b"r", f"{session}:t:d", 60, 60)
    finally:
        await stores.close()
    keys: dict[str, int] = {}
    for port in cluster.primary_ports():
        node = Redis(port=port)
        try:
            keys[str(port)] = len([key async for key in node.scan_iter(match=f"{prefix}*", count=1000)])
        finally:
            await node.aclose()
    even = sum(keys.values()) / len(keys)
    off = {port: count / even - 1 for port, count in keys.items()}
    return {
        "sessions": sessions,
        "keys_per_primary": keys,
        "off_even": off,
        "max_off_even": max(map(abs, off.values())),
    }


async def measure_cluster(
    *, calls: int, warmup: int, concurrency: int, seconds: float, warmup_s: float, sessions: int = SESSIONS
) -> dict[str, Any]:
    prefix = store.new_prefix()
    redis_pid = await store.server_pid()
    with tempfile.TemporaryDirectory() as directory:
        cluster = LocalCluster(Path(directory))
        await asyncio.to_thread(cluster.start)
        started: list[stack.Toolmesh] = []
        clients: list[InvocationClient] = []
        try:
            urls = {
                "redis": (store.REDIS_URL, prefix),
                "cluster": (cluster.url + "?durable=off", "toolmesh:"),
                "cluster-durable": (cluster.url, "durable:"),
            }
            systems: dict[str, tuple[measure.Call, dict[str, int]]] = {}
            nodes = {f"redis-node{n}": process.pid for n, process in enumerate(cluster.processes)}
            for name, (url, key_prefix) in urls.items():
                system = await stack.start_toolmesh(
                    env={"TOOLMESH_STORE": url, "TOOLMESH_STORE_PREFIX": key_prefix}
                )
                started.append(system)
                client = InvocationClient(system.invocation.target)
                clients.append(client)
                pids = pids_of(system)
                if name == "redis":
                    if redis_pid is not None:
                        pids["redis"] = redis_pid
                else:
                    pids |= nodes
                systems[name] = (caller(client), pids)
            measured = await store.compare(
                systems,
                calls=calls,
                warmup=warmup,
                concurrency=concurrency,
                seconds=seconds,
                warmup_s=warmup_s,
            )
            spread_of = await spread(cluster, sessions)
        finally:
            for client in clients:
                await client.close()
            for system in started:
                await system.stop()
            cluster.stop()
            await store.delete_prefixed(prefix)

    def p50(name: str) -> float:
        value: float = measured[name]["latency"]["p50_ms"]
        return value

    return measured | {
        "redis_url": store.REDIS_URL,
        "redis_cpu_counted": redis_pid is not None,
        "rounds": store.ROUNDS,
        "cluster/redis": store.ratios(measured["redis"], measured["cluster"]),
        "durable/cluster": store.ratios(measured["cluster"], measured["cluster-durable"]),
        "durable_ms_per_call": p50("cluster-durable") - p50("cluster"),
        "spread": spread_of,
    }


def targets(measured: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 24's targets, each with its value and whether it was met."""
    cluster_p50 = measured["cluster/redis"]["p50"]
    durable_p50 = measured["durable/cluster"]["p50"]
    off_even = measured["spread"]["max_off_even"]
    return {
        f"cluster: p50 <= {MAX_P50_CLUSTER_VS_REDIS}x one Redis (issue 24)": {
            "value": cluster_p50,
            "met": cluster_p50 <= MAX_P50_CLUSTER_VS_REDIS,
        },
        f"cluster: keys per primary within ±{MAX_KEYS_OFF_EVEN:.0%} (issue 24)": {
            "value": off_even,
            "met": off_even <= MAX_KEYS_OFF_EVEN,
        },
        f"cluster: durable claims p50 <= {MAX_P50_DURABLE_VS_CLUSTER}x (issue 24)": {
            "value": durable_p50,
            "met": durable_p50 <= MAX_P50_DURABLE_VS_CLUSTER,
        },
    }


def lines(measured: dict[str, Any], figures_of: Any) -> list[str]:
    """The section's part of the printed table."""
    out = [
        "",
        f"Redis Cluster: unary no-op calls to three systems, state in one Redis ({measured['redis_url']}),"
        " a local cluster of 3 primaries + 3 replicas, the same with durable claims;"
        f" {measured['rounds']} alternating turns",
        f"  {'store':<30} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} {'CPU ms/call':>12} {'under load':>11}",
    ]
    for label in ("redis", "cluster", "cluster-durable"):
        figures = figures_of(measured[label])
        sequential = measured[label]["latency"]["cpu_ms_per_call"]["total"]
        loaded = measured[label]["throughput"]["cpu_ms_per_call"]["total"]
        out.append(
            f"  {label:<30} {figures['p50_ms']:>8.2f} {figures['p99_ms']:>8.2f}"
            f" {figures['calls_per_s']:>9.0f} {sequential:>12.2f} {loaded:>11.2f}"
        )
    for label in ("cluster/redis", "durable/cluster"):
        ratio = measured[label]
        out.append(
            f"  {label:<30} {ratio['p50']:>7.2f}x {ratio['p99']:>7.2f}x {ratio['calls_per_s']:>8.2f}x"
            f" {'':>12} {ratio['cpu_per_call']:>10.2f}x"
        )
    spread_of = measured["spread"]
    shares = ", ".join(
        f"{count} ({spread_of['off_even'][port]:+.1%})"
        for port, count in spread_of["keys_per_primary"].items()
    )
    out.append(f"  keys of {spread_of['sessions']} sessions per primary: {shares}")
    out.append(
        f"  durable claims add {measured['durable_ms_per_call']:.3f} ms per call at p50;"
        " CPU counts every process of the system, the caller and every Redis process"
    )
    return out
