"""Where each microsecond of a call goes, by process and stage: `python -m bench.stages`.

Starts the toolmesh system as `python -m bench` does (registry, bridge,
invocation, a `bench.host`, the caller in this process), then, for each way of
calling (`sequential`: unary `InvokeTool` calls one at a time; `unary` and
`stream`: `InvokeTool` calls, and calls on one `InvokeTools` stream, with 64 in
flight for a window) makes its calls while py-spy samples every process
(`--format raw`, 250 Hz), and reads each process's CPU time over the same calls.

Each sample is put in a stage by its stack: the innermost frame that a rule of
STAGES names decides (a helper such as JSON or protobuf conversion counts for
the stage that called it). A stack that no rule names, under the event loop, is
gRPC's core and the loop themselves (C and Cython, which py-spy does not see
into). Samples waiting in `select` and in gRPC's poller thread are idle and left
out. A stage's microseconds per call are its share of the process's busy
samples times the process's CPU per call: shares, not timings, so they hold on a
busy machine too (the load average is printed).

`python -m bench.stages --from DIR` attributes profiles recorded before
(`python -m bench --only latency --profile DIR`), without CPU figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench import measure, procs
from bench.profile_summary import _short

IDLE = "idle"
# The processes in the order a call goes through them (the registry is off its path: a cache).
CALL_ORDER = ("caller", "invocation", "bridge", "host")
MACHINERY = "gRPC core and event loop (C, Cython)"
OTHER = "other Python"

# (stage, file, function prefix): a frame `function (file)` is in the stage when its file ends
# with `file` and its function starts with the prefix ("" for any). The first rule that names a
# frame wins, so the more specific come first. Common to every process, after its own (PROCESS_STAGES).
COMMON = (
    ("admission (token, grant)", "auth/guard.py", ""),
    ("admission (token, grant)", "auth/tokens.py", ""),
    ("admission (token, grant)", "auth/service.py", ""),
    ("telemetry and logs (tracing off)", "core/telemetry.py", ""),
    ("telemetry and logs (tracing off)", "core/correlation.py", ""),
    ("telemetry and logs (tracing off)", "invocation/observability.py", ""),
    ("telemetry and logs (tracing off)", "bridge/observability.py", ""),
    ("telemetry and logs (tracing off)", "logging/__init__.py", ""),
    # A request stream's reads (gRPC's, under the check of each message as it arrives).
    ("request stream reads (gRPC)", "runtime/decoding.py", "_checked"),
    ("decoding (protobuf in, field checks)", "runtime/decoding.py", ""),
    ("server wrapping (span, statuses)", "runtime/instrument.py", ""),
    ("server wrapping (span, statuses)", "runtime/relay.py", ""),
    ("bench's own caller loop", "bench/measure.py", ""),
    ("bench's own caller loop", "bench/run.py", ""),
)

PROCESS_STAGES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "invocation": (
        ("limits and quota lease", "invocation/quotas.py", ""),
        ("limits and quota lease", "rules/shares.py", ""),
        ("limits and quota lease", "rules/limits.py", ""),
        ("limits and quota lease", "store/memory.py", "Leases"),
        ("validation (arguments, result, pool decision)", "invocation/validation.py", ""),
        ("validation (arguments, result, pool decision)", "invocation/validation_pool.py", ""),
        ("validation (arguments, result, pool decision)", "invocation/invoker.py", "parse_arguments"),
        ("validation (arguments, result, pool decision)", "invocation/invoker.py", "check_"),
        ("validation (arguments, result, pool decision)", "core/names.py", ""),
        ("tool lookup (registry cache)", "invocation/catalog_cache.py", ""),
        ("tool lookup (registry cache)", "invocation/remote.py", "RemoteCatalog"),
        ("tool lookup (registry cache)", "invocation/remote.py", "RegistryReplicas"),
        ("ledger claim (id, identity, record)", "contracts/ledger.py", "Ledger.claim"),
        ("ledger claim (id, identity, record)", "contracts/ledger.py", "Ledger.retry_safe_until"),
        ("ledger claim (id, identity, record)", "invocation/invoker.py", "Invoker._invoke_valid.<locals>"),
        ("ledger claim (id, identity, record)", "invocation/invoker.py", "new_tool_request_id"),
        ("ledger finish", "contracts/ledger.py", "Ledger.finish"),
        ("ledger finish", "contracts/ledger.py", "Ledger._finished"),
        ("ledger confirm", "contracts/ledger.py", "Ledger.confirm"),
        ("ledger confirm", "contracts/ledger.py", "Ledger.permitted"),
        ("ledger claim (id, identity, record)", "contracts/ledger.py", ""),
        ("routing (session's bridge replica)", "invocation/remote.py", "RoutedDispatcher"),
        ("dispatch stream to the bridge", "invocation/remote.py", ""),
        ("dispatch stream to the bridge", "core/stream_link.py", ""),
        ("dispatch stream to the bridge", "core/outbox.py", ""),
        ("dispatch stream to the bridge", "grpc/aio/_call.py", "_Stream"),
        ("outcome back (response, early id)", "invocation/messages.py", "response_to_pb"),
        ("outcome back (response, early id)", "invocation/servicer.py", "EarlyId"),
        ("decoding (protobuf in, field checks)", "invocation/messages.py", ""),
        ("invoker's steps (tasks, shields, futures)", "invocation/invoker.py", ""),
        ("invoker's steps (tasks, shields, futures)", "invocation/call_stream.py", ""),
        ("invoker's steps (tasks, shields, futures)", "invocation/servicer.py", ""),
    ),
    "bridge": (
        ("dispatch stream from the invocation service", "bridge/dispatch_stream.py", ""),
        ("dispatch stream from the invocation service", "bridge/servicer.py", "BridgeServicer.Dispatch"),
        ("routing to a host (router)", "bridge/router.py", ""),
        ("result submission (SubmitToolResult)", "bridge/servicer.py", "submit"),
        ("result submission (SubmitToolResult)", "bridge/servicer.py", "BridgeServicer.SubmitToolResult"),
        ("result submission (SubmitToolResult)", "bridge/outcomes.py", ""),
        ("result submission (SubmitToolResult)", "bridge/acceptance.py", ""),
        ("host stream (requests out)", "bridge/servicer.py", ""),
        ("host stream (requests out)", "core/outbox.py", ""),
    ),
    "host": (
        ("submit: gRPC unary call", "grpc/aio/_call.py", "Unary"),
        ("submit: gRPC unary call", "grpc/aio/_channel.py", ""),
        ("host stream (reading requests)", "grpc/aio/_call.py", "_Stream"),
        ("host stream (reading requests)", "host/engine.py", "HostEngine._read"),
        ("host stream (reading requests)", "host/engine.py", "HostEngine._on_event"),
        ("submit (result to protobuf)", "host/engine.py", "HostEngine._submit"),
        ("submit (result to protobuf)", "host/results.py", ""),
        ("running the handler", "host/engine.py", "HostEngine._execute"),
        ("running the handler", "host/engine.py", "HostEngine._begin"),
        ("running the handler", "host/engine.py", "HostEngine._progress"),
        ("running the handler", "bench/handlers.py", ""),
        ("host's own steps (tasks)", "host/", ""),
    ),
    "caller": (
        ("gRPC unary call (client side)", "grpc/aio/_call.py", "Unary"),
        ("gRPC unary call (client side)", "grpc/aio/_channel.py", ""),
        ("InvokeTools stream", "grpc/aio/_call.py", "_Stream"),
        ("InvokeTools stream", "client/call_link.py", ""),
        ("InvokeTools stream", "core/stream_link.py", ""),
        ("InvokeTools stream", "core/outbox.py", ""),
        ("client: request, confirmations, outcome", "client/", ""),
    ),
}


def frames_of(stack: str) -> list[str]:
    """A collapsed stack's frames, root first, each as `function (short/path.py)`."""
    return [_short(frame) for frame in stack.split(";")]


