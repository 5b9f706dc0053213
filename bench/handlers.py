"""Handlers of the benchmark's host process: `toolmesh host --handlers bench.handlers:HANDLERS`.

Configured through the environment:
- BENCH_HOLD_TARGET: `hold` calls wait until this many have arrived (all held at once),
- BENCH_HOLD_S: then each waits this long more before answering,
- BENCH_HOLD_LIMIT_S: but none waits for the others longer than this,
- BENCH_ARRIVALS_FILE: where `hold` keeps the count of calls that arrived (every 50),
- BENCH_COUNTER_FILE: `counted` appends one line per execution here,
- BENCH_COUNTED_S: how long a `counted` execution takes,
- BENCH_EXECUTIONS_FILE: `chaos` appends each execution's start and end (or cancellation) here,
  one JSON line each (bench.chaos reads them).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

from toolmesh.host import ToolContext


async def noop(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"ok": True}


def noop_sync(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"ok": True}


class _Barrier:
    def __init__(self) -> None:
        self.arrived = 0
        self.total = 0
        self.peak = 0
        self.released: asyncio.Event | None = None

    def event(self) -> asyncio.Event:
        if self.released is None:
            self.released = asyncio.Event()
        return self.released


_barrier = _Barrier()


async def hold(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Wait until BENCH_HOLD_TARGET calls are held at once, then BENCH_HOLD_S more; echo `i`."""
    target = int(os.environ.get("BENCH_HOLD_TARGET", "1"))
    released = _barrier.event()
    _barrier.arrived += 1
    _barrier.total += 1
    _barrier.peak = max(_barrier.peak, _barrier.arrived)
    if _barrier.arrived >= target:
        released.set()
    arrivals = os.environ.get("BENCH_ARRIVALS_FILE")
    if arrivals and (_barrier.total % 50 == 0 or released.is_set()):
        with open(arrivals, "w") as out:  # noqa: ASYNC230 - a few bytes
            out.write(str(_barrier.total))
    try:
        await asyncio.wait_for(released.wait(), float(os.environ.get("BENCH_HOLD_LIMIT_S", "60")))
        await asyncio.sleep(float(os.environ.get("BENCH_HOLD_S", "1")))
    finally:
        _barrier.arrived -= 1
    return {"i": args["i"], "heldTogether": _barrier.peak}


async def counted(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Count this execution in BENCH_COUNTER_FILE, take BENCH_COUNTED_S, answer."""
    with open(os.environ["BENCH_COUNTER_FILE"], "a") as counter:  # noqa: ASYNC230 - one short line
        counter.write("1\n")
    await asyncio.sleep(float(os.environ.get("BENCH_COUNTED_S", "0.5")))
    return {"ok": True}


def _executed(event: str, args: dict[str, Any], ctx: ToolContext, execution: str) -> None:
    line = {
        "event": event,
        "key": args["key"],
        "toolRequestId": ctx.tool_request_id,
        "execution": execution,
        "at": time.time(),  # the machine's clock, as the caller's answers are timed
        "leftS": ctx.time_remaining(),
    }
    # Opened and closed per line: a SIGKILL loses nothing written before it.
    with open(os.environ["BENCH_EXECUTIONS_FILE"], "a") as out:
        out.write(json.dumps(line) + "\n")


async def chaos(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Record its start, take `ms`, record its end; answer which execution this was."""
    execution = uuid.uuid4().hex
    _executed("start", args, ctx, execution)
    try:
        await asyncio.sleep(args["ms"] / 1000)
    except asyncio.CancelledError:
        _executed("cancelled", args, ctx, execution)
        raise
    _executed("end", args, ctx, execution)
    return {"key": args["key"], "execution": execution}


HANDLERS = {
    "noop": noop,
    "noop_sync": noop_sync,
    "hold": hold,
    "counted": counted,
    "chaos_write": chaos,
    "chaos_read": chaos,
}
