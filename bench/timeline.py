"""Where a call alone spends its time (`python -m bench.timeline`): one call's way through every process.

`bench.stages` says which process burns the CPU; this says when each step happens. A copy of
this tree's services and SDK is made in a temporary directory and marks are written into the
copy's source (`EDITS`: at each message a process sends or reads on the call's way, and around
the ledger's steps); the system runs from the copy as `python -m bench` starts it, and each mark
appends `time.monotonic_ns()` and its name to one file. CLOCK_MONOTONIC is one clock for every
process of the machine, so the marks of the caller (this process), the invocation service, the
bridge and the host fall on one time line. The tree itself carries no instrumentation.

Sequential unary calls to the no-op tool, after a warm-up; for each step, the median over the
calls of the time from the mark before it. Each mark costs a write to the file (a few us), so
the total is a little above `python -m bench`'s p50.

    .venv/bin/python -m bench.timeline                       # state in memory
    .venv/bin/python -m bench.timeline --store redis         # in the Redis at TOOLMESH_BENCH_REDIS
    .venv/bin/python -m bench.timeline --no-acknowledge      # a host that asks for no START
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import procs, store
from bench.measure import percentile
from bench.running import running_toolmesh

# The module the copy's marks import: a line per mark, written at once (line-buffered).
MARKER = '''"""Marks for bench.timeline (only in the copy it instruments)."""

import os
import time

_file = open(os.environ["BENCH_TIMELINE_FILE"], "a", buffering=1)  # noqa: SIM115


def mark(name: str) -> None:
    _file.write(f"{time.monotonic_ns()} {name}\\n")
'''
MARK = "from toolmesh._timeline import mark as _mark; _mark"

# (file, text found exactly once, its replacement) in the copy. The names: I_ invocation service,
# B_ bridge, H_ host; "tx"/"rx" a StreamLink's message out/in (the invocation service's dispatch
# stream, the host's ExchangeHostWork), named by its type.
EDITS: list[tuple[str, str, str]] = [
    (
        "clients/python/src/toolmesh/core/stream_link.py",
        "            yield self._batch(items)\n",
        "            message = self._batch(items)\n"
        f"            {MARK}('tx ' + type(message).__name__)\n"
        "            yield message\n",
    ),
    (
        "clients/python/src/toolmesh/core/stream_link.py",
        "            async for response in self._call:\n",
        "            async for response in self._call:\n"
        f"                {MARK}('rx ' + type(response).__name__)\n",
    ),
    (
        "services/src/toolmesh/invocation/servicer.py",
        "        announcer = EarlyId(context)\n",
        f"        {MARK}('I_in')\n        announcer = EarlyId(context)\n",
    ),
    (
        "services/src/toolmesh/invocation/servicer.py",
        "            await announcer.settled()\n        return response_to_pb(result)\n",
        "            await announcer.settled()\n"
        f"        {MARK}('I_out')\n"
        "        return response_to_pb(result)\n",
    ),
    (
        "services/src/toolmesh/invocation/invoker.py",
        "            claim = await self._claim(claiming(), request, tool, leaves_early, lease)\n",
        f"            {MARK}('I_claim')\n"
        "            claim = await self._claim(claiming(), request, tool, leaves_early, lease)\n"
        f"            {MARK}('I_claimed')\n",
    ),
    (
        "services/src/toolmesh/invocation/invoker.py",
        "        return await self.ledger.finish_first(request.tool_request_id, outcome, claimed=claimed)\n",
        f"        {MARK}('I_finish')\n"
        "        finished = await self.ledger.finish_first(\n"
        "            request.tool_request_id, outcome, claimed=claimed\n"
        "        )\n"
        f"        {MARK}('I_finished')\n"
        "        return finished\n",
    ),
    (
        "services/src/toolmesh/bridge/dispatch_stream.py",
        "            async for message in messages:\n",
        f"            async for message in messages:\n                {MARK}('B_dispatch_rx')\n",
    ),
    (
        "services/src/toolmesh/bridge/dispatch_stream.py",
        "                    response.progress.append(item)\n            yield response\n",
        f"                    response.progress.append(item)\n            {MARK}('B_dispatch_tx')\n"
        "            yield response\n",
    ),
    (
        "services/src/toolmesh/bridge/servicer.py",
        "                    yield bridge_pb2.OpenHostSessionResponse(tool_request=request_to_pb(event))\n",
        f"                    {MARK}('B_request_tx')\n"
        "                    yield bridge_pb2.OpenHostSessionResponse(tool_request=request_to_pb(event))\n",
    ),
    (
        "services/src/toolmesh/bridge/host_work.py",
        "            async for message in messages:\n",
        f"            async for message in messages:\n                {MARK}('B_work_rx')\n",
    ),
    (
        "services/src/toolmesh/bridge/host_work.py",
        "                    response.receipts.append(answer)\n            yield response\n",
        f"                    response.receipts.append(answer)\n            {MARK}('B_work_tx')\n"
        "            yield response\n",
    ),
    (
        "services/src/toolmesh/bridge/router.py",
        "        marked = await self._mark([pending for _, pending in fenced])\n",
        f"        {MARK}('B_mark')\n"
        "        marked = await self._mark([pending for _, pending in fenced])\n"
        f"        {MARK}('B_marked')\n",
    ),
    (
        "clients/python/src/toolmesh/host/engine.py",
        "                event = await call.read()\n",
        f"                event = await call.read()\n                {MARK}('H_stream_rx')\n",
    ),
    (
        "clients/python/src/toolmesh/host/engine.py",
        "                value = await handler(arguments, ctx)\n",
        f"                {MARK}('H_handler')\n                value = await handler(arguments, ctx)\n",
    ),
]

# A mark made again for the result (after the handler began) is named with this after it.
RESULT = " (result)"
# What each mark is, for the table.
MEANING = {
    "C_call": "caller: InvokeTool called",
    "I_in": "invocation: InvokeTool handler entered",
    "I_claim": "invocation: request checked, ledger claim begins",
    "I_claimed": "invocation: claimed",
    "tx DispatchToolRequestsRequest": "invocation: request handed to the dispatch stream",
    "B_dispatch_rx": "bridge: request read from the dispatch stream",
    "B_request_tx": "bridge: request handed to the host stream",
    "H_stream_rx": "host: request read from its stream",
    "tx ExchangeHostWorkRequest": "host: start ask handed to ExchangeHostWork",
    "B_work_rx": "bridge: start ask read",
    "B_mark": "bridge: start mark in the ledger begins",
    "B_marked": "bridge: start marked",
    "B_work_tx": "bridge: START handed to ExchangeHostWork",
    "rx ExchangeHostWorkResponse": "host: START read",
    "H_handler": "host: handler begins",
    "tx ExchangeHostWorkRequest" + RESULT: "host: result handed to ExchangeHostWork",
    "B_work_rx" + RESULT: "bridge: result read",
    "B_dispatch_tx": "bridge: outcome handed to the dispatch stream",
    "rx DispatchToolRequestsResponse": "invocation: outcome read",
    "I_finish": "invocation: result checked, ledger finish begins",
    "I_finished": "invocation: finished",
    "I_out": "invocation: response returned",
    "C_done": "caller: outcome in hand",
}
CALLED, DONE, WARM = "C_call", "C_done", "C_warm"


def instrument(directory: Path) -> dict[str, str]:
    """A copy of this tree's services and SDK under `directory`, marked at every EDITS site; the
    environment that makes a process run it. Raises ValueError when a site is not found exactly once."""
    for part in ("clients/python/src", "services/src"):
        shutil.copytree(procs.REPO / part, directory / part, ignore=shutil.ignore_patterns("__pycache__"))
    (directory / "clients/python/src/toolmesh/_timeline.py").write_text(MARKER)
    for name, old, new in EDITS:
        path = directory / name
        text = path.read_text()
        if text.count(old) != 1:
            raise ValueError(f"{name}: {old.strip()!r} found {text.count(old)} times, not once")
        path.write_text(text.replace(old, new))
    roots = [directory / "clients/python/src", directory / "services/src", procs.REPO]
    return {"PYTHONPATH": os.pathsep.join(map(str, roots))}


@dataclass
class Step:
    after: str
    mark: str
    p50_us: float
    p90_us: float


@dataclass
class Timeline:
    calls: int
    # Calls whose marks came in the most common order: the steps are theirs.
    typical: int
    steps: list[Step]
    total_p50_us: float


def calls_of(lines: Iterator[str]) -> list[list[tuple[int, str]]]:
    """Each call's marks (after the warm-up mark), from the caller's call to its outcome, in time order."""
    marks = sorted((int(at), name.strip()) for at, name in (line.split(" ", 1) for line in lines))
    warm = next((index for index, (_, name) in enumerate(marks) if name == WARM), -1)
    calls: list[list[tuple[int, str]]] = []
    call: list[tuple[int, str]] | None = None
    ran = False  # the call's handler began: a mark made again now is the result's
    for at, name in marks[warm + 1 :]:
        if name == CALLED:
            call, ran = [(at, name)], False
        elif call is not None:
            ran = ran or name == "H_handler"
            call.append((at, name + RESULT if ran and name + RESULT in MEANING else name))
            if name == DONE:
                calls.append(call)
                call = None
    return calls


def timeline(calls: list[list[tuple[int, str]]]) -> Timeline:
    """The medians of each step over the calls whose marks came in the most common order."""
    if not calls:
        raise ValueError("no call was marked from start to end")
    orders = Counter(tuple(name for _, name in call) for call in calls)
    order, typical = orders.most_common(1)[0]
    chosen = [call for call in calls if tuple(name for _, name in call) == order]
    steps = []
    for index in range(1, len(order)):
        gaps = sorted((call[index][0] - call[index - 1][0]) / 1000 for call in chosen)
        steps.append(Step(order[index - 1], order[index], statistics.median(gaps), percentile(gaps, 0.9)))
    totals = [(call[-1][0] - call[0][0]) / 1000 for call in chosen]
    return Timeline(len(calls), typical, steps, statistics.median(totals))


async def record(marks: Path, env: dict[str, str], calls: int, warmup: int) -> None:
    """Run the system from the instrumented copy (`env`) and make the calls, marking each."""
    with marks.open("a", buffering=1) as own:

        def mark(name: str) -> None:
            own.write(f"{time.monotonic_ns()} {name}\n")

        async with running_toolmesh(env) as running:
            call = running.calls["toolmesh"]
            for _ in range(warmup):
                await call()
            mark(WARM)
            for _ in range(calls):
                mark(CALLED)
                await call()
                mark(DONE)


def render(result: Timeline, title: str) -> str:
    lines = [
        f"{title}: {result.typical} of {result.calls} calls in the usual order, median total "
        f"{result.total_p50_us / 1000:.3f} ms",
        "",
        "| step: from the mark before to | p50 us | p90 us |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {MEANING.get(step.mark, step.mark)} | {step.p50_us:.0f} | {step.p90_us:.0f} |"
        for step in result.steps
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--store", choices=("memory", "redis"), default="memory")
    parser.add_argument("--no-acknowledge", action="store_true", help="the host asks for no START")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="toolmesh-timeline-") as folder:
        directory = Path(folder)
        marks = directory / "marks.txt"
        env = instrument(directory) | {"BENCH_TIMELINE_FILE": str(marks)}
        prefix = store.new_prefix()
        if args.store == "redis":
            env |= store.env_for(prefix)
        if args.no_acknowledge:
            env["BENCH_ACKNOWLEDGE_STARTS"] = "0"
        try:
            asyncio.run(record(marks, env, args.calls, args.warmup))
        finally:
            if args.store == "redis":
                asyncio.run(store.delete_prefixed(prefix))
        with marks.open() as lines:
            result = timeline(calls_of(lines))
    title = f"A call alone, state in {args.store}, " + (
        "no START asked" if args.no_acknowledge else "START asked"
    )
    print(render(result, title))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
