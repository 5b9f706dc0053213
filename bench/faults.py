"""`python -m bench.faults`: the services under faults and hostile input, a baseline and this tree in one run.

Every scenario runs twice, on the services of a baseline commit (default
`main`, taken with `git archive` into a temporary directory) and on this
tree's, each service its own process; the table puts the two side by side.

- `message`: other callers' latency while one InvokeTools message carries
  100,000 calls (and while the same calls come as messages of 1,000), and
  while one DispatchToolRequests message carries 100,000 requests. The probe
  makes sequential no-op calls through the whole chain; the flood's calls are
  cheap (arguments the schema refuses, requests for a session no host serves)
  so that what shows is how long one message holds a service's event loop.
- `unread`: an InvokeTools caller that sends calls and never reads a result;
  the invocation service's memory (VmRSS) as it goes, and how many calls the
  service took before the caller's sends stopped going through.
- `recovery`: the registry killed (SIGKILL) for 30 s, then the bridge for
  10 s, each restarted on its ports; the time from the restarted process
  listening to the first call that succeeds (and, for the bridge, to the
  first that is not BRIDGE_UNAVAILABLE), with a probe call every 20 ms.
- `routing`: 50 host sessions of one session that opened their stream and
  then stopped reading it, beside one working host; two rounds of 40
  concurrent calls, and how they ended.

It writes the figures as JSON to bench/results/ too.

    .venv/bin/python -m bench.faults                       # baseline main, about 4 minutes
    .venv/bin/python -m bench.faults --baseline none       # this tree only
    .venv/bin/python -m bench.faults --only recovery --quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench import procs
from bench.host import READY
from bench.measure import percentile
from bench.procs import Proc, free_port
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, invocation_pb2, invocation_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
SCENARIOS = ("message", "unread", "recovery", "routing")
SESSION = "faults"
NOBODY = "faults-nobody"  # a session no host serves
SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
TOOLS = [ToolSpec("noop", "Does nothing", SCHEMA, timeout_ms=2000)]
STALLED_READY = "stalled hosts: open"
FLOOD_SENDING = "flood: sending"
# Callers probing at once during a flood: a short flood still gets a few samples.
PROBERS = 4
FLOOD_DONE = "flood: done"


@dataclass(frozen=True)
class Sizes:
    flood_calls: int = 100_000
    probe_quiet_s: float = 3.0
    unread_calls: int = 300_000
    registry_outage_s: float = 30.0
    bridge_outage_s: float = 10.0
    stalled_hosts: int = 50
    routed_calls: int = 40


QUICK = Sizes(
    flood_calls=3_000,
    probe_quiet_s=0.5,
    unread_calls=20_000,
    registry_outage_s=2.0,
    bridge_outage_s=2.0,
    stalled_hosts=5,
    routed_calls=8,
)


@dataclass(frozen=True)
class Tree:
    """Whose services run: `env` goes into each process's environment."""

    label: str
    env: dict[str, str] = field(default_factory=dict)


def baseline(ref: str, directory: Path) -> Tree:
    """The services and SDK of commit `ref`, extracted under `directory`; bench.* still comes from here."""
    sha, env = procs.extract(ref, directory)
    return Tree(f"baseline {ref} ({sha})", env)


@dataclass
class System:
    tree: Tree
    ports: dict[str, int]
    registry: Proc
    bridge: Proc
    invocation: Proc
    host: Proc

    @property
    def bridge_internal(self) -> str:
        return f"127.0.0.1:{self.ports['bridge-internal']}"

    async def start_registry(self) -> None:
        self.registry = await _registry(self.tree, self.ports)
        async with RegistryClient(self.registry.target) as registry:
            await registry.put_tools(SESSION, TOOLS)

    async def start_bridge(self) -> None:
        self.bridge = await _bridge(self.tree, self.ports)

    async def stop(self) -> None:
        await procs.stop_all([self.registry, self.bridge, self.invocation, self.host])


def _listen(ports: dict[str, int], name: str) -> list[str]:
    return [
        "--listen",
        f"127.0.0.1:{ports[name]}",
        "--internal-listen",
        f"127.0.0.1:{ports[name + '-internal']}",
    ]


async def _registry(tree: Tree, ports: dict[str, int]) -> Proc:
    return await procs.start(
        "registry", ["-m", "toolmesh.registry", *_listen(ports, "registry")], env=tree.env
    )


