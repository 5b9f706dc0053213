"""`python -m bench.limits`: hostile schemas and oversized tool lists, a baseline and this tree in one run.

Two scenarios, each on the services of a baseline commit (default main,
extracted with git archive, as bench.faults does) and on this tree's:

- normal: no-op calls (PROBERS sequential callers) of every tree's system,
  all running at once, probed in alternating turns: p50 and p99 of a normal
  call, before (the baseline) and after.
- hostile: other callers' no-op calls (PROBERS sequential callers) while one
  caller registers a schema of anyOf nested `hostile_depth` deep (through
  $defs: a few kB of text, 2**depth subschema visits per value) and calls it
  back to back with arguments that fail at the deepest level. Figures: the
  other callers' calls, p50 and p99 before and p50, p99 and max during the attack,
  the hostile caller's calls and what they got, and the invocation service's
  peak RSS. This tree runs twice: as configured by default (the registry
  refuses the schema: LIMIT_EXCEEDED), and on the Redis of bench.store
  (TOOLMESH_BENCH_REDIS) where the schema was stored before the services
  start, as a version without the limit stored it, leaving the invocation
  service's worker processes to bound it.
- lists: `list_sessions` sessions each putting a tool list of `list_bytes`
  (64 tools with large schemas), then one call per session (so the invocation
  service loads each list): the registry's and the invocation service's RSS
  after, and how many puts were refused.

    .venv/bin/python -m bench.limits                      # baseline main, about 4 minutes
    .venv/bin/python -m bench.limits --quick --baseline none   # this tree alone, tiny sizes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from bench import procs
from bench.faults import PROBERS, RESULTS, Sample, Tree, baseline, latencies, probe_call, running
from bench.store import REDIS_URL, delete_prefixed
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.core.tools import ToolSpec
from toolmesh.registry.registry import encode_tools
from toolmesh.store.backends import PREFIX_ENV, STORE_ENV, open_stores

HOSTILE_SESSION = "limits-hostile"
# Turns of each tree in the normal scenario, alternating, so that the machine's load falls on both alike.
TURNS = 4


@dataclass(frozen=True)
class Sizes:
    quiet_s: float = 5.0
    hostile_s: float = 20.0
    hostile_depth: int = 21
    list_sessions: int = 200
    list_bytes: int = 3 * 1024 * 1024 + 512 * 1024


QUICK = Sizes(quiet_s=1.0, hostile_s=3.0, hostile_depth=18, list_sessions=8, list_bytes=1024 * 1024)


def nested_any_of(depth: int) -> str:
    defs: dict[str, Any] = {
        f"a{level}": {
            "anyOf": [
                {"type": "array", "items": {"$ref": f"#/$defs/a{level + 1}"}},
                {"type": "array", "items": {"$ref": f"#/$defs/a{level + 1}"}},
            ]
        }
        for level in range(depth)
    }
    defs[f"a{depth}"] = {"type": "integer"}
    return json.dumps({"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": defs})


def failing_at_the_bottom(depth: int) -> dict[str, Any]:
    value: Any = "not an integer"
    for _ in range(depth):
        value = [value]
    return {"x": value}


async def probing(client: InvocationClient, seconds: float) -> list[Sample]:
    samples: list[Sample] = []
    stop_at = time.monotonic() + seconds

    async def prober() -> None:
        while time.monotonic() < stop_at:
            samples.append(await probe_call(client))

    await asyncio.gather(*(prober() for _ in range(PROBERS)))
    return samples


async def normal(trees: list[Tree], sizes: Sizes) -> dict[str, dict[str, Any]]:
    """Normal calls, no attack: each tree's system running at once, probed in alternating turns."""
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for tree in trees:
            system = await stack.enter_async_context(running(tree))
            clients.append(await stack.enter_async_context(InvocationClient(system.invocation.target)))
        samples: list[list[Sample]] = [[] for _ in trees]
        for _ in range(TURNS):
            for index, client in enumerate(clients):
                samples[index] += await probing(client, sizes.quiet_s)
    return {tree.label: latencies(taken) for tree, taken in zip(trees, samples, strict=True)}


async def store_earlier(prefix: str, sizes: Sizes) -> None:
    """The hostile tool list in the Redis under `prefix`, as a registry without the limits stored it."""
    stores = open_stores(REDIS_URL, prefix)
    try:
        await stores.store.put(f"registry:tools:{HOSTILE_SESSION}", encode_tools(hostile_tools(sizes)))
    finally:
        await stores.close()


