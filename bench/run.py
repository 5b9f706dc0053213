"""`python -m bench`: every benchmark in one run; prints a table and writes JSON to bench/results/."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import (
    ab,
    cluster,
    measure,
    procs,
    replicas,
    report,
    running,
    security,
    stack,
    store,
    stress,
    tracing,
    validation,
)
from toolmesh.client import InvocationClient

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("validation", "latency", "store", "cluster", "replicas", "tracing", "security", "scale", "join")


@dataclass(frozen=True)
class Sizes:
    calls: int = 2000  # sequential calls per system
    warmup: int = 200
    seconds: float = 5.0  # throughput window
    warmup_s: float = 1.0
    concurrency: int = 64
    scale_calls: int = 10_000
    scale_hold_s: float = 2.0
    join_calls: int = 1000
    # Long enough for all the identical calls to arrive while the first still runs.
    join_execution_s: float = 5.0
    validation_iterations: int = 2000
    # Turns of plaintext and TLS+tokens measurements.
    security_rounds: int = 3
    # Sessions whose keys are spread over the cluster's primaries.
    spread_sessions: int = 1000


QUICK = Sizes(
    calls=40,
    warmup=5,
    seconds=0.5,
    warmup_s=0.2,
    concurrency=8,
    scale_calls=100,
    scale_hold_s=0.2,
    join_calls=20,
    join_execution_s=0.1,
    validation_iterations=20,
    security_rounds=1,
    spread_sessions=30,
)


def mcp_available() -> bool:
    return importlib.util.find_spec("mcp") is not None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str:
    """The commit measured (BENCH_COMMIT when the code is not a git work tree); '+dirty' for local changes."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=procs.REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--", "clients", "services"],
            cwd=procs.REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if changes else head


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


class Profiler:
    """py-spy attached to some processes while one system is measured (collapsed stacks, one file each)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._running: list[subprocess.Popen[bytes]] = []

    @contextlib.contextmanager
    def attach(self, label: str, pids: dict[str, int]) -> Any:
        if self.directory is None:
            yield
            return
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.directory.mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            out = self.directory / f"{label}-{name}.txt"
            args = [spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--nonblocking"]
            self._running.append(
                subprocess.Popen(
                    [*args, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        try:
            yield
        finally:
            for spy_process in self._running:
                spy_process.send_signal(signal.SIGINT)
            for spy_process in self._running:
                try:
                    spy_process.wait(30)
                except subprocess.TimeoutExpired:
                    spy_process.kill()
            self._running.clear()


async def _measure(call: measure.Call, sizes: Sizes, pids: dict[str, int]) -> dict[str, Any]:
    """Latency, then throughput; and the CPU time each process spent per call in each."""

    def cpu_seconds() -> dict[str, float]:
        return {name: procs.cpu_seconds(pid) for name, pid in pids.items()}

    await measure.sequential(call, sizes.warmup, 0)
    before = cpu_seconds()
    latency = await measure.sequential(call, sizes.calls, 0)
    after = cpu_seconds()
    cpu = {name: (after[name] - before[name]) * 1000 / sizes.calls for name in pids}
    latency["cpu_ms_per_call"] = cpu | {"total": sum(cpu.values())}
    return {
        "latency": latency,
        "throughput": await measure.throughput(
            call, sizes.concurrency, sizes.seconds, sizes.warmup_s, cpu_seconds
        ),
    }


async def measure_floor(sizes: Sizes, with_lookup: bool) -> dict[str, Any]:
    async with running.running_floor(with_lookup) as system:
        return await _measure(system.calls["floor"], sizes, system.pids)


async def measure_toolmesh(
    sizes: Sizes,
    profiler: Profiler,
    env: dict[str, str] | None = None,
    variants: tuple[str, ...] = ("toolmesh-stream", "toolmesh-sync"),
) -> dict[str, dict[str, Any]]:
    """`toolmesh` and the `variants` asked for (see running_toolmesh), one after the other."""
    async with running.running_toolmesh(env) as system:
        with profiler.attach("toolmesh", system.pids):
            measured = {"toolmesh": await _measure(system.calls["toolmesh"], sizes, system.pids)}
        for variant in variants:
            measured[variant] = await _measure(system.calls[variant], sizes, system.pids)
        return measured


async def measure_security(sizes: Sizes, directory: Path) -> dict[str, Any]:
    """Plaintext without tokens against TLS and tokens, both systems up at once and measured in
    turns, `sizes.security_rounds` times, so that a change in the machine's load falls on both."""
    ways = ("toolmesh", "toolmesh-stream")
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
        label: {way: [] for way in ways} for label in ("plain", "tls+tokens")
    }
    with security.secured(directory) as secured:
        async with (
            running.running_toolmesh() as plain,
            running.running_toolmesh(secured=secured) as protected,
        ):
            for _ in range(sizes.security_rounds):
                for way in ways:
                    for label, system in (("plain", plain), ("tls+tokens", protected)):
                        rounds[label][way].append(await _measure(system.calls[way], sizes, system.pids))
    return security.summary(rounds) | await security.token_costs(sizes.validation_iterations)