async def _bridge(tree: Tree, ports: dict[str, int]) -> Proc:
    args = [*_listen(ports, "bridge"), "--web-listen", f"127.0.0.1:{ports['web']}"]
    args += ["--registry", f"127.0.0.1:{ports['registry-internal']}"]
    return await procs.start("bridge", ["-m", "toolmesh.bridge", *args], env=tree.env)


async def start_system(tree: Tree) -> System:
    """Registry, bridge, invocation and a bench host serving SESSION, on ports that a restart reuses."""
    names = ("registry", "registry-internal", "bridge", "bridge-internal", "web", "invocation")
    ports = {name: free_port() for name in names}
    started: list[Proc] = []
    try:
        registry = await _registry(tree, ports)
        started.append(registry)
        bridge = await _bridge(tree, ports)
        started.append(bridge)
        args = ["--listen", f"127.0.0.1:{ports['invocation']}"]
        args += ["--registry", f"127.0.0.1:{ports['registry-internal']}"]
        args += ["--bridge", f"127.0.0.1:{ports['bridge-internal']}"]
        invocation = await procs.start("invocation", ["-m", "toolmesh.invocation", *args], env=tree.env)
        started.append(invocation)
        host = await procs.start(
            "host",
            ["-m", "bench.host", "--bridge", bridge.target, "--session", SESSION],
            env=tree.env,
            port_line=False,
        )
        started.append(host)
        await host.wait_for(READY)
        async with RegistryClient(registry.target) as client:
            await client.put_tools(SESSION, TOOLS)
    except BaseException:
        await procs.stop_all(started)
        raise
    return System(tree, ports, registry, bridge, invocation, host)


@contextlib.asynccontextmanager
async def running(tree: Tree) -> AsyncIterator[System]:
    system = await start_system(tree)
    try:
        yield system
    finally:
        await system.stop()


# -- probing ---------------------------------------------------------------------------------


@dataclass
class Sample:
    at: float  # time.monotonic() when the call ended
    ms: float
    code: str  # OK, an outcome's code, or the code of a call without one


async def probe_call(client: InvocationClient, timeout: float = 2.0) -> Sample:
    started = time.monotonic()
    result = await client.invoke(
        SESSION, "noop", {"n": 1, "probe": uuid.uuid4().hex}, turn_id="probe", timeout=timeout
    )
    if result.outcome is not None:
        code = result.outcome.code
    else:
        code = result.code.value if result.code else "NO_OUTCOME"
    ended = time.monotonic()
    return Sample(ended, (ended - started) * 1000, code)


async def probe_until(client: InvocationClient, done: Callable[[], bool], probers: int = 1) -> list[Sample]:
    """Sequential probe calls, from `probers` callers at once, until `done()`."""
    samples: list[Sample] = []

    async def prober() -> None:
        while not done():
            samples.append(await probe_call(client))

    await asyncio.gather(*(prober() for _ in range(probers)))
    return samples


def latencies(samples: list[Sample]) -> dict[str, Any]:
    ms = sorted(sample.ms for sample in samples)
    return {
        "calls": len(ms),
        "p50_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": ms[-1] if ms else float("nan"),
        "failed": sum(sample.code != "OK" for sample in samples),
    }


# -- message: one large stream message ---------------------------------------------------------


def refused_calls(count: int, start: int = 0) -> list[invocation_pb2.StreamedToolCall]:
    """Calls whose arguments the schema refuses: each costs the invocation service its validation only."""
    request = invocation_pb2.InvokeToolRequest(
        session_id=SESSION, turn_id="t", tool_name="noop", arguments_json='{"n":"x"}'
    )
    return [invocation_pb2.StreamedToolCall(call_id=start + n, request=request) for n in range(count)]


async def flood_calls(target: str, total: int, per_message: int) -> dict[str, Any]:
    """`total` calls on one InvokeTools stream in messages of `per_message`; read until all are answered."""
    messages = [
        invocation_pb2.InvokeToolsRequest(calls=refused_calls(min(per_message, total - first), first))
        for first in range(0, total, per_message)
    ]
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_send_message_length", 8 << 20)]
    ) as channel:
        stream = invocation_pb2_grpc.InvocationServiceStub(channel).InvokeTools()

        async def send() -> None:
            for message in messages:
                await stream.write(message)
            await stream.done_writing()

        return await _answered(stream, lambda response: len(response.results), send)


