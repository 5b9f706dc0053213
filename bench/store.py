"""The state store's cost on a tool call: the embedded memory against a shared Redis, in one run.

The same system (registry, bridge, invocation and a host, each its own
process) measured twice: keeping its state in memory, then in the Redis at
TOOLMESH_BENCH_REDIS (default redis://127.0.0.1:6379/0) under a key prefix of
its own, removed afterwards. The Redis server's CPU counts in the CPU per call
when it runs on this machine.
"""

from __future__ import annotations

import collections
import os
import statistics
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from bench import measure, procs

REDIS_URL = os.environ.get("TOOLMESH_BENCH_REDIS", "redis://127.0.0.1:6379/0")
# The targets of issue 10, Redis against memory.
MAX_P50_VS_MEMORY = 1.25
MIN_THROUGHPUT_VS_MEMORY = 0.8


def new_prefix() -> str:
    return f"bench:{uuid.uuid4().hex}:"


def env_for(prefix: str) -> dict[str, str]:
    """What makes each service keep its state in Redis, under `prefix`."""
    return {"TOOLMESH_STORE": REDIS_URL, "TOOLMESH_STORE_PREFIX": prefix}


async def server_pid() -> int | None:
    """The Redis server's process id, when it runs on this machine (so its CPU can be counted)."""
    client = Redis.from_url(REDIS_URL)
    try:
        pid = int((await client.info("server"))["process_id"])
    finally:
        await client.aclose()
    return pid if runs_here(pid) else None


def runs_here(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def delete_prefixed(prefix: str) -> int:
    client = Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.unlink(*keys[start : start + 1000])
    finally:
        await client.aclose()
    return len(keys)


# Each system is measured in this many turns, alternating, so that a change of load on the
# (shared) machine falls on both alike rather than on whichever ran at the time.
ROUNDS = 4


async def compare(
    systems: dict[str, tuple[measure.Call, dict[str, int]]],
    *,
    calls: int,
    warmup: int,
    concurrency: int,
    seconds: float,
    warmup_s: float,
) -> dict[str, dict[str, Any]]:
    """Latency and throughput of each system (a call, and the pids whose CPU counts), in turns."""

    def cpu_of(pids: dict[str, int]) -> Callable[[], dict[str, float]]:
        return lambda: {name: procs.cpu_seconds(pid) for name, pid in pids.items()}

    samples: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, collections.Counter[str]] = {name: collections.Counter() for name in systems}
    windows: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for call, _ in systems.values():
        await measure.sequential_samples(call, warmup)
    for _ in range(ROUNDS):
        for name, (call, pids) in systems.items():
            before = cpu_of(pids)()
            samples[name] += await measure.sequential_samples(call, max(1, calls // ROUNDS))
            after = cpu_of(pids)()
            cpu[name].update({process: after[process] - before[process] for process in pids})
    for _ in range(ROUNDS // 2):
        for name, (call, pids) in systems.items():
            window = await measure.throughput(
                call, concurrency, seconds / (ROUNDS // 2), warmup_s, cpu_of(pids)
            )
            windows[name].append(window)
    results = {}
    for name in systems:
        latency = measure.summary(samples[name])
        per_call = {process: spent * 1000 / len(samples[name]) for process, spent in cpu[name].items()}
        latency["cpu_ms_per_call"] = per_call | {"total": sum(per_call.values())}
        results[name] = {"latency": latency, "throughput": _merged(windows[name])}
    return results


def _merged(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput windows of one system as one: calls/s and CPU per call over all of them."""
    calls = sum(window["calls"] for window in windows)
    seconds = sum(window["seconds"] for window in windows)
    processes = windows[0]["cpu_ms_per_call"]
    cpu = {
        process: sum(window["cpu_ms_per_call"][process] * window["calls"] for window in windows) / calls
        for process in processes
    }
    return {
        "concurrency": windows[0]["concurrency"],
        "seconds": seconds,
        "calls": calls,
        "calls_per_s": calls / seconds,
        "cpu_ms_per_call": cpu,
        "p50_ms": statistics.median(window["p50_ms"] for window in windows),
        "p99_ms": max(window["p99_ms"] for window in windows),
    }


def ratios(memory: dict[str, Any], redis: dict[str, Any]) -> dict[str, float]:
    """Redis over memory: p50 and p99 latency, calls/s at the concurrency, CPU per call under load."""
    return {
        "p50": redis["latency"]["p50_ms"] / memory["latency"]["p50_ms"],
        "p99": redis["latency"]["p99_ms"] / memory["latency"]["p99_ms"],
        "calls_per_s": redis["throughput"]["calls_per_s"] / memory["throughput"]["calls_per_s"],
        "cpu_per_call": redis["throughput"]["cpu_ms_per_call"]["total"]
        / memory["throughput"]["cpu_ms_per_call"]["total"],
    }