async def measure_mcp(sizes: Sizes) -> dict[str, dict[str, Any]]:
    from bench import mcp_peer  # noqa: PLC0415 - mcp is an optional dependency

    results: dict[str, dict[str, Any]] = {}

    async def run_with(label: str, connect: contextlib.AbstractAsyncContextManager[Any]) -> None:
        async with connect as client:
            counter = itertools.count()

            async def call() -> None:
                await mcp_peer.call_noop(client, next(counter))

            # The stdio server is the SDK's own child process.
            servers = procs.children(os.getpid(), "bench.mcp_peer")
            pids = {f"server{i or ''}": pid for i, pid in enumerate(servers)} | {"caller": os.getpid()}
            results[label] = await _measure(call, sizes, pids)

    await run_with("mcp-stdio", mcp_peer.connect_stdio())
    server = await procs.start("mcp-http", ["-m", "bench.mcp_peer", "http"])
    try:
        await run_with("mcp-http", mcp_peer.connect_http(server.port))
    finally:
        await server.stop()
    return results


async def measure_store(sizes: Sizes) -> dict[str, Any]:
    """The same unary calls to two systems, one keeping its state in memory, one in Redis, in turns."""
    prefix = store.new_prefix()
    redis_pid = await store.server_pid()
    memory = await stack.start_toolmesh()
    try:
        redis = await stack.start_toolmesh(env=store.env_for(prefix))
    except BaseException:
        await memory.stop()
        raise
    clients = [InvocationClient(system.invocation.target) for system in (memory, redis)]
    counter = itertools.count()

    def caller(client: InvocationClient) -> measure.Call:
        async def call() -> None:
            result = await client.invoke(
                stack.SESSION, "noop", {"n": next(counter)}, turn_id="turn-1", timeout=60
            )
            if result.outcome is None or result.outcome.result_json != '{"ok":true}':
                raise RuntimeError(f"toolmesh answered {result.to_json()}")

        return call

    redis_pids = running.pids_of(list(redis.services.values()))
    if redis_pid is not None:
        redis_pids["redis"] = redis_pid
    try:
        measured = await store.compare(
            {
                "memory": (caller(clients[0]), running.pids_of(list(memory.services.values()))),
                "redis": (caller(clients[1]), redis_pids),
            },
            calls=sizes.calls,
            warmup=sizes.warmup,
            concurrency=sizes.concurrency,
            seconds=sizes.seconds,
            warmup_s=sizes.warmup_s,
        )
    finally:
        for client in clients:
            await client.close()
        await redis.stop()
        await memory.stop()
        await store.delete_prefixed(prefix)
    return measured | {
        "redis_url": store.REDIS_URL,
        "redis_cpu_counted": redis_pid is not None,
        "rounds": store.ROUNDS,
        "redis/memory": store.ratios(measured["memory"], measured["redis"]),
    }