async def flood_dispatch(target: str, total: int) -> dict[str, Any]:
    """`total` requests for a session no host serves, in one DispatchToolRequests message."""
    requests = [
        bridge_pb2.ToolRequest(
            session_id=NOBODY, turn_id="t", tool_request_id=f"tr_{n}", tool_name="noop", timeout_ms=1000
        )
        for n in range(total)
    ]
    message = bridge_pb2.DispatchToolRequestsRequest(requests=requests)
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_send_message_length", 8 << 20)]
    ) as channel:
        stream = bridge_pb2_grpc.BridgeServiceStub(channel).DispatchToolRequests()

        async def send() -> None:
            await stream.write(message)
            await stream.done_writing()

        return await _answered(stream, lambda response: len(response.results), send)


async def _answered(
    stream: Any, count: Callable[[Any], int], send: Callable[[], Coroutine[Any, Any, None]]
) -> dict[str, Any]:
    """Send (in a task) and read the stream to its end: how many results, its status, how long."""
    print(FLOOD_SENDING, file=sys.stderr, flush=True)
    started = time.monotonic()
    sender = asyncio.create_task(send())
    answered, status = 0, "OK"
    try:
        async for response in stream:
            answered += count(response)
    except grpc.aio.AioRpcError as error:
        status = error.code().name
    sender.cancel()
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.UsageError):
        await sender
    return {"answered": answered, "stream_status": status, "seconds": time.monotonic() - started}


async def during(client: InvocationClient, *flood: str) -> dict[str, Any]:
    """Probe calls for as long as a flood runs, the flood in a process of its own."""
    child = await procs.start("flood", ["-m", "bench.faults", "flood", *flood], port_line=False)
    try:
        await child.wait_for(FLOOD_SENDING, timeout=120)
        samples = await probe_until(client, lambda: any(FLOOD_DONE in line for line in child.lines), PROBERS)
        done = await child.wait_for(FLOOD_DONE + r" (.*)$", timeout=600)
    finally:
        await child.stop()
    return {"flood": json.loads(done.group(1)), "probe": latencies(samples)}


async def message(tree: Tree, sizes: Sizes) -> dict[str, Any]:
    async with running(tree) as system, InvocationClient(system.invocation.target) as client:
        for _ in range(50):
            await probe_call(client)  # warm
        deadline = time.monotonic() + sizes.probe_quiet_s
        quiet = latencies(await probe_until(client, lambda: time.monotonic() > deadline, PROBERS))
        target = system.invocation.target
        total = str(sizes.flood_calls)
        return {
            "quiet": quiet,
            "one_message": await during(client, "calls", target, total, total),
            "messages_of_1000": await during(client, "calls", target, total, "1000"),
            "one_dispatch_message": await during(client, "dispatch", system.bridge_internal, total),
        }


# -- unread: a stream caller that never reads --------------------------------------------------


async def unread(tree: Tree, sizes: Sizes) -> dict[str, Any]:
    async with running(tree) as system:
        pid = system.invocation.pid
        before = procs.memory_kb(pid)["VmRSS"]
        sent = 0
        stalled = False
        started = time.monotonic()
        async with grpc.aio.insecure_channel(system.invocation.target) as channel:
            stream = invocation_pb2_grpc.InvocationServiceStub(channel).InvokeTools()
            for first in range(0, sizes.unread_calls, 1000):
                write = asyncio.ensure_future(
                    stream.write(invocation_pb2.InvokeToolsRequest(calls=refused_calls(1000, first)))
                )
                finished, _ = await asyncio.wait({write}, timeout=5)
                if not finished:
                    stalled = True  # the service takes no more: the transport's window is full
                    break
                sent += 1000
            peak = await _settled_rss(pid)
            stream.cancel()
            write.cancel()
        return {
            "calls_sent": sent,
            "sends_stalled": stalled,
            "seconds": time.monotonic() - started,
            "rss_before_mb": before / 1024,
            "rss_growth_mb": (peak - before) / 1024,
            "rss_kb_per_call_sent": (peak - before) / sent if sent else 0.0,
        }


