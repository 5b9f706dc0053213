"""A/B: a baseline commit's services and SDK against this tree's, measured in alternating turns.

`python -m bench --only latency --ab REF [--rounds N]` extracts REF's
`clients/python/src` and `services/src` with `git archive` into a temporary
directory and starts three sides, each a child process (`python -m bench.ab
side KIND`) that runs its own system and its own caller: `floor` (the bare
grpc.aio chain), `baseline` (REF's code first on PYTHONPATH, for the side and
for every process it starts) and `head` (this tree). All three stay up; each
round measures each figure on each side in turn (floor, baseline, head,
floor, baseline, head, ...), so a change of load on the shared machine falls
on all of them alike. The table gives the median over rounds and, for head
against baseline, the median of the rounds' own ratios with their range.

CPU per call is read from /proc/PID/stat (utime + stime) of every process of
a side (its services, its host and its caller) around each measurement: on a
busy machine it moves much less than calls/s do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import loops, measure, procs, tracing

MARK = "ab-result "
READY = "ab-side ready"
SIDES = ("floor", "baseline", "head", "head-asyncio")
# With --standard-loop, a fourth side: this tree again, every process of it on the standard loop
# (the other sides run on uvloop where it is installed, as the services do: bench.loops).
STANDARD_LOOP_ENV = {"TOOLMESH_EVENT_LOOP": "asyncio"}
# What each round measures on each side: (figure group, way of calling, kind of measurement).
MEASUREMENTS = (("unary", "sequential"), ("unary", "throughput"), ("stream", "throughput"))
# The figures of one round on one side, from its measurements (see round_figures).
FIGURES = (
    ("unary p50 ms", "p50_ms"),
    ("unary p99 ms", "p99_ms"),
    ("unary calls/s", "calls_per_s"),
    ("stream calls/s", "stream_calls_per_s"),
    ("CPU ms/call, sequential unary", "cpu_ms"),
    ("CPU ms/call, unary under load", "load_cpu_ms"),
    ("CPU ms/call, stream under load", "stream_cpu_ms"),
)
# Ratios to the floor, each round's own: (label, figure of the side, figure of the floor).
VERSUS_FLOOR = (
    ("unary p50 / floor", "p50_ms", "p50_ms"),
    ("unary calls/s / floor", "calls_per_s", "calls_per_s"),
    # The floor has one way of calling; issue 6 compares the stream's calls/s to it too.
    ("stream calls/s / floor", "stream_calls_per_s", "calls_per_s"),
    ("CPU per call / floor", "cpu_ms", "cpu_ms"),
)


# --- the side: one system and its caller, measuring on request -------------------------------


@contextlib.asynccontextmanager
async def _system(kind: str) -> AsyncIterator[tuple[dict[str, measure.Call], dict[str, int]]]:
    from bench import running  # noqa: PLC0415 - imports the toolmesh code this side runs (PYTHONPATH)

    if kind == "floor":
        async with running.running_floor() as floor:
            call = floor.calls["floor"]
            yield {"unary": call, "stream": call}, floor.pids
    else:
        async with running.running_toolmesh() as system:
            yield {"unary": system.calls["toolmesh"], "stream": system.calls["toolmesh-stream"]}, system.pids


async def _serve(kind: str, warmup: int) -> None:
    async with _system(kind) as (calls, pids):

        def cpu() -> dict[str, float]:
            return {name: procs.cpu_seconds(pid) for name, pid in pids.items()}

        for call in set(calls.values()):
            await measure.sequential_samples(call, warmup)
        import toolmesh.client  # noqa: PLC0415 - which tree's code this side runs
        import toolmesh.invocation  # noqa: PLC0415

        print(READY, toolmesh.client.__file__, *toolmesh.invocation.__path__, flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            request = json.loads(line)
            call = calls[request["way"]]
            if request["op"] == "sequential":
                before = cpu()
                samples = await measure.sequential_samples(call, request["calls"])
                after = cpu()
                figures = measure.summary(samples)
                per_call = {name: (after[name] - before[name]) * 1000 / len(samples) for name in pids}
                figures["cpu_ms_per_call"] = per_call | {"total": sum(per_call.values())}
            else:
                figures = await measure.throughput(
                    call, request["concurrency"], request["seconds"], request["warmup_s"], cpu
                )
            print(MARK + json.dumps(figures), flush=True)


# --- the parent: the sides in turns ------------------------------------------------------------


@dataclass
class Side:
    name: str
    process: asyncio.subprocess.Process
    code: list[str] = field(default_factory=list)

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        await self.process.stdin.drain()
        while line := (await self.process.stdout.readline()).decode():
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK) :])
                return answer
        raise RuntimeError(f"the {self.name} side exited ({await self.process.wait()})")

    async def stop(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.is_closing():
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 60)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def _start(name: str, kind: str, env: dict[str, str], warmup: int) -> Side:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.ab",
        "side",
        kind,
        "--warmup",
        str(warmup),
        cwd=procs.REPO,
        env={**os.environ, **env},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    side = Side(name, process)
    assert process.stdout is not None
    while line := (await process.stdout.readline()).decode():
        if line.startswith(READY):
            # The code it runs: the baseline's must come from its extracted tree.
            side.code = line[len(READY) :].split()
            return side
    raise RuntimeError(f"the {name} side exited before it was ready ({await process.wait()})")


def round_figures(measured: dict[str, dict[str, Any]]) -> dict[str, float]:
    """One side's figures in one round, from its measurements keyed `way/kind`."""
    sequential = measured["unary/sequential"]
    unary = measured["unary/throughput"]
    stream = measured["stream/throughput"]
    return {
        "p50_ms": sequential["p50_ms"],
        "p99_ms": sequential["p99_ms"],
        "cpu_ms": sequential["cpu_ms_per_call"]["total"],
        "calls_per_s": unary["calls_per_s"],
        "load_cpu_ms": unary["cpu_ms_per_call"]["total"],
        "stream_calls_per_s": stream["calls_per_s"],
        "stream_cpu_ms": stream["cpu_ms_per_call"]["total"],
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: dict[str, list[dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """Medians over rounds by side, head/baseline and each side/floor as the median of the rounds'
    own ratios (with their range), and the CPU per sequential call by process."""
    figures = {side: [round_figures(measured) for measured in rounds[side]] for side in rounds}
    medians = {
        side: {key: statistics.median(each[key] for each in figures[side]) for _, key in FIGURES}
        for side in figures
    }
    out: dict[str, Any] = {"rounds": len(figures["head"]), "medians": medians}
    if "baseline" in figures:
        out["head/baseline"] = {
            key: _spread([h[key] / b[key] for h, b in zip(figures["head"], figures["baseline"], strict=True)])
            for _, key in FIGURES
        }
    if "head-asyncio" in figures:
        out["asyncio/head"] = {
            key: _spread(
                [u[key] / h[key] for u, h in zip(figures["head-asyncio"], figures["head"], strict=True)]
            )
            for _, key in FIGURES
        }
    if "floor" in figures:
        out["versus_floor"] = {
            side: {
                label: _spread(
                    [s[ours] / f[theirs] for s, f in zip(figures[side], figures["floor"], strict=True)]
                )
                for label, ours, theirs in VERSUS_FLOOR
            }
            for side in figures
            if side != "floor"
        }
    out["cpu_ms_by_process"] = {
        side: {
            process: statistics.median(
                measured["unary/sequential"]["cpu_ms_per_call"][process] for measured in rounds[side]
            )
            for process in rounds[side][0]["unary/sequential"]["cpu_ms_per_call"]
        }
        for side in rounds
    }
    return out


def _ratio(spread: dict[str, float]) -> str:
    return f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"


def table(results: dict[str, Any]) -> str:
    meta, summary = results["meta"], results["summary"]
    sides = [side for side in SIDES if side in summary["medians"]]
    names = {"floor": "floor", "baseline": meta["baseline"], "head": meta["head"], "head-asyncio": "asyncio"}
    lines = [
        f"A/B: {meta['baseline']} (baseline) against {meta['head']} (head), "
        f"medians of {summary['rounds']} rounds, sides in turns",
        f"  {meta['calls']} sequential calls, {meta['seconds']} s at {meta['concurrency']} in flight per "
        f"measurement; load average {meta['load_before']} before, {meta['load_after']} after "
        f"({meta['cpus']} CPUs)",
        *(
            [f"  tracing on: both toolmesh sides export their spans over OTLP ({meta['spans_received']})"]
            if meta.get("traced")
            else []
        ),
        *(
            [
                "  baseline side's environment: "
                + " ".join(f"{k}={v}" for k, v in meta["baseline_env"].items())
            ]
            if meta.get("baseline_env")
            else []
        ),
        "",
        f"  {'figure':<32}"
        + "".join(f"{names[side]:>14}" for side in sides)
        + f"{'head/baseline':>24}"
        + (f"{'asyncio/head':>24}" if "asyncio/head" in summary else ""),
    ]
    for label, key in FIGURES:
        row = f"  {label:<32}" + "".join(f"{summary['medians'][side][key]:>14.3f}" for side in sides)
        if "head/baseline" in summary:
            row += f"{_ratio(summary['head/baseline'][key]):>24}"
        if "asyncio/head" in summary:
            row += f"{_ratio(summary['asyncio/head'][key]):>24}"
        lines.append(row)
    if "versus_floor" in summary:
        lines.append("")
        ours = [side for side in sides if side != "floor"]
        lines.append(f"  {'ratio to the floor':<32}" + "".join(f"{names[side]:>24}" for side in ours))
        for label, _, _ in VERSUS_FLOOR:
            lines.append(
                f"  {label:<32}"
                + "".join(f"{_ratio(summary['versus_floor'][side][label]):>24}" for side in ours)
            )
    lines += ["", "  CPU ms per sequential unary call, by process (medians)"]
    by_process = summary["cpu_ms_by_process"]
    processes = list(by_process["head"])
    lines.append(f"  {'process':<32}" + "".join(f"{names[side]:>14}" for side in sides if side != "floor"))
    for process in processes:
        lines.append(
            f"  {process:<32}"
            + "".join(
                f"{by_process[side].get(process, float('nan')):>14.3f}" for side in sides if side != "floor"
            )
        )
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    """The run as a Markdown table (the README's Performance section): each figure's median by side,
    head/baseline (and asyncio/head) with the rounds' range, then each side against the floor."""
    meta, summary = results["meta"], results["summary"]
    sides = [side for side in SIDES if side in summary["medians"]]
    names = {
        "floor": "floor",
        "baseline": meta["baseline"],
        "head": meta["head"],
        "head-asyncio": "head on the standard loop",
    }
    ratios = [name for name in ("head/baseline", "asyncio/head") if name in summary]
    columns = [*(names[side] for side in sides), *ratios]
    lines = ["| | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for label, key in FIGURES:
        cells = [f"{summary['medians'][side][key]:.3f}" for side in sides]
        cells += [_ratio(summary[name][key]) for name in ratios]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, _, _ in VERSUS_FLOOR if "versus_floor" in summary else ():
        cells = ["" if side == "floor" else _ratio(summary["versus_floor"][side][label]) for side in sides]
        lines.append(f"| {label} | " + " | ".join([*cells, *([""] * len(ratios))]) + " |")
    return "\n".join(lines)


async def run(
    ref: str,
    *,
    rounds: int,
    calls: int,
    warmup: int,
    seconds: float,
    warmup_s: float,
    concurrency: int,
    head: str,
    load: Callable[[], str],
    traced: bool = False,
    standard_loop: bool = False,
    baseline_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """With `traced`, both toolmesh sides export their spans over OTLP to a receiver in this process;
    `baseline_env` is set in the baseline side's processes (the A/B of a setting, REF being HEAD)."""
    async with contextlib.AsyncExitStack() as stack:
        sink, exporting = (await stack.enter_async_context(tracing.otlp_receiver())) if traced else (None, {})
        results = await _run(
            ref,
            rounds=rounds,
            calls=calls,
            warmup=warmup,
            seconds=seconds,
            warmup_s=warmup_s,
            concurrency=concurrency,
            head=head,
            load=load,
            exporting=exporting,
            standard_loop=standard_loop,
            baseline_env=baseline_env or {},
        )
    if sink is not None:
        results["meta"]["spans_received"] = sink.spans
    return results


async def _run(
    ref: str,
    *,
    rounds: int,
    calls: int,
    warmup: int,
    seconds: float,
    warmup_s: float,
    concurrency: int,
    head: str,
    load: Callable[[], str],
    exporting: dict[str, str],
    standard_loop: bool,
    baseline_env: dict[str, str],
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "head": head,
        "calls": calls,
        "warmup": warmup,
        "seconds": seconds,
        "warmup_s": warmup_s,
        "concurrency": concurrency,
        "cpus": os.cpu_count(),
        "load_before": load(),
        "traced": bool(exporting),
        "baseline_env": baseline_env,
    }
    names = [side for side in SIDES if standard_loop or side != "head-asyncio"]
    measured: dict[str, list[dict[str, dict[str, Any]]]] = {side: [] for side in names}
    with tempfile.TemporaryDirectory(prefix="toolmesh-ab-") as directory:
        sha, extracted_env = procs.extract(ref, Path(directory))
        meta["baseline"] = sha
        environments = {
            "floor": {},
            "baseline": extracted_env | baseline_env | exporting,
            "head": exporting,
            "head-asyncio": STANDARD_LOOP_ENV | exporting,
        }
        sides: list[Side] = []
        try:
            for name in names:
                print(f"... A/B: starting the {name} side", file=sys.stderr, flush=True)
                sides.append(
                    await _start(name, "floor" if name == "floor" else "toolmesh", environments[name], warmup)
                )
            for side in sides:
                meta[f"{side.name}_code"] = side.code
                outside = [
                    path for path in side.code if (side.name == "baseline") != path.startswith(directory)
                ]
                if side.name != "floor" and outside:
                    raise RuntimeError(f"the {side.name} side runs code from the wrong tree: {outside}")
            for number in range(rounds):
                print(f"... A/B: round {number + 1} of {rounds}", file=sys.stderr, flush=True)
                this_round: dict[str, dict[str, dict[str, Any]]] = {side.name: {} for side in sides}
                for way, kind in MEASUREMENTS:
                    request: dict[str, Any] = {"op": kind, "way": way, "calls": calls}
                    request |= {"seconds": seconds, "warmup_s": warmup_s, "concurrency": concurrency}
                    for side in sides:
                        this_round[side.name][f"{way}/{kind}"] = await side.ask(request)
                for side in sides:
                    measured[side.name].append(this_round[side.name])
        finally:
            for side in sides:
                await side.stop()
    meta["load_after"] = load()
    return {"meta": meta, "rounds": measured, "summary": summarize(measured)}


def main(argv: list[str] | None = None) -> None:
    """`side KIND`: one side of a run (started by `python -m bench --ab`); `markdown FILE`: a saved
    run (bench/results/ab-*.json) as a Markdown table."""
    parser = argparse.ArgumentParser(prog="python -m bench.ab")
    roles = parser.add_subparsers(dest="role", required=True)
    side = roles.add_parser("side")
    side.add_argument("kind", choices=["floor", "toolmesh"])
    side.add_argument("--warmup", type=int, default=200)
    saved = roles.add_parser("markdown")
    saved.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    if args.role == "markdown":
        print(markdown(json.loads(args.file.read_text())))
        return
    loops.run(_serve(args.kind, args.warmup))


if __name__ == "__main__":
    main()
