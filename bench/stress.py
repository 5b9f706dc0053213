"""Scale (many slow calls held at once) and the join storm (many identical calls)."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from bench import floor as floor_chain
from bench import procs, stack
from toolmesh.client import CallResult, InvocationClient

# gRPC multiplexes calls on one connection; several connections spread the
# caller's side of the load.
CHANNELS = 8
# How many calls the scale test starts ahead of those its host has seen arrive.
ADMISSION_WINDOW = 500

T = TypeVar("T")


def _clients(target: str, multiplex: bool = False) -> tuple[list[grpc.aio.Channel], list[InvocationClient]]:
    options = [("grpc.max_concurrent_streams", 1 << 20)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(CHANNELS)]
    clients = [InvocationClient(target, channel=channel, multiplex=multiplex) for channel in channels]
    return channels, clients


@dataclass
class Held:
    """What holding `calls` calls at once cost each process, and how long it took."""

    seconds_to_start_all: float
    seconds: float
    memory: dict[str, dict[str, float]]


async def _hold_all(
    services: dict[str, procs.Proc],
    calls: int,
    arrivals: Path,
    call: Callable[[int], Coroutine[Any, Any, T]],
) -> tuple[Held, list[T]]:
    """Start `calls` calls, at most ADMISSION_WINDOW ahead of those the host has seen arrive.

    A burst of thousands at once overflows gRPC's queue of calls the server has not
    yet picked up (grpc.server.max_pending_requests), which cancels them. Memory is
    sampled every 0.1 s and read as the peak (VmHWM) against the RSS before.
    """
    baseline = {name: procs.memory_kb(p.pid)["VmRSS"] for name, p in services.items()}
    sampled = dict.fromkeys(services, 0)
    sampling = True

    async def sample() -> None:
        while sampling:
            for name, proc in services.items():
                sampled[name] = max(sampled[name], procs.memory_kb(proc.pid)["VmRSS"])
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    started = time.perf_counter()
    tasks: list[asyncio.Task[T]] = []
    for i in range(calls):
        # The count lives in another process's file: polling is the way to wait for it.
        while i - _arrived(arrivals) >= ADMISSION_WINDOW:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(call(i)))
    admitted = time.perf_counter() - started
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    sampling = False
    await sampler
    peak = {name: max(procs.memory_kb(p.pid)["VmHWM"], sampled[name]) for name, p in services.items()}
    memory = {
        name: {
            "baseline_rss_kb": baseline[name],
            "peak_rss_kb": peak[name],
            "per_call_kb": (peak[name] - baseline[name]) / calls,
        }
        for name in services
    }
    return Held(admitted, elapsed, memory), results


async def scale(
    calls: int, hold_s: float, work_dir: Path, *, multiplex: bool, baseline_calls: int = 200
) -> dict[str, Any]:
    """`calls` concurrent slow calls held at once by one invocation and one bridge process.

    With `multiplex`, the callers' calls travel on InvokeTools streams (one per
    client); without, each is its own InvokeTool call.
    """
    # A held call waits for the others at most this long: long enough for all to arrive.
    hold_limit_s = min(100, 30 + calls / 50)
    arrivals = work_dir / "arrivals.txt"
    arrivals.write_text("0")
    system = await stack.start_toolmesh(
        {
            "BENCH_HOLD_TARGET": str(calls),
            "BENCH_HOLD_S": str(hold_s),
            "BENCH_HOLD_LIMIT_S": str(hold_limit_s),
            "BENCH_ARRIVALS_FILE": str(arrivals),
        }
    )
    channels, clients = _clients(system.invocation.target, multiplex)

    async def call(i: int) -> CallResult:
        client = clients[i % CHANNELS]
        return await client.invoke(stack.SESSION, "hold", {"i": i}, turn_id=f"t{i}", timeout=600)

    try:
        for i in range(baseline_calls):  # warm every path before the baseline
            _expect_ok(await clients[i % CHANNELS].invoke(stack.SESSION, "noop", {"n": i}, turn_id="warm"))
        held, results = await _hold_all(system.services, calls, arrivals, call)
        host_errors = dict(system.host.counted)
    finally:
        for channel in channels:
            await channel.close()
        await system.stop()
    correct = 0
    held_together = 0
    failures: collections.Counter[str] = collections.Counter()
    for i, result in enumerate(results):
        if result.outcome is not None and result.outcome.ok and result.outcome.result_json is not None:
            value = json.loads(result.outcome.result_json)
            held_together = max(held_together, value["heldTogether"])
            correct += value["i"] == i
        else:
            failures[_failure(result)] += 1
    return {
        "calls": calls,
        "calls_travel_on": "InvokeTools streams" if multiplex else "InvokeTool calls",
        "hold_s": hold_s,
        "correct": correct,
        "held_together": held_together,
        "failures": dict(failures),
        "host_errors": host_errors,
        **asdict(held),
    }


async def floor_scale(calls: int, hold_s: float, work_dir: Path, baseline_calls: int = 200) -> dict[str, Any]:
    """The same held calls through the floor chain: what bare grpc.aio processes pay per held call."""
    arrivals = work_dir / "floor-arrivals.txt"
    arrivals.write_text("0")
    hold_args = ["--hold", str(calls), "--hold-s", str(hold_s), "--arrivals", str(arrivals)]
    floor = await stack.start_floor(host_args=hold_args)
    options = [("grpc.max_concurrent_streams", 1 << 20)]
    channels = [grpc.aio.insecure_channel(floor.target, options=options) for _ in range(CHANNELS)]
    invokes: list[floor_chain.BytesCall] = [channel.unary_unary(floor_chain.INVOKE) for channel in channels]

    async def call(i: int) -> str:
        try:
            response = await invokes[i % CHANNELS](floor_chain.HELD + b"%d" % i, timeout=600)
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name}: {error.details()}"
        return "ok" if response == floor_chain.RESULT else "wrong answer"

    try:
        for i in range(baseline_calls):  # warm every path before the baseline
            await invokes[i % CHANNELS](b"warm", timeout=30)
        services = {proc.name.removeprefix("floor-"): proc for proc in floor.procs}
        held, results = await _hold_all(services, calls, arrivals, call)
    finally:
        for channel in channels:
            await channel.close()
        await floor.stop()
    failures = collections.Counter(result for result in results if result != "ok")
    return {
        "calls": calls,
        "hold_s": hold_s,
        "correct": calls - failures.total(),
        "failures": dict(failures),
        **asdict(held),
    }


async def join_storm(calls: int, execution_s: float, counter_dir: Path) -> dict[str, Any]:
    """`calls` concurrent identical calls (same session, tool, arguments): how many executions?"""
    counter = counter_dir / "join-executions.txt"
    counter.write_text("")
    system = await stack.start_toolmesh(
        {"BENCH_COUNTER_FILE": str(counter), "BENCH_COUNTED_S": str(execution_s)}
    )
    channels, clients = _clients(system.invocation.target)
    try:
        _expect_ok(await clients[0].invoke(stack.SESSION, "noop", {}, turn_id="warm"))
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                clients[i % CHANNELS].invoke(
                    stack.SESSION, "counted", {"order": "ord_1", "qty": 2}, turn_id="storm", timeout=300
                )
                for i in range(calls)
            )
        )
        elapsed = time.perf_counter() - started
    finally:
        for channel in channels:
            await channel.close()
        await system.stop()
    executions = counter.read_text().count("\n")
    ok = sum(1 for r in results if r.outcome is not None and r.outcome.ok)
    failures = collections.Counter(_failure(r) for r in results if r.outcome is None or not r.outcome.ok)
    return {
        "calls": calls,
        "execution_s": execution_s,
        "answered_ok": ok,
        "failures": dict(failures),
        "handler_executions": executions,
        "distinct_tool_request_ids": len({r.tool_request_id for r in results}),
        "seconds": elapsed,
    }


def _arrived(path: Path) -> int:
    text = path.read_text()
    return int(text) if text.isdigit() else 0


def _failure(result: CallResult) -> str:
    if result.outcome is not None and result.outcome.failure is not None:
        return result.outcome.failure.code
    return (result.code.value if result.code else "NO_OUTCOME") + (
        f": {result.detail}" if result.detail else ""
    )


def _expect_ok(result: CallResult) -> None:
    if result.outcome is None or not result.outcome.ok:
        raise RuntimeError(f"toolmesh call failed: {result.to_json()}")
