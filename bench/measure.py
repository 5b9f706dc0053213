"""The two measurements every system gets: sequential latency and throughput under concurrency."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

# One call of the system under test; raises when the answer is wrong.
Call = Callable[[], Awaitable[None]]


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, round(fraction * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


async def sequential(call: Call, calls: int, warmup: int) -> dict[str, Any]:
    """One call at a time: latency percentiles in milliseconds."""
    for _ in range(warmup):
        await call()
    return summary(await sequential_samples(call, calls))


async def sequential_samples(call: Call, calls: int) -> list[float]:
    """The latency of each of `calls` sequential calls, in milliseconds."""
    samples: list[float] = []
    clock = time.perf_counter
    for _ in range(calls):
        started = clock()
        await call()
        samples.append((clock() - started) * 1000)
    return samples


def summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "calls": len(ordered),
        "p50_ms": percentile(ordered, 0.50),
        "p90_ms": percentile(ordered, 0.90),
        "p99_ms": percentile(ordered, 0.99),
        "mean_ms": statistics.fmean(ordered),
        "max_ms": ordered[-1],
    }


async def throughput(
    call: Call,
    concurrency: int,
    seconds: float,
    warmup_s: float,
    cpu_seconds: Callable[[], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """`concurrency` calls always in flight; calls completed per second within a window of `seconds`.

    The window opens after `warmup_s`; each worker stops at its first completion after it closes.
    With `cpu_seconds` (CPU time used so far, by process), also the CPU each
    process spent per call from the window's opening until the last worker stopped.
    """
    clock = time.perf_counter
    window: list[float] = []  # [start, end] once the warmup is over
    latencies: list[float] = []
    completed_since_open = 0

    async def worker() -> None:
        nonlocal completed_since_open
        while True:
            started = clock()
            await call()
            now = clock()
            if window and now >= window[0]:
                completed_since_open += 1
                if now >= window[1]:
                    return
                latencies.append((now - started) * 1000)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    cpu_at_open: dict[str, float] = {}
    cpu_at_end: dict[str, float] = {}
    try:
        await asyncio.sleep(warmup_s)
        if cpu_seconds is not None:
            cpu_at_open = cpu_seconds()
        opened = clock()
        window.extend((opened, opened + seconds))
        await asyncio.gather(*workers)
        if cpu_seconds is not None:
            cpu_at_end = cpu_seconds()
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    latencies.sort()
    cpu = {
        name: (cpu_at_end[name] - cpu_at_open[name]) * 1000 / max(1, completed_since_open)
        for name in cpu_at_end
    }
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "calls": len(latencies),
        "calls_per_s": len(latencies) / seconds,
        **({"cpu_ms_per_call": cpu | {"total": sum(cpu.values())}} if cpu else {}),
        "p50_ms": percentile(latencies, 0.50),
        "p99_ms": percentile(latencies, 0.99),
    }