async def _settled_rss(pid: int, quiet_s: float = 2.0, limit_s: float = 120.0) -> int:
    """The process's VmRSS once it stopped growing for `quiet_s` (the service done with what it took)."""
    give_up = time.monotonic() + limit_s
    highest = procs.memory_kb(pid)["VmRSS"]
    grew_at = time.monotonic()
    while time.monotonic() < give_up and time.monotonic() - grew_at < quiet_s:
        await asyncio.sleep(0.2)
        now = procs.memory_kb(pid)["VmRSS"]
        if now > highest + 256:
            highest, grew_at = now, time.monotonic()
    return max(highest, procs.memory_kb(pid)["VmRSS"])


# -- recovery: a dependency restarted -----------------------------------------------------------


async def recovery(tree: Tree, sizes: Sizes) -> dict[str, Any]:
    async with running(tree) as system, InvocationClient(system.invocation.target) as client:
        samples: list[Sample] = []
        stop = asyncio.Event()
        prober = asyncio.create_task(_probe_into(client, samples, stop))
        try:
            await _wait_for(samples, 0.0, lambda s: s.code == "OK", 10)
            system.registry.process.kill()
            await system.registry.stop()
            await asyncio.sleep(sizes.registry_outage_s)
            await system.start_registry()
            back = time.monotonic()
            registry_ok = await _wait_for(samples, back, lambda s: s.code == "OK", 60)
            registry_codes = Counter(s.code for s in samples if s.at > back and s.at < back + registry_ok)

            system.bridge.process.kill()
            await system.bridge.stop()
            await asyncio.sleep(sizes.bridge_outage_s)
            await system.start_bridge()
            back = time.monotonic()
            bridge_reached = await _wait_for(samples, back, lambda s: s.code != "BRIDGE_UNAVAILABLE", 60)
            bridge_ok = await _wait_for(samples, back, lambda s: s.code == "OK", 60)
            bridge_codes = Counter(s.code for s in samples if s.at > back and s.at < back + bridge_ok)
        finally:
            stop.set()
            await prober
        return {
            "registry_outage_s": sizes.registry_outage_s,
            "registry_back_to_ok_s": registry_ok,
            "registry_codes_meanwhile": dict(registry_codes),
            "bridge_outage_s": sizes.bridge_outage_s,
            "bridge_back_to_reached_s": bridge_reached,
            "bridge_back_to_ok_s": bridge_ok,
            "bridge_codes_meanwhile": dict(bridge_codes),
        }