def hostile_tools(sizes: Sizes) -> list[ToolSpec]:
    return [ToolSpec("deep", "", nested_any_of(sizes.hostile_depth), timeout_ms=60_000)]


async def hostile(tree: Tree, sizes: Sizes, *, stored_earlier: bool = False) -> dict[str, Any]:
    async with running(tree) as system, InvocationClient(system.invocation.target) as client:
        before = latencies(await probing(client, sizes.quiet_s))
        registration = "stored earlier" if stored_earlier else "accepted"
        started = time.monotonic()
        if not stored_earlier:
            async with RegistryClient(system.registry.target) as registry:
                try:
                    await registry.put_tools(HOSTILE_SESSION, hostile_tools(sizes))
                except grpc.aio.AioRpcError as refused:
                    registration = f"refused {_refusal(refused)}"
        registration_s = time.monotonic() - started
        outcomes: dict[str, int] = {}
        stop = asyncio.Event()

        async def attacker() -> None:
            arguments = failing_at_the_bottom(sizes.hostile_depth)
            while not stop.is_set():
                result = await client.invoke(
                    HOSTILE_SESSION, "deep", {**arguments, "n": uuid.uuid4().hex}, turn_id="x", timeout=60
                )
                if result.outcome is not None:
                    details = result.outcome.failure.details if result.outcome.failure else None
                    reason = details.get("reason", "") if isinstance(details, dict) else ""
                    code = f"{result.outcome.code} {reason}".strip()
                else:
                    code = result.code.value if result.code else "NO_OUTCOME"
                outcomes[code] = outcomes.get(code, 0) + 1

        attacking = asyncio.ensure_future(attacker())
        during = latencies(await probing(client, sizes.hostile_s))
        stop.set()
        await attacking
        memory = procs.memory_kb(system.invocation.pid)
        return {
            "before": before,
            "during": during,
            "registration": registration,
            "registration_s": registration_s,
            "hostile_calls": outcomes,
            "invocation_peak_mb": memory["VmHWM"] / 1024,
        }


def big_list(list_bytes: int) -> list[ToolSpec]:
    count = 64
    padding = "p" * max(0, list_bytes // count - 200)
    schema = json.dumps({"type": "object", "description": padding, "properties": {"n": {"type": "integer"}}})
    return [ToolSpec(f"tool_{index}", "", schema) for index in range(count)]


async def lists(tree: Tree, sizes: Sizes) -> dict[str, Any]:
    async with running(tree) as system:
        registry_before = procs.memory_kb(system.registry.pid)["VmRSS"]
        invocation_before = procs.memory_kb(system.invocation.pid)["VmRSS"]
        tools = big_list(sizes.list_bytes)
        refused: dict[str, int] = {}
        async with RegistryClient(system.registry.target) as registry:
            for index in range(sizes.list_sessions):
                try:
                    await registry.put_tools(f"limits-list-{index}", tools)
                except grpc.aio.AioRpcError as error:
                    key = _refusal(error)
                    refused[key] = refused.get(key, 0) + 1
        async with InvocationClient(system.invocation.target) as client:
            for index in range(sizes.list_sessions):
                await client.invoke(f"limits-list-{index}", "tool_0", {"n": "not a number"}, turn_id="t")
        return {
            "sessions": sizes.list_sessions,
            "list_mb": sizes.list_bytes / 2**20,
            "refused_puts": refused,
            "registry_rss_mb": {"before": registry_before / 1024, "after": _mb(system.registry.pid)},
            "invocation_rss_mb": {"before": invocation_before / 1024, "after": _mb(system.invocation.pid)},
            "invocation_peak_mb": procs.memory_kb(system.invocation.pid)["VmHWM"] / 1024,
        }


def _refusal(error: grpc.aio.AioRpcError) -> str:
    code = error_code(error)
    info = error_info(error)
    limit = info.metadata.get("limit", "") if info is not None else ""
    return f"{code.value if code else error.code().name} ({limit})"


def _mb(pid: int) -> float:
    return procs.memory_kb(pid)["VmRSS"] / 1024


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    header = f"{'':34}" + "".join(f"{label[:30]:>32}" for label in results)
    for scenario, rows in (
        (
            "normal",
            [
                ("no-op call p50 ms", ("p50_ms",)),
                ("no-op call p99 ms", ("p99_ms",)),
                ("calls", ("calls",)),
                ("failed", ("failed",)),
            ],
        ),
        (
            "hostile",
            [
                ("others before p50 ms", ("before", "p50_ms")),
                ("others before p99 ms", ("before", "p99_ms")),
                ("others during p50 ms", ("during", "p50_ms")),
                ("others during p99 ms", ("during", "p99_ms")),
                ("others during max ms", ("during", "max_ms")),
                ("others during calls", ("during", "calls")),
                ("others during failed", ("during", "failed")),
                ("hostile registration", ("registration",)),
                ("registration s", ("registration_s",)),
                ("hostile calls", ("hostile_calls",)),
                ("invocation peak MB", ("invocation_peak_mb",)),
            ],
        ),
        (
            "lists",
            [
                ("puts refused", ("refused_puts",)),
                ("registry RSS MB before", ("registry_rss_mb", "before")),
                ("registry RSS MB after", ("registry_rss_mb", "after")),
                ("invocation RSS MB before", ("invocation_rss_mb", "before")),
                ("invocation RSS MB after", ("invocation_rss_mb", "after")),
                ("invocation peak MB", ("invocation_peak_mb",)),
            ],
        ),
    ):
        present = [label for label in results if scenario in results[label]]
        if not present:
            continue
        lines += ["", scenario, header]
        for name, path in rows:
            cells = []
            for figures in results.values():
                value: Any = figures.get(scenario)
                for key in path:
                    value = value.get(key) if isinstance(value, dict) else None
                cells.append(_fmt(value))
            lines.append(f"{name:34}" + "".join(f"{cell[:30]:>32}" for cell in cells))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, dict):
        return ", ".join(f"{key}: {count}" for key, count in value.items()) or "none"
    return str(value)