def stage_of(frames: list[str], rules: tuple[tuple[str, str, str], ...]) -> str:
    """The stage of one sample's stack (`frames` as frames_of gives them)."""
    leaf = frames[-1] if frames else ""
    if leaf.startswith("EpollSelector.select") or leaf.startswith("Thread.run"):
        return IDLE
    for frame in reversed(frames):
        name, _, where = frame.partition(" (")
        where = where.rstrip(")")
        for stage, file, prefix in rules:
            if (where.endswith(file) or (file.endswith("/") and file in where)) and name.startswith(prefix):
                return stage
    return MACHINERY if "(asyncio/" in leaf or "(grpc/" in leaf else OTHER


def attribute(path: Path, process: str) -> collections.Counter[str]:
    """Samples by stage in one py-spy raw file (collapsed stacks and their counts)."""
    rules = PROCESS_STAGES.get(process, ()) + COMMON
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            counts[stage_of(frames_of(stack), rules)] += int(count_text)
    return counts


def breakdown(directory: Path, label: str, cpu_ms: dict[str, float] | None) -> dict[str, Any]:
    """Each process's stages: share of its busy samples and, with `cpu_ms`, microseconds per call."""
    out: dict[str, Any] = {}
    for path in sorted(directory.glob(f"{label}-*.txt")):
        process = path.stem[len(label) + 1 :]
        counts = attribute(path, process)
        busy = sum(count for stage, count in counts.items() if stage != IDLE)
        if busy == 0:
            continue
        stages = {
            stage: {"share": count / busy}
            | ({"us_per_call": count / busy * cpu_ms[process] * 1000} if cpu_ms else {})
            for stage, count in counts.most_common()
            if stage != IDLE
        }
        out[process] = {"busy_samples": busy, "stages": stages}
        if cpu_ms:
            out[process]["cpu_us_per_call"] = cpu_ms[process] * 1000
    return out