async def _probe_into(client: InvocationClient, samples: list[Sample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(await probe_call(client, timeout=1.0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.02)


async def _wait_for(
    samples: list[Sample], after: float, holds: Callable[[Sample], bool], limit_s: float
) -> float:
    """Seconds from `after` to the end of the first probe call ending after it for which `holds`."""
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        for sample in samples:
            if sample.at > after and holds(sample):
                return sample.at - after
        await asyncio.sleep(0.01)
    return float("inf")


# -- routing: hosts that do not read their stream ----------------------------------------------


async def routing(tree: Tree, sizes: Sizes) -> dict[str, Any]:
    async with running(tree) as system:
        stalled = await procs.start(
            "stalled",
            ["-m", "bench.faults", "stall", system.bridge.target, SESSION, str(sizes.stalled_hosts)],
            env=tree.env,
            port_line=False,
        )
        try:
            await stalled.wait_for(STALLED_READY)
            rounds = []
            async with InvocationClient(system.invocation.target) as client:
                for round_number in range(2):
                    started = time.monotonic()
                    results = await asyncio.gather(
                        *(
                            client.invoke(
                                SESSION,
                                "noop",
                                {"n": n, "round": round_number, "run": uuid.uuid4().hex},
                                turn_id="t",
                                timeout=10,
                            )
                            for n in range(sizes.routed_calls)
                        )
                    )
                    codes = Counter(
                        r.outcome.code
                        if r.outcome is not None
                        else (r.code.value if r.code else "NO_OUTCOME")
                        for r in results
                    )
                    rounds.append({"codes": dict(codes), "seconds": time.monotonic() - started})
        finally:
            await stalled.stop()
        return {"stalled_hosts": sizes.stalled_hosts, "calls_per_round": sizes.routed_calls, "rounds": rounds}


async def stall(bridge: str, session: str, count: int) -> None:
    """`count` host sessions that read their first event (opened), then never another."""
    channel = grpc.aio.insecure_channel(bridge)
    stub = bridge_pb2_grpc.BridgeServiceStub(channel)
    calls = []
    for n in range(count):
        call = stub.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(
                session_id=session, host_name=f"stalled-{n}", handler_names=["noop"]
            )
        )
        await call.read()
        calls.append(call)
    print(STALLED_READY, file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    for call in calls:
        call.cancel()
    await channel.close()


# -- the run -----------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Tree, Sizes], Awaitable[dict[str, Any]]]] = {
    "message": message,
    "unread": unread,
    "recovery": recovery,
    "routing": routing,
}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if value == float("inf") else f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(results: dict[str, dict[str, Any]], labels: list[str]) -> str:
    lines = []
    for scenario in SCENARIOS:
        if not any(scenario in results[label] for label in labels):
            continue
        lines.append(f"\n== {scenario}")
        lines.append("| figure | " + " | ".join(labels) + " |")
        lines.append("| --- |" + " --- |" * len(labels))
        rows: dict[str, list[str]] = {}
        for column, label in enumerate(labels):
            for key, value in _flatten(results[label].get(scenario, {})).items():
                rows.setdefault(key, [""] * len(labels))[column] = _fmt(value)
        lines += [f"| {key} | " + " | ".join(values) + " |" for key, values in rows.items()]
    return "\n".join(lines)


def _flatten(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict) and not (key in ("codes",) or key.endswith("_meanwhile")):
            flat |= _flatten(item, f"{name}.")
        elif isinstance(item, list):
            for index, entry in enumerate(item):
                flat |= (
                    _flatten(entry, f"{name}[{index}].")
                    if isinstance(entry, dict)
                    else {f"{name}[{index}]": entry}
                )
        elif isinstance(item, dict):
            flat[name] = ", ".join(f"{code} {count}" for code, count in sorted(item.items()))
        else:
            flat[name] = item
    return flat


async def run(args: argparse.Namespace, sizes: Sizes) -> dict[str, dict[str, Any]]:
    """Each scenario on each tree, the baseline's first: the figures by tree, then scenario."""
    scenarios = [s for s in SCENARIOS if not args.only or s in args.only.split(",")]
    with tempfile.TemporaryDirectory(prefix="toolmesh-baseline-") as directory:
        trees = [Tree("this tree")]
        if args.baseline != "none":
            trees.insert(0, baseline(args.baseline, Path(directory)))
        results: dict[str, dict[str, Any]] = {tree.label: {} for tree in trees}
        for scenario in scenarios:
            for tree in trees:
                print(f"{scenario}: {tree.label} ...", file=sys.stderr, flush=True)
                results[tree.label][scenario] = await RUNNERS[scenario](tree, sizes)
    return results


async def flood(kind: str, target: str, total: int, per_message: int) -> None:
    """A child process's flood, its figures printed as one JSON line."""
    if kind == "calls":
        figures = await flood_calls(target, total, per_message)
    else:
        figures = await flood_dispatch(target, total)
    print(f"{FLOOD_DONE} {json.dumps(figures)}", file=sys.stderr, flush=True)


def main() -> None:
    # The helpers a run starts as processes of their own.
    if len(sys.argv) > 1 and sys.argv[1] == "stall":
        bridge, session, count = sys.argv[2], sys.argv[3], int(sys.argv[4])
        asyncio.run(stall(bridge, session, count))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "flood":
        kind, target, total = sys.argv[2], sys.argv[3], int(sys.argv[4])
        asyncio.run(flood(kind, target, total, int(sys.argv[5]) if len(sys.argv) > 5 else total))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.faults")
    parser.add_argument("--baseline", default="main", help="git ref of the baseline's services, or 'none'")
    parser.add_argument("--only", default="", help=f"comma-separated scenarios of {', '.join(SCENARIOS)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it all runs")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    load_before = os.getloadavg()
    results = asyncio.run(run(args, sizes))
    load_after = os.getloadavg()
    print(table(results, list(results)))
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    written = out / f"faults-{'quick-' if args.quick else ''}{stamp}.json"
    written.write_text(json.dumps({"sizes": sizes.__dict__, "results": results}, indent=2, default=str))
    print(f"written to {written}")


if __name__ == "__main__":
    main()
