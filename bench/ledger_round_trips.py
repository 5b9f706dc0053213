"""Redis commands per tool call on the ledger's path, and its latency, for two source trees in one run.

Each tree (this one, and with `--against DIR` another, e.g. `git archive main`
unpacked in DIR) is measured in a child process of its own, in alternating
turns: the three services and a host in that process, their state in a
private redis-server (no persistence, no other clients), called with
sequential unary no-op calls through InvocationClient with its defaults (each
call confirms its delivery, carried on the next call). Redis's own
`INFO commandstats` counts what every call cost it: the scripts (EVALSHA: one
round trip each) and all commands, those run inside scripts included (no round
trip of their own), background work too (routes, the bridge's copy of each
outcome).

    python -m bench.ledger_round_trips [--calls N] [--rounds N] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from bench.procs import free_port
from toolmesh.assembly.system import start_local_system
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolHost

SESSION = "bench-ledger"
ROOT = Path(__file__).resolve().parent.parent


async def _commands(url: str) -> dict[str, int]:
    client = Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


async def _measure(calls: int) -> dict[str, Any]:
    """In this process: the system on a private redis-server, `calls` sequential calls."""
    port = free_port()
    folder = tempfile.mkdtemp()
    redis = await asyncio.create_subprocess_exec(
        *("redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", folder),
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            try:
                await _commands(url)
                break
            except RedisConnectionError:
                await asyncio.sleep(0.05)
        system = await start_local_system(store_url=url)
        host = ToolHost(system.bridge_target, SESSION, host_name="bench")
        host.on_tool("noop", lambda args, ctx: {"ok": True})
        try:
            async with RegistryClient(system.registry_target) as registry:
                await registry.put_tools(SESSION, [ToolSpec("noop", "", '{"type":"object"}')])
            await host.start(timeout=30)
            async with InvocationClient(system.invocation_target) as client:
                for n in range(50):  # warm up
                    await client.invoke(SESSION, "noop", {"warm": n}, turn_id="t")
                await client.flush_confirmations()
                before = await _commands(url)
                latencies = []
                for n in range(calls):
                    started = time.perf_counter()
                    result = await client.invoke(SESSION, "noop", {"n": n}, turn_id="t")
                    latencies.append(time.perf_counter() - started)
                    assert result.outcome is not None and result.outcome.ok
                await client.flush_confirmations()
                after = await _commands(url)
        finally:
            await host.stop()
            await system.stop(grace=0.5)
    finally:
        redis.terminate()
        await redis.wait()
        shutil.rmtree(folder, ignore_errors=True)
    spent = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    return {
        "calls": calls,
        "scripts_per_call": (spent.get("evalsha", 0) + spent.get("eval", 0)) / calls,
        "commands_per_call": sum(spent.values()) / calls,
        "p50_ms": statistics.median(latencies) * 1000,
    }


def _child(tree: Path | None, calls: int) -> dict[str, Any]:
    """One measurement in a child process whose `toolmesh` is `tree`'s (None: this one's)."""
    env = dict(os.environ)
    if tree is not None:
        sources = [str(tree / "services" / "src"), str(tree / "clients" / "python" / "src")]
        env["PYTHONPATH"] = os.pathsep.join([*sources, env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "bench.ledger_round_trips", "--child", "--calls", str(calls)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another source tree to measure beside this one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_measure(args.calls))))
        return
    trees: dict[str, Path | None] = {"this tree": None}
    if args.against is not None:
        trees = {f"against {args.against}": args.against.resolve(), **trees}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(_child(tree, args.calls))
    print(f"Redis commands per tool call, {args.calls} sequential unary calls x {args.rounds} rounds")
    print(f"  {'':<40} {'scripts (round trips)':>22} {'commands':>9} {'p50 ms':>7}")
    for name, figures in runs.items():
        scripts = statistics.mean(f["scripts_per_call"] for f in figures)
        commands = statistics.mean(f["commands_per_call"] for f in figures)
        p50 = statistics.median(f["p50_ms"] for f in figures)
        print(f"  {name:<40} {scripts:>22.2f} {commands:>9.2f} {p50:>7.2f}")


if __name__ == "__main__":
    main()