async def run(sizes: Sizes, sections: tuple[str, ...], profile: Path | None) -> dict[str, Any]:
    results: dict[str, Any] = {
        "meta": {
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": _commit(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "grpcio": _version("grpcio"),
            "mcp": _version("mcp"),
            "sizes": asdict(sizes),
            "sections": list(sections),
            # Benchmarks share the machine: a high load average makes every figure worse.
            "load_before": _load(),
        }
    }
    if "validation" in sections:
        print("... validation", file=sys.stderr, flush=True)
        results["validation"] = validation.run(sizes.validation_iterations)
    if "latency" in sections:
        systems: dict[str, Any] = {}
        print("... floor", file=sys.stderr, flush=True)
        systems["floor"] = await measure_floor(sizes, with_lookup=False)
        print("... floor with a lookup hop", file=sys.stderr, flush=True)
        systems["floor+lookup"] = await measure_floor(sizes, with_lookup=True)
        print("... toolmesh", file=sys.stderr, flush=True)
        systems.update(await measure_toolmesh(sizes, Profiler(profile)))
        if mcp_available():
            print("... MCP SDK", file=sys.stderr, flush=True)
            systems.update(await measure_mcp(sizes))
        else:
            results["skipped"] = {"mcp": "the mcp package is not installed (pip install -e '.[bench]')"}
        results["systems"] = systems
        results["ratios"] = report.ratios(systems)
    if "store" in sections:
        print("... state in memory, then in Redis", file=sys.stderr, flush=True)
        results["store"] = await measure_store(sizes)
    if "cluster" in sections:
        print(
            "... one Redis, a Redis Cluster (3+3), the cluster with durable claims",
            file=sys.stderr,
            flush=True,
        )
        results["cluster"] = await cluster.measure_cluster(
            calls=sizes.calls,
            warmup=sizes.warmup,
            concurrency=sizes.concurrency,
            seconds=sizes.seconds,
            warmup_s=sizes.warmup_s,
            sessions=sizes.spread_sessions,
        )
    if "replicas" in sections:
        print("... replicas: 1+1, routed, 2+2 on one Redis", file=sys.stderr, flush=True)
        results["replicas"] = await replicas.measure_replicas(
            calls=sizes.calls,
            warmup=sizes.warmup,
            concurrency=sizes.concurrency,
            seconds=sizes.seconds,
            warmup_s=sizes.warmup_s,
            cpu_of_redis=await store.server_pid(),
        )
    if "tracing" in sections:
        print("... tracing off, then on (exporting over OTLP)", file=sys.stderr, flush=True)
        off = (await measure_toolmesh(sizes, Profiler(None), {"OTEL_SDK_DISABLED": "true"}, variants=()))[
            "toolmesh"
        ]
        async with tracing.otlp_receiver() as (sink, env):
            on = (await measure_toolmesh(sizes, Profiler(None), env, variants=()))["toolmesh"]
        results["tracing"] = {
            "off": off,
            "on": on,
            "spans_exported": sink.spans,
            "on/off": tracing.ratios(off, on),
        }
    if "security" in sections:
        print("... plaintext without tokens and TLS with tokens, in turns", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as pki_dir:
            results["security"] = await measure_security(sizes, Path(pki_dir))
    if "scale" in sections:
        print(f"... scale: {sizes.scale_calls} held calls", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as work_dir:
            results["scale"] = await stress.scale(
                sizes.scale_calls, sizes.scale_hold_s, Path(work_dir), multiplex=True
            )
            results["scale_unary"] = await stress.scale(
                sizes.scale_calls, sizes.scale_hold_s, Path(work_dir), multiplex=False
            )
            results["scale_floor"] = await stress.floor_scale(
                sizes.scale_calls, sizes.scale_hold_s, Path(work_dir)
            )
    if "join" in sections:
        print(f"... join storm: {sizes.join_calls} identical calls", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as counter_dir:
            results["join_storm"] = await stress.join_storm(
                sizes.join_calls, sizes.join_execution_s, Path(counter_dir)
            )
    results["meta"]["load_after"] = _load()
    results["targets"] = report.targets(results)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs")
    parser.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON (%(default)s)")
    parser.add_argument("--calls", type=int, help="sequential calls per system")
    parser.add_argument("--seconds", type=float, help="throughput window per system")
    parser.add_argument("--scale-calls", type=int, help="calls held at once in the scale test")
    parser.add_argument("--join-calls", type=int, help="identical calls in the join storm")
    parser.add_argument("--security-rounds", type=int, help="turns of plaintext and TLS+tokens measurements")
    parser.add_argument(
        "--profile", type=Path, help="record py-spy profiles of the toolmesh processes into this directory"
    )
    parser.add_argument(
        "--ab",
        metavar="REF",
        help="latency only: REF's services and SDK against this tree's, in alternating turns (bench/ab.py)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds of turns with --ab (%(default)s)")
    parser.add_argument(
        "--traced",
        action="store_true",
        help="with --ab: both sides trace, exporting every span over OTLP to a receiver in this process",
    )
    parser.add_argument(
        "--standard-loop",
        action="store_true",
        help="with --ab: a fourth side, this tree with every process on asyncio's standard loop "
        "(TOOLMESH_EVENT_LOOP=asyncio; the other sides run on uvloop, as the services do)",
    )
    parser.add_argument(
        "--baseline-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="with --ab: set in the baseline side's processes, for the cost of a setting "
        "(--ab HEAD --baseline-env BENCH_ACKNOWLEDGE_STARTS=0: what start acknowledgements cost)",
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    overrides = {
        "calls": args.calls,
        "seconds": args.seconds,
        "scale_calls": args.scale_calls,
        "join_calls": args.join_calls,
        "security_rounds": args.security_rounds,
    }
    sizes = Sizes(**(asdict(sizes) | {key: value for key, value in overrides.items() if value is not None}))
    sections = tuple(args.only.split(",")) if args.only else SECTIONS
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    if (args.standard_loop or args.baseline_env) and args.ab is None:
        parser.error("--standard-loop and --baseline-env are about the A/B's sides: add --ab REF")
    baseline_env = dict(pair.partition("=")[::2] for pair in args.baseline_env)
    if any(not name for name in baseline_env):
        parser.error("--baseline-env takes NAME=VALUE")
    if args.ab is not None:
        if sections != ("latency",):
            parser.error("--ab measures the latency section alone: add --only latency")
        results = asyncio.run(
            ab.run(
                args.ab,
                rounds=args.rounds,
                calls=sizes.calls,
                warmup=sizes.warmup,
                seconds=sizes.seconds,
                warmup_s=sizes.warmup_s,
                concurrency=sizes.concurrency,
                head=_commit(),
                load=_load,
                traced=args.traced,
                standard_loop=args.standard_loop,
                baseline_env=baseline_env,
            )
        )
        print(ab.table(results))
        kind = "ab"
    else:
        results = asyncio.run(run(sizes, sections, args.profile))
        print(report.table(results))
        kind = "bench"
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"{kind}-{'quick-' if args.quick else ''}{stamp}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nJSON: {path}")