async def run(args: argparse.Namespace, sizes: Sizes) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="toolmesh-baseline-") as directory:
        trees = [Tree("this tree")]
        if args.baseline != "none":
            trees.insert(0, baseline(args.baseline, Path(directory)))
        prefix = f"bench-limits:{uuid.uuid4().hex}:"
        earlier = Tree("this tree, schema stored earlier", {STORE_ENV: REDIS_URL, PREFIX_ENV: prefix})
        results: dict[str, dict[str, Any]] = {tree.label: {} for tree in [*trees, earlier]}
        only = args.only.split(",") if args.only else ["normal", "hostile", "lists"]
        if "normal" in only:
            print("normal: every tree, in turns ...", file=sys.stderr, flush=True)
            for label, figures in (await normal(trees, sizes)).items():
                results[label]["normal"] = figures
        if "hostile" in only:
            for tree in trees:
                print(f"hostile: {tree.label} ...", file=sys.stderr, flush=True)
                results[tree.label]["hostile"] = await hostile(tree, sizes)
            print(f"hostile: {earlier.label} ...", file=sys.stderr, flush=True)
            await store_earlier(prefix, sizes)
            try:
                results[earlier.label]["hostile"] = await hostile(earlier, sizes, stored_earlier=True)
            finally:
                await delete_prefixed(prefix)
        if "lists" in only:
            for tree in trees:
                print(f"lists: {tree.label} ...", file=sys.stderr, flush=True)
                results[tree.label]["lists"] = await lists(tree, sizes)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.limits")
    parser.add_argument("--baseline", default="main", help="git ref of the baseline's services, or 'none'")
    parser.add_argument("--only", default="", help="comma-separated scenarios of normal, hostile, lists")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it all runs")
    parser.add_argument("--hostile-depth", type=int, help="anyOf nesting of the hostile schema")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    if args.hostile_depth:
        sizes = replace(sizes, hostile_depth=args.hostile_depth)
    load_before = os.getloadavg()
    results = asyncio.run(run(args, sizes))
    load_after = os.getloadavg()
    print(table(results))
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    written = out / f"limits-{'quick-' if args.quick else ''}{stamp}.json"
    written.write_text(json.dumps({"sizes": sizes.__dict__, "results": results}, indent=2, default=str))
    print(f"written to {written}")


if __name__ == "__main__":
    main()
