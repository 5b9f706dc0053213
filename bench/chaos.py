"""`python -m bench.chaos`: load under random faults, and a checker over the whole history.

As Jepsen tests databases: two replicas of each service (registry, bridge,
invocation) as separate processes, two bench hosts of one session (each
listing both bridge replicas, in opposite orders), and a private Redis
(append-only, `appendfsync always`) for all of them, each on ports a restart
reuses. Callers keep CONCURRENCY calls in flight, three in four to a
non-idempotent tool and one in four to a read-only one, each with arguments of
its own, each attempt through one of the two invocation replicas at random;
a call that ends without an outcome is retried exactly (the same arguments:
it joins or replays the same invocation) until it gets one, for up to
RETRY_BUDGET_S. Meanwhile, every 2 to 5 s, one process that is up (a service,
a host or Redis) is SIGKILLed and started again, or SIGSTOPped for 2 to 20 s
and then SIGCONTed. Then faults stop, every process is up again, the calls
still retrying end, and the checker reads the history: every attempt's
answer (with the machine's clock) and every execution the hosts recorded
(bench.handlers.chaos appends start, end or cancellation per execution to a
file per host process, on the same clock).

What it counts (the targets of issue 23 are all 0):
- duplicates: executions beyond the first of a non-idempotent call (read-only
  ones may be sent again on purpose: shown apart);
- lost outcomes: an ok answer that is not the result of the call's one
  execution, or a call whose execution ended with its result before any deadline
  its invocation can have had (the tool's timeout after the call began) and
  which never got that result (an error outcome, or no outcome within the retry budget)
  nor, after a TOOL_TIMEOUT, found it kept late in the ledger (a caller answered
  TOOL_TIMEOUT reconciles as an agent would: GetInvocation until the host's late
  result shows, kept beside the timeout or recorded as the outcome (the timeout's
  write lost to it after an outage of the store), or its late window is over;
  those found are counted apart, as outcomes kept late); those with every bridge
  replica down as the handler ended
  are shown apart too. Not counted, but shown apart: results that died with
  their host, whose host process was SIGKILLed after the handler ended and
  before any bridge replica was up again, or within 5 ms of the end, before the
  result could be on its way (HAND_IN_S) (the result was only in that process;
  the caller is told it may have run, which is true);
- answers past deadline: attempts that took longer than the caller's timeout
  and a second (nothing may hang);
- untyped errors: an error whose code is not in the error table, INTERNAL,
  or a call that raised;
- starts after TOOL_TIMEOUT: a handler starting after its caller was answered TOOL_TIMEOUT;
- TOOL_HOST_DISCONNECTED for requests that never started (no start recorded
  for that tool request id);
- REGISTRY_UNAVAILABLE while one registry replica of two was down (the other up, and Redis).

It prints a table and writes the figures, the faults and examples as JSON to bench/results/.

    .venv/bin/python -m bench.chaos --seconds 300 --seed 7
    .venv/bin/python -m bench.chaos --quick        # 20 s of load, a smoke test
    .venv/bin/python -m bench.chaos --check bench/results/chaos-T.json   # its history checked again
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bench import procs
from bench.host import READY
from bench.procs import free_port
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.errors import ERROR_TABLE, Code, code_for_reason
from toolmesh.core.outcome import Outcome
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.host.engine import LATE_SUBMIT_S

RESULTS = Path(__file__).resolve().parent / "results"
SESSION = "chaos"
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"key": {"type": "string"}, "ms": {"type": "integer"}},
        "required": ["key", "ms"],
    }
)
TOOL_TIMEOUT_MS = 5000
TOOLS = [
    ToolSpec("chaos_write", "Not idempotent", SCHEMA, timeout_ms=TOOL_TIMEOUT_MS),
    ToolSpec(
        "chaos_read",
        "Read-only",
        SCHEMA,
        timeout_ms=TOOL_TIMEOUT_MS,
        annotations=ToolAnnotations(read_only=True),
    ),
]
CONCURRENCY = 32
RETRY_BUDGET_S = 60.0
# Each attempt's own deadline: past the tool's and the ledger's owner-lost grace after it.
CALLER_TIMEOUT_S = 12.0
# An attempt answered later than its deadline by more than this hung.
HANG_SLACK_S = 1.0
# A caller answered TOOL_TIMEOUT looks the invocation up this often, for as long as a host may
# still hand its result in late (the host SDK's LATE_SUBMIT_S past the deadline) and a margin.
RECONCILE_EVERY_S = 2.0
RECONCILE_FOR_S = LATE_SUBMIT_S + 10.0
# How long a handler takes, in ms.
HANDLER_MS = (20, 800)
# A host SIGKILLed this soon after a handler ended took the result with it: the SDK sends a result
# at the end of the event loop's turn in which the handler returned, and bytes still in a killed
# process, or in flight from it as its connection is reset, never reach the bridge.
HAND_IN_S = 0.005
FAULT_EVERY_S = (2.0, 5.0)
PAUSE_S = (2.0, 20.0)
SERVICES = ("registry", "bridge", "invocation")
BRIDGES = ("bridge0", "bridge1")
# A process started again is given this long to be ready: a loaded machine takes its time.
READY_S = 90.0


@dataclass(frozen=True)
class Settings:
    seconds: float
    seed: int
    concurrency: int = CONCURRENCY
    retry_budget_s: float = RETRY_BUDGET_S


# -- the processes ------------------------------------------------------------------------------


class RedisProcess:
    """A private redis-server: append-only, fsync on every write, its files in `directory`, one port."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("bench.chaos needs redis-server on the PATH")
        self.process = await asyncio.create_subprocess_exec(
            binary,
            *("--port", str(self.port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.directory)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        give_up = time.monotonic() + 20
        while time.monotonic() < give_up:
            client = Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
            try:
                if await client.ping():
                    return
            except (RedisError, OSError):
                if self.process.returncode is not None:
                    raise RuntimeError("redis-server exited") from None
                await asyncio.sleep(0.05)
            finally:
                await client.aclose()
        raise RuntimeError("redis-server did not answer")


@dataclass
class Member:
    """One process of the system under test, and how to start it again on the same ports."""

    name: str
    args: list[str]
    env: dict[str, str]
    proc: procs.Proc | RedisProcess | None = None
    # Where its output goes, every start appended (None: nowhere).
    log: Path | None = None
    # Set while it is down (killed and not ready again, or stopped): faults pick among the others.
    down: bool = False

    @property
    def kind(self) -> str:
        return self.name.rstrip("0123456789")

    @property
    def pid(self) -> int:
        proc = self.proc
        assert proc is not None and proc.process is not None
        return proc.process.pid

    async def start(self) -> None:
        if isinstance(self.proc, RedisProcess):
            await self.proc.start()
            return
        is_host = self.kind == "host"
        self.proc = await procs.start(
            self.name, self.args, env=self.env, port_line=not is_host, ready_s=READY_S, log=self.log
        )
        if is_host:
            await self.proc.wait_for(READY, timeout=READY_S)

    async def kill(self) -> None:
        proc = self.proc
        assert proc is not None and proc.process is not None
        with contextlib.suppress(ProcessLookupError):
            proc.process.send_signal(signal.SIGKILL)
        await proc.process.wait()
        if isinstance(proc, procs.Proc):
            await proc.stop()  # the output drains end

    def signal(self, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.process is None or proc.process.returncode is not None:
            return
        self.signal(signal.SIGCONT)
        if isinstance(proc, procs.Proc):
            await proc.stop()
        else:
            await self.kill()


@dataclass
class System:
    members: dict[str, Member]
    redis: RedisProcess
    invocation_targets: list[str]
    registry_target: str
    executions: list[Path]

    def members_of(self, kind: str) -> list[Member]:
        return [member for member in self.members.values() if member.kind == kind]


def _ports() -> dict[str, int]:
    names = [f"{service}{index}" for service in SERVICES for index in range(2)]
    names += [f"{name}-internal" for name in names if not name.startswith("invocation")]
    return {name: free_port() for name in names}


async def start_system(directory: Path, logs: Path | None = None) -> System:
    """Every process on free ports, their state in a private Redis under `directory`; with `logs`,
    each service's and host's output in `logs/<name>.log` (the services log ids, never arguments)."""
    redis = RedisProcess(directory)
    env = {"TOOLMESH_STORE": redis.url, "TOOLMESH_STORE_PREFIX": "chaos:"}
    ports = _ports()

    def listen(name: str) -> list[str]:
        served = ["--listen", f"127.0.0.1:{ports[name]}"]
        if name.startswith("invocation"):
            return served
        return [*served, "--internal-listen", f"127.0.0.1:{ports[name + '-internal']}"]

    registries = ",".join(f"127.0.0.1:{ports[f'registry{i}-internal']}" for i in range(2))
    bridges = [f"127.0.0.1:{ports[f'bridge{i}']}" for i in range(2)]
    members: dict[str, Member] = {"redis": Member("redis", [], {}, redis)}
    for index in range(2):
        name = f"registry{index}"
        members[name] = Member(name, ["-m", "toolmesh.registry", *listen(name)], env)
    for index in range(2):
        name = f"bridge{index}"
        args = ["-m", "toolmesh.bridge", *listen(name), "--web-listen", "off"]
        args += ["--registry", f"127.0.0.1:{ports[f'registry{index}-internal']}"]
        members[name] = Member(name, args, env)
    for index in range(2):
        name = f"invocation{index}"
        args = ["-m", "toolmesh.invocation", *listen(name), "--registry", registries]
        args += ["--bridge", f"127.0.0.1:{ports[f'bridge{index}-internal']}"]
        members[name] = Member(name, args, env)
    executions = []
    for index in range(2):
        name = f"host{index}"
        executions.append(directory / f"executions-{name}.jsonl")
        order = bridges if index == 0 else bridges[::-1]
        args = ["-m", "bench.host", "--bridge", ",".join(order), "--session", SESSION]
        members[name] = Member(name, args, env | {"BENCH_EXECUTIONS_FILE": str(executions[-1])})
    if logs is not None:  # made by main()
        for member in members.values():
            if member.kind != "redis":
                member.log = logs / f"{member.name}.log"
    system = System(
        members,
        redis,
        [f"127.0.0.1:{ports[f'invocation{i}']}" for i in range(2)],
        f"127.0.0.1:{ports['registry0']}",
        executions,
    )
    try:
        for member in members.values():
            if member.kind != "host":
                await member.start()
        async with RegistryClient(system.registry_target) as registry:
            await registry.put_tools(SESSION, TOOLS)
        for member in system.members_of("host"):
            await member.start()
    except BaseException:
        await stop_system(system)
        raise
    return system


async def stop_system(system: System) -> None:
    for member in reversed(list(system.members.values())):
        with contextlib.suppress(Exception):
            await member.stop()


# -- faults -------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str  # "kill" (SIGKILL, then started again) or "pause" (SIGSTOP, then SIGCONT)
    target: str
    at: float  # wall clock, when it began
    until: float = 0.0  # when the process was up again (ready, or continued)
    failed: str = ""  # why it could not be started again, if it could not


class Faults:
    """A fault every FAULT_EVERY_S at random on a process that is up, until stopped."""

    def __init__(self, system: System, rng: random.Random) -> None:
        self._system = system
        self._rng = rng
        self.history: list[Fault] = []
        self._under_way: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._rng.uniform(*FAULT_EVERY_S))
            if stop.is_set():
                break
            up = [member for member in self._system.members.values() if not member.down]
            if not up:
                continue
            member = self._rng.choice(up)
            kind = self._rng.choice(("kill", "pause"))
            pause_s = self._rng.uniform(*PAUSE_S)
            task = asyncio.create_task(self._inflict(member, kind, pause_s))
            self._under_way.add(task)
            task.add_done_callback(self._under_way.discard)
        if self._under_way:  # every pause ends and every restart completes
            await asyncio.wait(set(self._under_way))

    async def _inflict(self, member: Member, kind: str, pause_s: float) -> None:
        fault = Fault(kind, member.name, time.time())
        self.history.append(fault)
        member.down = True
        try:
            if kind == "pause":
                member.signal(signal.SIGSTOP)
                await asyncio.sleep(pause_s)
                member.signal(signal.SIGCONT)
            else:
                await member.kill()
                for attempt in range(3):
                    try:
                        await member.start()
                        break
                    except RuntimeError as error:  # a port not free yet, say: try again
                        fault.failed = str(error)[:200]
                        await asyncio.sleep(1 + attempt)
        finally:
            fault.until = time.time()
            member.down = False


# -- load ---------------------------------------------------------------------------------------


@dataclass
class Attempt:
    replica: int
    started: float
    ended: float
    # The outcome's code ("OK" for a result), or the no-outcome code; "RAISED" when the call raised.
    code: str
    outcome: bool
    tool_request_id: str | None = None
    execution: str | None = None  # which execution an ok answer says it is the result of
    owner_lost: bool = False
    joined: bool = False
    replayed: bool = False


@dataclass
class Late:
    """What GetInvocation showed, after the call was answered TOOL_TIMEOUT, of the host's late result."""

    at: float  # when it was read (or the lookups gave up)
    code: str | None = None  # "OK" or the late outcome's error code; None: none came
    execution: str | None = None  # which execution a late result says it is the result of


@dataclass
class Call:
    key: str
    tool: str
    started: float
    attempts: list[Attempt] = field(default_factory=list)
    late: Late | None = None

    @property
    def final(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None


class Load:
    def __init__(self, targets: list[str], settings: Settings, rng: random.Random) -> None:
        self._clients = [InvocationClient(target) for target in targets]
        self._settings = settings
        self._rng = rng
        self.calls: list[Call] = []
        self._counter = 0
        self._reconciling: set[asyncio.Task[None]] = set()

    async def run(self, until: float) -> None:
        await asyncio.gather(*(self._caller(until) for _ in range(self._settings.concurrency)))
        if self._reconciling:
            await asyncio.wait(set(self._reconciling))

    async def _caller(self, until: float) -> None:
        while time.time() < until:
            self._counter += 1
            tool = "chaos_write" if self._rng.random() < 0.75 else "chaos_read"
            call = Call(f"c{self._counter}-{self._rng.getrandbits(32):08x}", tool, time.time())
            self.calls.append(call)
            arguments = {"key": call.key, "ms": self._rng.randint(*HANDLER_MS)}
            await self._until_outcome(call, arguments)
            final = call.final
            if final is not None and final.code == Code.TOOL_TIMEOUT.value and final.tool_request_id:
                # Beside the next call, as an agent's reconciliation does not hold its next turn.
                task = asyncio.create_task(self._reconcile(call, final.tool_request_id))
                self._reconciling.add(task)
                task.add_done_callback(self._reconciling.discard)

    async def _reconcile(self, call: Call, tool_request_id: str) -> None:
        """GetInvocation until the host's late result shows, or its late window is over."""
        give_up = time.time() + RECONCILE_FOR_S
        while True:
            await asyncio.sleep(RECONCILE_EVERY_S)
            client = self._clients[self._rng.randrange(len(self._clients))]
            try:
                invocation = await client.get_invocation(tool_request_id)
            except grpc.aio.AioRpcError:
                invocation = None  # a replica down, or the store: ask again
            late = invocation.late_outcome if invocation is not None else None
            if late is None and invocation is not None and invocation.outcome is not None:
                # The host's result recorded first (the replica that answered TOOL_TIMEOUT could not
                # write it: the store was out, and its write lost once it was back).
                late = invocation.outcome if invocation.outcome.code != Code.TOOL_TIMEOUT.value else None
            if late is not None:
                call.late = Late(time.time(), *_answer_of(late))
                return
            if time.time() > give_up:
                call.late = Late(time.time())
                return

    async def _until_outcome(self, call: Call, arguments: dict[str, Any]) -> None:
        pause = 0.1
        while True:
            replica = self._rng.randrange(len(self._clients))
            attempt = await self._attempt(replica, call, arguments)
            call.attempts.append(attempt)
            if attempt.outcome or attempt.code == "RAISED":
                return
            if time.time() - call.started > self._settings.retry_budget_s:
                return
            await asyncio.sleep(self._rng.uniform(pause / 2, pause))
            pause = min(pause * 2, 2.0)

    async def _attempt(self, replica: int, call: Call, arguments: dict[str, Any]) -> Attempt:
        started = time.time()
        try:
            result = await self._clients[replica].invoke(
                SESSION, call.tool, arguments, turn_id="chaos", timeout=CALLER_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            return Attempt(replica, started, time.time(), "RAISED", outcome=False)
        ended = time.time()
        outcome = result.outcome
        if outcome is None:
            code = (result.code or Code.TRANSPORT_FAILED).value
            return Attempt(replica, started, ended, code, False, result.tool_request_id)
        failure = outcome.failure
        code, execution = _answer_of(outcome)
        owner_lost = failure is not None and bool((failure.details or {}).get("ownerLost"))
        return Attempt(
            replica,
            started,
            ended,
            code,
            True,
            result.tool_request_id,
            execution,
            owner_lost,
            result.joined,
            result.replayed,
        )

    async def close(self) -> None:
        for client in self._clients:
            await client.close()


def _answer_of(outcome: Outcome) -> tuple[str, str | None]:
    """An outcome's code ("OK" for a result) and, for a result, the execution it names."""
    if outcome.failure is not None:
        return outcome.failure.code, None
    with contextlib.suppress(ValueError, TypeError, KeyError):
        return "OK", json.loads(outcome.result_json or "")["execution"]
    return "OK", None


# -- the checker --------------------------------------------------------------------------------


@dataclass
class Execution:
    key: str
    tool_request_id: str
    execution: str
    started: float
    ended: float | None = None
    ended_left_s: float = 0.0
    cancelled: bool = False
    host: str = ""  # the host process that ran it ("" in a history older than this field)


def read_executions(paths: list[Path]) -> dict[str, list[Execution]]:
    """Every execution the hosts recorded, by call key (a line cut by a SIGKILL is passed over)."""
    runs: dict[str, Execution] = {}
    for path in paths:
        if not path.exists():
            continue
        host = path.stem.removeprefix("executions-")
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            execution = event["execution"]
            if event["event"] == "start":
                runs[execution] = Execution(
                    event["key"], event["toolRequestId"], execution, event["at"], host=host
                )
            elif execution in runs:
                runs[execution].ended = event["at"]
                runs[execution].ended_left_s = event["leftS"]
                runs[execution].cancelled = event["event"] == "cancelled"
    by_key: dict[str, list[Execution]] = {}
    for run in runs.values():
        by_key.setdefault(run.key, []).append(run)
    return by_key


def _down_intervals(faults: list[Fault], kinds: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    down: dict[str, list[tuple[float, float]]] = {}
    for fault in faults:
        if fault.target.startswith(kinds):
            down.setdefault(fault.target, []).append((fault.at, fault.until or time.time()))
    return down


def _one_of_two_down(down: dict[str, list[tuple[float, float]]], start: float, end: float) -> bool:
    """Whether, during [start, end], one registry replica was down and the other up throughout, and
    Redis too (the registries read their tools there: with Redis down, neither can answer)."""
    names = ("registry0", "registry1", "redis")
    overlapping = {n: [iv for iv in down.get(n, []) if iv[0] < end and iv[1] > start] for n in names}
    return sum(1 for n in names[:2] if overlapping[n]) == 1 and not overlapping["redis"]


def _all_down(down: dict[str, list[tuple[float, float]]], at: float, names: tuple[str, ...]) -> bool:
    """Whether every process of `names` was down (SIGSTOPped, or killed and not ready yet) at `at`."""
    return all(any(start <= at <= end for start, end in down.get(name, [])) for name in names)


def _covered(intervals: list[tuple[float, float]], start: float, end: float) -> bool:
    """Whether `intervals` together cover all of [start, end]."""
    reached = start
    for begin, until in sorted(intervals):
        if begin > reached:
            break
        reached = max(reached, until)
        if reached >= end:
            return True
    return reached >= end


def typed(code: str) -> bool:
    if code == "RAISED":
        return False
    known = code_for_reason(code)
    return known is not None and known in ERROR_TABLE and known is not Code.INTERNAL


class Checker:
    """Counts each figure over calls, keeping a few examples of each with the faults under way."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self.figures: Counter[str] = Counter()
        self.examples: dict[str, list[dict[str, Any]]] = {}
        self.codes: Counter[str] = Counter()
        self._registry_down = _down_intervals(faults, ("registry", "redis"))
        self._bridges_down = _down_intervals(faults, ("bridge",))
        self._kills: dict[str, list[float]] = {}
        for fault in faults:
            if fault.kind == "kill":
                self._kills.setdefault(fault.target, []).append(fault.at)

    def died_with_host(self, run: Execution) -> bool:
        """Whether its host process was SIGKILLed after the handler ended and before any bridge
        replica was up again, or within HAND_IN_S of the end: the result was only in that
        process, with nowhere to hand it in or no time to."""
        ended = run.ended or 0.0
        kills = [at for at in self._kills.get(run.host, []) if at >= ended]
        return bool(kills) and (
            min(kills) - ended <= HAND_IN_S
            or all(_covered(self._bridges_down.get(bridge, []), ended, min(kills)) for bridge in BRIDGES)
        )

    def faults_during(self, call: Call) -> list[str]:
        """The faults under way while the call ran, timed from its start."""
        ended = call.final.ended if call.final is not None else call.started
        return [
            f"{f.kind} {f.target} {f.at - call.started:+.1f}s..{f.until - call.started:+.1f}s"
            for f in self.faults
            if f.at <= ended and (f.until or ended) >= call.started
        ]

    def example(self, figure: str, call: Call, **more: Any) -> None:
        self.figures[figure] += 1
        kept = self.examples.setdefault(figure, [])
        if len(kept) < 5:
            during = self.faults_during(call)
            kept.append({"key": call.key, "tool": call.tool, **more, "faultsDuring": during})

    def call(self, call: Call, runs: list[Execution]) -> None:
        self.figures[f"calls {call.tool}"] += 1
        self.figures["attempts"] += len(call.attempts)
        if len(runs) > 1:
            figure = "duplicates (non-idempotent)" if call.tool == "chaos_write" else "re-runs (read-only)"
            for _ in runs[1:]:
                self.example(figure, call, toolRequestIds=[run.tool_request_id for run in runs])
        for attempt in call.attempts:
            self.attempt(call, attempt, runs)
        timed_out = [a for a in call.attempts if a.code == Code.TOOL_TIMEOUT.value and a.tool_request_id]
        for attempt in timed_out[:1]:
            for run in runs:
                if run.tool_request_id == attempt.tool_request_id and run.started > attempt.ended:
                    late = round(run.started - attempt.ended, 3)
                    lost = attempt.owner_lost
                    self.example("starts after TOOL_TIMEOUT", call, secondsAfter=late, ownerLost=lost)
        self.final(call, runs)

    def attempt(self, call: Call, attempt: Attempt, runs: list[Execution]) -> None:
        self.codes[attempt.code] += 1
        if attempt.ended - attempt.started > CALLER_TIMEOUT_S + HANG_SLACK_S:
            self.example("answers past deadline", call, seconds=round(attempt.ended - attempt.started, 2))
        if attempt.code != "OK" and not typed(attempt.code):
            self.example("untyped errors", call, code=attempt.code)
        if attempt.code == Code.TOOL_HOST_DISCONNECTED.value:
            self.figures["TOOL_HOST_DISCONNECTED"] += 1
            if not any(run.tool_request_id == attempt.tool_request_id for run in runs):
                never = "TOOL_HOST_DISCONNECTED never started"
                self.example(never, call, toolRequestId=attempt.tool_request_id)
        if attempt.code == Code.REGISTRY_UNAVAILABLE.value:
            self.figures["REGISTRY_UNAVAILABLE"] += 1
            if _one_of_two_down(self._registry_down, attempt.started, attempt.ended):
                self.example("REGISTRY_UNAVAILABLE one registry down", call)

    def final(self, call: Call, runs: list[Execution]) -> None:
        final = call.final
        if final is None:
            return
        if final.code == "OK":
            self.figures["calls ok"] += 1
            # One that ran twice is a duplicate (counted apart): its answer is still one of its runs'.
            if final.execution not in {run.execution for run in runs}:
                why = "an ok answer not of its one execution"
                self.example("lost outcomes", call, why=why, runs=len(runs))
        elif final.outcome:
            self.figures["calls ended with an error outcome"] += 1
        else:
            self.figures["calls without an outcome"] += 1
        # Ended with its result before any deadline its invocation can have had (claimed no sooner
        # than the call began): that result must be the answer.
        in_time = call.started + TOOL_TIMEOUT_MS / 1000
        finished = [
            run for run in runs if run.ended is not None and not run.cancelled and run.ended < in_time
        ]
        late = call.late
        if late is not None and late.code is not None:
            self.figures["outcomes kept late (GetInvocation)"] += 1
            if late.code == "OK" and late.execution not in {run.execution for run in runs}:
                self.example(
                    "lost outcomes", call, why="a late result not of its one execution", runs=len(runs)
                )
                return
        if finished and final.code != "OK":
            if late is not None and late.code == "OK":
                return  # answered TOOL_TIMEOUT (true: it may have run), and its result kept for lookup
            if self.died_with_host(finished[0]):
                # Answered that it may have run (true); no process of toolmesh ever had the result.
                self.example("results that died with their host", call, code=final.code)
                return
            self.example("lost outcomes", call, why=f"ran to its end in time, answered {final.code}")
            if _all_down(self._bridges_down, finished[0].ended or 0.0, BRIDGES):
                # Nowhere to hand the result in as it was made: the host holds it, and has until
                # the deadline (and its grace) for a bridge replica to come back.
                self.figures["lost outcomes with every bridge down"] += 1


def check(calls: list[Call], executions: dict[str, list[Execution]], faults: list[Fault]) -> dict[str, Any]:
    checker = Checker(faults)
    for call in calls:
        checker.call(call, executions.get(call.key, []))
    return {
        "figures": dict(checker.figures),
        "codes": dict(checker.codes.most_common()),
        "examples": checker.examples,
    }


# -- the run ------------------------------------------------------------------------------------

TARGET_FIGURES = (
    "duplicates (non-idempotent)",
    "lost outcomes",
    "answers past deadline",
    "untyped errors",
    "starts after TOOL_TIMEOUT",
    "TOOL_HOST_DISCONNECTED never started",
    "REGISTRY_UNAVAILABLE one registry down",
)
OTHER_FIGURES = (
    "calls chaos_write",
    "calls chaos_read",
    "attempts",
    "calls ok",
    "calls ended with an error outcome",
    "calls without an outcome",
    "lost outcomes with every bridge down",
    "outcomes kept late (GetInvocation)",
    "results that died with their host",
    "re-runs (read-only)",
    "TOOL_HOST_DISCONNECTED",
    "REGISTRY_UNAVAILABLE",
)


def fault_counts(faults: list[Fault]) -> dict[str, int]:
    counted = Counter(f"{fault.kind} {fault.target.rstrip('0123456789')}" for fault in faults)
    return dict(sorted(counted.items()))


def table(checked: dict[str, Any], faults: list[Fault], settings: Settings) -> Iterator[str]:
    figures = checked["figures"]
    load = checked.get("load_average")
    during = "" if load is None else f" (load average {load['before']:.1f} before, {load['after']:.1f} after)"
    yield f"chaos: {settings.seconds:g} s of load, seed {settings.seed}, {len(faults)} faults{during}"
    yield f"  {'figure (target 0)':<42} {'count':>8}"
    for name in TARGET_FIGURES:
        yield f"  {name:<42} {figures.get(name, 0):>8}"
    yield f"  {'other figures':<42} {'count':>8}"
    for name in OTHER_FIGURES:
        yield f"  {name:<42} {figures.get(name, 0):>8}"
    yield "  answers by code: " + ", ".join(f"{code} {n}" for code, n in checked["codes"].items())
    yield "  faults: " + ", ".join(f"{kind} {n}" for kind, n in fault_counts(faults).items())
    tried_again = [fault for fault in faults if fault.failed]
    if tried_again:
        yield f"  restarts that took more than one try (a loaded machine): {len(tried_again)}"


async def run(settings: Settings, logs: Path | None = None) -> dict[str, Any]:
    rng = random.Random(settings.seed)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="toolmesh-chaos-") as tmp:
        directory = Path(tmp)
        system = await start_system(directory, logs)
        load = Load(system.invocation_targets, settings, random.Random(rng.getrandbits(64)))
        faults = Faults(system, random.Random(rng.getrandbits(64)))
        stop_faults = asyncio.Event()
        try:
            until = time.time() + settings.seconds
            faulting = asyncio.create_task(faults.run(stop_faults))
            loading = asyncio.create_task(load.run(until))
            await asyncio.sleep(settings.seconds)
            # New calls have stopped: the faults stop too, and the calls still retrying end.
            stop_faults.set()
            await faulting
            await loading
        finally:
            stop_faults.set()
            await load.close()
            await stop_system(system)
        executions = read_executions(system.executions)
    checked = check(load.calls, executions, faults.history)
    return {
        "settings": asdict(settings),
        **checked,
        # Anything else on the machine shows in every figure (processes slow to restart, timeouts).
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "faults": {"counts": fault_counts(faults.history), "history": [asdict(f) for f in faults.history]},
        # Enough to check again (--check FILE) or to look into a figure.
        "history": {
            "calls": [asdict(call) for call in load.calls],
            "executions": [asdict(run) for runs in executions.values() for run in runs],
        },
    }


def check_again(path: Path) -> Iterator[str]:
    """The table of an earlier run, its history checked by this checker."""
    results = json.loads(path.read_text())
    calls = [
        Call(
            c["key"],
            c["tool"],
            c["started"],
            [Attempt(**a) for a in c["attempts"]],
            Late(**c["late"]) if c.get("late") else None,
        )
        for c in results["history"]["calls"]
    ]
    executions: dict[str, list[Execution]] = {}
    for run in results["history"]["executions"]:
        executions.setdefault(run["key"], []).append(Execution(**run))
    faults = [Fault(**fault) for fault in results["faults"]["history"]]
    checked = check(calls, executions, faults) | {"load_average": results.get("load_average")}
    return table(checked, faults, Settings(**results["settings"]))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="how long the load and faults last")
    parser.add_argument("--seed", type=int, default=None, help="the random faults' and calls' seed")
    parser.add_argument("--quick", action="store_true", help="20 s of load: checks that it all runs")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes (%(default)s)")
    parser.add_argument("--check", type=Path, help="check the history of an earlier run's JSON again")
    parser.add_argument("--logs", type=Path, help="keep each process's output in DIR/<name>.log")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=CONCURRENCY,
        help="calls in flight (%(default)s; a few: each invocation replica runs them as calls alone)",
    )
    args = parser.parse_args()
    if args.check is not None:
        print("\n".join(check_again(args.check)))
        return
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    if args.concurrency < 1:
        parser.error("--concurrency is at least 1")
    settings = Settings(seconds=20.0 if args.quick else args.seconds, seed=seed, concurrency=args.concurrency)
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run(settings, args.logs))
    print("\n".join(table(results, [Fault(**f) for f in results["faults"]["history"]], settings)))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"chaos-{stamp}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"  figures written to {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
