"""The state store's cost on a tool call: the embedded memory against a shared Redis, in one run.

The same system (registry, bridge, invocation and a host, each its own
process) measured twice: keeping its state in memory, then in the Redis at
TOOLMESH_BENCH_REDIS (default redis://127.0.0.1:6379/0) under a key prefix of
its own, removed afterwards. The Redis server's CPU counts in the CPU per call
when it runs on this machine.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

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


def ratios(memory: dict[str, Any], redis: dict[str, Any]) -> dict[str, float]:
    """Redis over memory: p50 and p99 latency, calls/s at the concurrency, CPU per call under load."""
    return {
        "p50": redis["latency"]["p50_ms"] / memory["latency"]["p50_ms"],
        "p99": redis["latency"]["p99_ms"] / memory["latency"]["p99_ms"],
        "calls_per_s": redis["throughput"]["calls_per_s"] / memory["throughput"]["calls_per_s"],
        "cpu_per_call": redis["throughput"]["cpu_ms_per_call"]["total"]
        / memory["throughput"]["cpu_ms_per_call"]["total"],
    }