def table(figures: dict[str, Any]) -> str:
    lines: list[str] = []
    for way, measured in figures["ways"].items():
        lines.append(
            f"{way}: {measured.get('calls_per_s', 0):.0f} calls/s"
            + (" (1 / p50)" if way == "sequential" else f" with {figures['concurrency']} in flight")
            + ", "
            f"CPU {measured.get('cpu_us_per_call', {}).get('total', 0):.0f} us/call in all"
        )
        lines.append(f"  {'process':<11} {'stage':<48} {'share':>6} {'us/call':>8}")
        for process, each in measured["processes"].items():
            for stage, numbers in each["stages"].items():
                us = numbers.get("us_per_call")
                lines.append(
                    f"  {process:<11} {stage:<48} {numbers['share']:>6.1%} "
                    + (f"{us:>8.1f}" if us is not None else f"{'':>8}")
                )
            if "cpu_us_per_call" in each:
                lines.append(
                    f"  {process:<11} {'= CPU per call':<48} {'':>6} {each['cpu_us_per_call']:>8.1f}"
                )
        lines.append("")
    return "\n".join(lines)


def markdown(figures: dict[str, Any]) -> str:
    """One table for every way measured: each process's stages, microseconds per call and share."""
    ways = list(figures["ways"])
    lines = [
        "| process | stage | " + " | ".join(f"{way}: us/call (share)" for way in ways) + " |",
        "| --- | --- | " + " | ".join("---" for _ in ways) + " |",
    ]
    processes: dict[str, list[str]] = {}
    for measured in figures["ways"].values():
        for process, each in measured["processes"].items():
            known = processes.setdefault(process, [])
            known += [stage for stage in each["stages"] if stage not in known]
    order = {name: index for index, name in enumerate(CALL_ORDER)}
    for process, names in sorted(processes.items(), key=lambda item: order.get(item[0], len(order))):
        first = figures["ways"][ways[0]]["processes"].get(process, {"stages": {}})["stages"]
        names.sort(key=lambda stage: -first.get(stage, {"share": 0.0})["share"])
        for stage in [*names, "= CPU per call"]:
            cells = []
            for way in ways:
                each = figures["ways"][way]["processes"].get(process)
                if each is None:
                    cells.append("")
                elif stage == "= CPU per call":
                    cells.append(f"**{each.get('cpu_us_per_call', 0):.0f}**")
                elif stage in each["stages"]:
                    numbers = each["stages"][stage]
                    cells.append(f"{numbers.get('us_per_call', 0):.0f} ({numbers['share']:.0%})")
                else:
                    cells.append("-")
            lines.append(f"| {process} | {stage} | " + " | ".join(cells) + " |")
    totals = [f"**{figures['ways'][way].get('cpu_us_per_call', {}).get('total', 0):.0f}**" for way in ways]
    lines.append("| all | CPU per call | " + " | ".join(totals) + " |")
    return "\n".join(lines)


async def measure_stages(
    ways: list[str], seconds: float, concurrency: int, calls: int, directory: Path
) -> dict[str, Any]:
    from bench import run, running  # noqa: PLC0415 - starts the system under test

    figures: dict[str, Any] = {"concurrency": concurrency, "seconds": seconds, "ways": {}}
    async with running.running_toolmesh() as system:
        pids = {name: pid for name, pid in system.pids.items() if name != "registry"}

        def cpu() -> dict[str, float]:
            return {name: procs.cpu_seconds(pid) for name, pid in pids.items()}

        for way in ways:
            call = system.calls["toolmesh-stream" if way == "stream" else "toolmesh"]
            if way == "sequential":
                await measure.sequential_samples(call, 200)  # warm-up
                with run.Profiler(directory).attach(way, pids):
                    before = cpu()
                    samples = await measure.sequential_samples(call, calls)
                    after = cpu()
                measured = measure.summary(samples)
                per_call = {name: (after[name] - before[name]) * 1000 / calls for name in pids}
                measured["cpu_ms_per_call"] = per_call | {"total": sum(per_call.values())}
                measured["calls_per_s"] = 1000 / measured["p50_ms"]
            else:
                await measure.throughput(call, concurrency, 1.0, 0.5)  # warm-up
                with run.Profiler(directory).attach(way, pids):
                    measured = await measure.throughput(call, concurrency, seconds, 1.0, cpu)
            cpu_ms = {name: value for name, value in measured["cpu_ms_per_call"].items() if name != "total"}
            figures["ways"][way] = {
                "calls_per_s": measured["calls_per_s"],
                "cpu_us_per_call": {
                    name: value * 1000 for name, value in measured["cpu_ms_per_call"].items()
                },
                "processes": breakdown(directory, way, cpu_ms),
            }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages")
    parser.add_argument(
        "--ways",
        default="sequential,unary,stream",
        help="sequential (unary calls one at a time), unary and stream (64 in flight): %(default)s",
    )
    parser.add_argument("--calls", type=int, default=2000, help="sequential calls (%(default)s)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/toolmesh-stages"), help="py-spy's files")
    parser.add_argument("--from", dest="source", type=Path, help="attribute profiles recorded before")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--markdown", action="store_true", help="one table of every way, in Markdown")
    args = parser.parse_args()
    if args.source is not None:
        labels = sorted({path.stem.split("-", 1)[0] for path in args.source.glob("*-*.txt")})
        figures = {
            "concurrency": "?",
            "ways": {label: {"processes": breakdown(args.source, label, None)} for label in labels},
        }
    else:
        load_before = " ".join(f"{value:.2f}" for value in os.getloadavg())
        ways = [way.strip() for way in args.ways.split(",")]
        figures = asyncio.run(measure_stages(ways, args.seconds, args.concurrency, args.calls, args.dir))
        figures["load"] = f"{load_before} before, {' '.join(f'{v:.2f}' for v in os.getloadavg())} after"
        print(f"load average {figures['load']} ({os.cpu_count()} CPUs)", file=sys.stderr)
    print(markdown(figures) if args.markdown else table(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
