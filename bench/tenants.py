"""`python -m bench.tenants`: one tenant's calls while another tenant exhausts a shared resource.

Each of issue 27's exhaustion attacks, replayed on a baseline commit's services
(default a4261de, the tree before the fair shares) and on this tree's, in one
run, the trees' turns alternating (the baseline first for odd attacks, this
tree first for even ones, so that a change in the machine's load does not fall
on one tree only). Every turn starts a system of its own with tokens on
(HS256, a shared secret made for the run; this tree's service token in
TOOLMESH_SERVICE_TOKEN, which the baseline ignores): registry, bridge (with
its web port), invocation and a `bench.host` serving the victim's session.

The victim (session `alpha-1`, a token of its own) makes sequential no-op
calls paced at VICTIM_RATE a second, quiet and then during the attack; the
attacker runs in a process of its own (`python -m bench.tenants attack ...`)
and reports its outcomes by code when it is stopped.

1. `inflight`: a `sessions: ["bravo*"]` token holds calls waiting on a slow
   tool (`hold`, never released) in three sessions (`bravo-1..3`, a host
   each). The baseline's process bound (20,000) is not settable; this tree
   runs with `calls_in_flight_per_grant` lowered (`--limit` on this tree
   only). The rate per caller is raised on both so that it is not what stops
   the attacker (both trees take these limits).
2. `subject`: tokens minted by each tree's own `toolmesh token` (the
   baseline's carry `sub: ""`), the rate per caller lowered on both to
   RATE_LIMIT a second; the attacker floods calls, the victim (under the rate
   itself) counts QUOTA_EXCEEDED. This tree also gets one call with a
   subject-less token (refused).
3. `mcp`: `toolmesh mcp --http` of each tree; the attacker sends many
   unauthenticated `initialize` + `tools/list` (each on a session id of its
   own) and keeps them open; then a valid tenant's `tools/list`.
4. `slow`: many connections to the bridge's web port from 127.0.0.2, each
   sending its request one byte a second; the victim's Connect call
   (`SubmitToolResult` for a request it does not have, answered
   REQUEST_UNKNOWN) from 127.0.0.1, each on a new connection, and the
   bridge's RSS.
5. `badtokens`: calls with invalid tokens (each a new one, so none is
   cached) as fast as the attacker can send them, against the invocation
   service: the victim's latency and the invocation process's CPU.

    .venv/bin/python -m bench.tenants                         # baseline a4261de, about 5 minutes
    .venv/bin/python -m bench.tenants --quick --baseline none # this tree alone, tiny sizes (the smoke test)
    .venv/bin/python -m bench.tenants --only inflight,slow
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench import procs
from bench.faults import RESULTS, Tree, baseline, latencies
from bench.host import READY
from bench.procs import Proc, free_port
from toolmesh.auth.grants import Role
from toolmesh.auth.tokens import DEFAULT_AUDIENCE, DEFAULT_ISSUER, mint
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc

ATTACKS = ("inflight", "subject", "mcp", "slow", "badtokens")
VICTIM = "alpha-1"
BRAVO = [f"bravo-{n}" for n in (1, 2, 3)]
CHARLIE = "charlie-1"  # the attacker's session in `subject`
SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
HOLD_SCHEMA = json.dumps({"type": "object", "properties": {"i": {"type": "integer"}}})
NOOP = [ToolSpec("noop", "Does nothing", SCHEMA, timeout_ms=2000)]
HOLD = [ToolSpec("hold", "Waits", HOLD_SCHEMA, timeout_ms=120_000)]
# The victim's calls a second: under the rate per caller of every attack (RATE_LIMIT in `subject`).
VICTIM_RATE = 50.0
RATE_LIMIT = 100
# Raised on both trees in `inflight`, so that the rate per caller does not stop the attacker first.
NO_RATE = "calls_per_second_per_caller=1000000,calls_burst_per_caller=1000000"
ATTACKER_ADDRESS = "127.0.0.2"  # `slow` connects from here, the victim from 127.0.0.1
ATTACK_READY = "attack: ready"
ATTACK_DONE = "attack: done"
ATTACK_PROGRESS = "attack: waiting, answered"


@dataclass(frozen=True)
class Sizes:
    quiet_s: float = 4.0
    attack_s: float = 6.0
    # inflight: calls the attacker sends, this tree's calls_in_flight_per_grant, the longest ramp.
    inflight_calls: int = 20_500
    inflight_share: int = 2_000
    inflight_ramp_s: float = 45.0
    flood_concurrency: int = 16
    mcp_sessions: int = 2_000
    slow_connections: int = 1_500
    badtoken_concurrency: int = 16


QUICK = Sizes(
    quiet_s=1.0,
    attack_s=1.5,
    inflight_calls=300,
    inflight_share=100,
    inflight_ramp_s=10.0,
    flood_concurrency=4,
    mcp_sessions=20,
    slow_connections=80,
    badtoken_concurrency=4,
)


@dataclass
class Keys:
    """What every process of a run shares: the token secret and this tree's service token."""

    secret: str = field(default_factory=lambda: secrets.token_hex(32))
    service_token: str = field(default_factory=lambda: secrets.token_hex(32))

    def token(self, role: Role, sessions: list[str], subject: str) -> str:
        return mint(self.secret.encode(), roles=[role], sessions=sessions, ttl_s=3600, subject=subject)

    def env(self, limits: str) -> dict[str, str]:
        env = {"TOOLMESH_AUTH_SECRET": self.secret, "TOOLMESH_SERVICE_TOKEN": self.service_token}
        return env | ({"TOOLMESH_LIMITS": limits} if limits else {})


def is_baseline(tree: Tree) -> bool:
    return tree.label.startswith("baseline")


# -- a system with tokens on --------------------------------------------------------------------


@dataclass
class System:
    registry: Proc
    bridge: Proc
    invocation: Proc
    web_port: int
    env: dict[str, str]
    procs: list[Proc]
    workdir: Path


@contextlib.asynccontextmanager
async def running(tree: Tree, keys: Keys, limits: str, holds: bool = False) -> AsyncIterator[System]:
    """Registry, bridge (web port), invocation and the victim's host; with `holds`, a host for each
    of BRAVO serving `hold` (never released: each call waits until the host stops)."""
    env = {**tree.env, **keys.env(limits)}
    ports = {name: free_port() for name in ("registry-internal", "bridge-internal", "web")}
    started: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="toolmesh-tenants-") as workdir:
        try:
            registry = await procs.start(
                "registry",
                [
                    "-m",
                    "toolmesh.registry",
                    "--listen",
                    "127.0.0.1:0",
                    "--internal-listen",
                    f"127.0.0.1:{ports['registry-internal']}",
                ],
                env=env,
            )
            started.append(registry)
            bridge = await procs.start(
                "bridge",
                [
                    "-m",
                    "toolmesh.bridge",
                    "--listen",
                    "127.0.0.1:0",
                    "--internal-listen",
                    f"127.0.0.1:{ports['bridge-internal']}",
                    "--web-listen",
                    f"127.0.0.1:{ports['web']}",
                    "--registry",
                    f"127.0.0.1:{ports['registry-internal']}",
                ],
                env=env,
            )
            started.append(bridge)
            invocation = await procs.start(
                "invocation",
                [
                    "-m",
                    "toolmesh.invocation",
                    "--listen",
                    "127.0.0.1:0",
                    "--registry",
                    f"127.0.0.1:{ports['registry-internal']}",
                    "--bridge",
                    f"127.0.0.1:{ports['bridge-internal']}",
                ],
                env=env,
            )
            started.append(invocation)
            admin = keys.token(Role.ADMIN, ["*"], "bench-admin")
            async with RegistryClient(registry.target, token=admin) as client:
                await client.put_tools(VICTIM, NOOP)
                await client.put_tools(CHARLIE, NOOP)
                for session in BRAVO if holds else []:
                    await client.put_tools(session, HOLD)
            hosts: list[tuple[str, str, dict[str, str]]] = [
                (VICTIM, keys.token(Role.HOST, [VICTIM], "alpha-host"), {})
            ]
            for session in BRAVO if holds else []:
                hold_env = {
                    "BENCH_HOLD_TARGET": str(10**9),
                    "BENCH_HOLD_LIMIT_S": "600",
                    "BENCH_ARRIVALS_FILE": str(Path(workdir) / f"{session}.arrivals"),
                }
                hosts.append((session, keys.token(Role.HOST, ["bravo*"], "bravo"), hold_env))
            for session, token, extra in hosts:
                host = await procs.start(
                    f"host-{session}",
                    ["-m", "bench.host", "--bridge", bridge.target, "--session", session],
                    env={**env, "TOOLMESH_TOKEN": token, **extra},
                    port_line=False,
                )
                started.append(host)
                await host.wait_for(READY)
            yield System(registry, bridge, invocation, ports["web"], env, started, Path(workdir))
        finally:
            await procs.stop_all(started)


# -- the victim --------------------------------------------------------------------------------


@dataclass
class Sample:
    at: float
    ms: float
    code: str


async def victim_call(client: InvocationClient) -> Sample:
    started = time.monotonic()
    try:
        result = await client.invoke(
            VICTIM, "noop", {"n": 1, "probe": uuid.uuid4().hex}, turn_id="probe", timeout=2.0
        )
        if result.outcome is not None:
            code = result.outcome.code
        else:
            code = result.code.value if result.code else "NO_OUTCOME"
    except grpc.aio.AioRpcError as error:
        found = error_code(error)
        code = found.value if found else error.code().name
    ended = time.monotonic()
    return Sample(ended, (ended - started) * 1000, code)


async def victim(client: InvocationClient, seconds: float, rate: float = VICTIM_RATE) -> list[Sample]:
    """Sequential calls, at most `rate` a second, for `seconds`."""
    samples: list[Sample] = []
    stop_at = time.monotonic() + seconds
    next_at = time.monotonic()
    while time.monotonic() < stop_at:
        samples.append(await victim_call(client))
        next_at = max(next_at + 1 / rate, time.monotonic() - 1 / rate)
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    return samples


def figures(samples: list[Sample]) -> dict[str, Any]:
    found = latencies(samples)  # type: ignore[arg-type]  # the same fields as bench.faults.Sample
    found["codes"] = dict(Counter(sample.code for sample in samples if sample.code != "OK"))
    return found


# -- the attacker, in a process of its own -----------------------------------------------------


async def attacker(tree: Tree, args: list[str], env: dict[str, str]) -> Proc:
    child = await procs.start(
        "attacker", ["-m", "bench.tenants", "attack", *args], env={**tree.env, **env}, port_line=False
    )
    await child.wait_for(ATTACK_READY, timeout=120)
    return child


async def stopped(child: Proc) -> dict[str, Any]:
    """Stop the attacker (SIGTERM) and read what it reported."""
    child.process.send_signal(signal.SIGTERM)
    try:
        done = await child.wait_for(ATTACK_DONE + r" (.*)$", timeout=60)
        report: dict[str, Any] = json.loads(done.group(1))
    except TimeoutError:
        report = {"error": "no report", "tail": child.tail(5)}
    await child.stop()
    return report


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


def _ready() -> None:
    print(ATTACK_READY, file=sys.stderr, flush=True)


def _rpc_code(error: grpc.aio.AioRpcError) -> str:
    found = error_code(error)
    return found.value if found else error.code().name


async def attack_inflight(target: str, token: str, calls: int) -> dict[str, Any]:
    """`calls` calls of `hold` over BRAVO at once, on one InvokeTools stream; the codes of those answered."""
    stop = _stop_event()
    codes: Counter[str] = Counter()
    async with InvocationClient(target, multiplex=True, token=token) as client:

        async def one(index: int) -> None:
            try:
                result = await client.invoke(BRAVO[index % 3], "hold", {"i": index}, turn_id="t", timeout=120)
                codes[
                    result.outcome.code if result.outcome else (result.code.value if result.code else "?")
                ] += 1
            except grpc.aio.AioRpcError as error:
                codes[_rpc_code(error)] += 1

        tasks = [asyncio.ensure_future(one(index)) for index in range(calls)]
        _ready()
        while not stop.is_set():
            waiting_now = sum(not task.done() for task in tasks)
            print(f"{ATTACK_PROGRESS} {waiting_now} {calls - waiting_now}", file=sys.stderr, flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        waiting = sum(not task.done() for task in tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"sent": calls, "waiting at the end": waiting, **dict(codes)}


async def attack_flood(target: str, token: str, concurrency: int) -> dict[str, Any]:
    """Calls of CHARLIE's noop with arguments its schema refuses, `concurrency` at a time, back to back."""
    stop = _stop_event()
    codes: Counter[str] = Counter()
    started = time.monotonic()
    async with InvocationClient(target, token=token) as client:

        async def loop() -> None:
            while not stop.is_set():
                try:
                    result = await client.invoke(CHARLIE, "noop", {"n": "x"}, turn_id="t", timeout=2)
                    codes[
                        result.outcome.code if result.outcome else (result.code.value if result.code else "?")
                    ] += 1
                except grpc.aio.AioRpcError as error:
                    codes[_rpc_code(error)] += 1

        _ready()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return {"calls_per_s": round(sum(codes.values()) / (time.monotonic() - started)), **dict(codes)}


async def attack_badtokens(target: str, concurrency: int) -> dict[str, Any]:
    """Unary InvokeTool calls, each with a new token signed by a secret the services do not know."""
    stop = _stop_event()
    codes: Counter[str] = Counter()
    wrong = secrets.token_hex(32).encode()
    request = invocation_pb2.InvokeToolRequest(
        session_id=VICTIM, turn_id="t", tool_name="noop", arguments_json='{"n":1}'
    )
    started = time.monotonic()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = invocation_pb2_grpc.InvocationServiceStub(channel)

        async def loop() -> None:
            while not stop.is_set():
                token = mint(
                    wrong, roles=[Role.CALL], sessions=[VICTIM], ttl_s=3600, subject=uuid.uuid4().hex
                )
                try:
                    await stub.InvokeTool(request, metadata=[("authorization", f"Bearer {token}")], timeout=2)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as error:
                    codes[_rpc_code(error)] += 1

        _ready()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return {"calls_per_s": round(sum(codes.values()) / (time.monotonic() - started)), **dict(codes)}


MCP_ACCEPT = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
MCP_VERSION = "2025-06-18"


def _jsonrpc(response: httpx.Response) -> dict[str, Any]:
    """The JSON-RPC message of a response, as JSON or as the first SSE data line."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data:"):
                found: dict[str, Any] = json.loads(line[5:])
                return found
        return {}
    try:
        found = response.json()
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _outcome(response: httpx.Response) -> str:
    message = _jsonrpc(response)
    if "error" in message:
        return f"HTTP {response.status_code} error {message['error'].get('code')}"
    if "result" in message and isinstance(message["result"], dict) and message["result"].get("isError"):
        return f"HTTP {response.status_code} isError"
    return f"HTTP {response.status_code}"


async def mcp_tools_list(
    http: httpx.AsyncClient, base: str, session: str, token: str | None
) -> tuple[str, str, int]:
    """initialize, initialized, tools/list on `session`: initialize's outcome, tools/list's, tools listed."""
    url = f"{base}/sessions/{session}/mcp"
    headers = dict(MCP_ACCEPT) | ({"authorization": f"Bearer {token}"} if token else {})
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": MCP_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "bench", "version": "0"},
        },
    }
    first = await http.post(url, json=initialize, headers=headers)
    opened = _outcome(first)
    mcp_session = first.headers.get("mcp-session-id")
    if mcp_session is None:
        return opened, "-", 0
    headers |= {"mcp-session-id": mcp_session, "mcp-protocol-version": MCP_VERSION}
    await http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers)
    listed = await http.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, headers=headers)
    result = _jsonrpc(listed).get("result")
    tools = len(result.get("tools", [])) if isinstance(result, dict) else 0
    return opened, _outcome(listed), tools


async def attack_mcp(base: str, sessions: int, concurrency: int) -> dict[str, Any]:
    """`sessions` unauthenticated initialize + tools/list, each on a session id of its own, left open."""
    stop = _stop_event()
    codes: Counter[str] = Counter()
    pending = iter(range(sessions))
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as http:

        async def loop() -> None:
            for index in pending:
                if stop.is_set():
                    return
                try:
                    opened, listed, _ = await mcp_tools_list(http, base, f"mallory-{index}", None)
                    codes[f"initialize {opened}"] += 1
                    codes[f"tools/list {listed}"] += 1
                except httpx.HTTPError as error:
                    codes[type(error).__name__] += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        _ready()
        await stop.wait()
    return dict(codes)


async def attack_slow(host: str, port: int, connections: int) -> dict[str, Any]:
    """`connections` connections from ATTACKER_ADDRESS, each sending its request a byte a second."""
    stop = _stop_event()
    codes: Counter[str] = Counter()
    request = (
        f"POST /toolmesh.v1.BridgeService/SubmitToolResult HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    ).encode()
    open_now = 0
    lasted: list[float] = []

    async def one() -> None:
        nonlocal open_now
        started = time.monotonic()
        try:
            _, writer = await asyncio.open_connection(host, port, local_addr=(ATTACKER_ADDRESS, 0))
        except OSError as error:
            codes[f"connect failed {type(error).__name__}"] += 1
            return
        open_now += 1
        try:
            for byte in request:
                if stop.is_set():
                    codes["open at the end"] += 1
                    return
                writer.write(bytes([byte]))
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
            codes["sent whole"] += 1
        except OSError:
            codes["closed by the server"] += 1
            lasted.append(time.monotonic() - started)
        finally:
            open_now -= 1
            writer.close()

    tasks = [asyncio.ensure_future(one()) for _ in range(connections)]
    await asyncio.sleep(1.0)
    _ready()
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    if lasted:
        codes["closed after s (median)"] = round(sorted(lasted)[len(lasted) // 2])
    return dict(codes)


def attack_main(argv: list[str]) -> None:
    kind = argv[0]
    runners: dict[str, Callable[[], Coroutine[Any, Any, dict[str, Any]]]] = {
        "inflight": lambda: attack_inflight(argv[1], argv[2], int(argv[3])),
        "flood": lambda: attack_flood(argv[1], argv[2], int(argv[3])),
        "badtokens": lambda: attack_badtokens(argv[1], int(argv[2])),
        "mcp": lambda: attack_mcp(argv[1], int(argv[2]), int(argv[3])),
        "slow": lambda: attack_slow(argv[1], int(argv[2]), int(argv[3])),
    }
    report = asyncio.run(runners[kind]())
    print(f"{ATTACK_DONE} {json.dumps(report)}", file=sys.stderr, flush=True)


# -- the attacks, one tree's turn each ------------------------------------------------------------


def _cpu(pid: int) -> float:
    return procs.cpu_seconds(pid)


async def turn(
    tree: Tree,
    keys: Keys,
    sizes: Sizes,
    *,
    limits: str = "",
    holds: bool = False,
    victim_token: str | None = None,
    start_attack: Callable[[System], Awaitable[Proc]],
    after_start: Callable[[System, Proc], Awaitable[dict[str, Any]]] | None = None,
    during_extra: Callable[[System], Awaitable[dict[str, Any]]] | None = None,
    quiet_extra: Callable[[System], Awaitable[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The victim quiet, the attack started (and settled), the victim during it, the attacker's report."""
    async with running(tree, keys, limits, holds) as system:
        token = victim_token or keys.token(Role.CALL, [VICTIM], "alpha")
        async with InvocationClient(system.invocation.target, token=token) as client:
            for _ in range(30):
                await victim_call(client)  # warm, and the victim's token in the cache
            cpu_at, quiet_from = _cpu(system.invocation.pid), time.monotonic()
            quiet = figures(await victim(client, sizes.quiet_s))
            quiet["invocation_cpu"] = (_cpu(system.invocation.pid) - cpu_at) / (time.monotonic() - quiet_from)
            result: dict[str, Any] = {"quiet": quiet}
            if quiet_extra is not None:
                result["quiet_extra"] = await quiet_extra(system)
            child = await start_attack(system)
            try:
                if after_start is not None:
                    result["settled"] = await after_start(system, child)
                cpu_at, during_from = _cpu(system.invocation.pid), time.monotonic()
                extra_task = asyncio.ensure_future(during_extra(system)) if during_extra else None
                during = figures(await victim(client, sizes.attack_s))
                during["invocation_cpu"] = (_cpu(system.invocation.pid) - cpu_at) / (
                    time.monotonic() - during_from
                )
                result["during"] = during
                if extra_task is not None:
                    result["during_extra"] = await extra_task
            finally:
                result["attacker"] = await stopped(child)
            result["rss_mb"] = {
                name: procs.memory_kb(proc.pid)["VmHWM"] / 1024
                for name, proc in (
                    ("registry", system.registry),
                    ("bridge", system.bridge),
                    ("invocation", system.invocation),
                )
            }
        quiet_p99, during_p99 = result["quiet"]["p99_ms"], result["during"]["p99_ms"]
        result["p99_ratio"] = during_p99 / quiet_p99 if quiet_p99 else float("nan")
        return result


async def inflight(tree: Tree, keys: Keys, sizes: Sizes) -> dict[str, Any]:
    limits = NO_RATE if is_baseline(tree) else f"{NO_RATE},calls_in_flight_per_grant={sizes.inflight_share}"
    token = keys.token(Role.CALL, ["bravo*"], "bravo")

    async def start(system: System) -> Proc:
        args = ["inflight", system.invocation.target, token, str(sizes.inflight_calls)]
        return await attacker(tree, args, system.env)

    async def settle(system: System, child: Proc) -> dict[str, Any]:
        """Wait until the attacker's calls waiting and answered stop changing (2 s), or inflight_ramp_s."""
        started = time.monotonic()
        progress: list[str] = []
        since = time.monotonic()
        while time.monotonic() - started < sizes.inflight_ramp_s:
            lines = [line for line in child.lines if line.startswith(ATTACK_PROGRESS)]
            now = lines[-1].split()[-2:] if lines else []
            arrived = sum(_arrivals(system.workdir / f"{session}.arrivals") for session in BRAVO)
            now.append(str(arrived))  # the baseline answers none: its hosts' count is what moves
            if now != progress:
                progress, since = now, time.monotonic()
            elif time.monotonic() - since > 2.0 and (arrived or progress[1:2] != ["0"]):
                break
            await asyncio.sleep(0.25)
        held = sum(_arrivals(system.workdir / f"{session}.arrivals") for session in BRAVO)
        waiting, answered = (int(n) for n in progress[:2]) if len(progress) == 3 else (0, 0)
        return {
            "waiting": waiting,
            "answered": answered,
            "arrived_at_hosts (in 50s)": held,
            "ramp_s": time.monotonic() - started,
        }

    result = await turn(tree, keys, sizes, limits=limits, holds=True, start_attack=start, after_start=settle)
    result["limits"] = limits
    return result


def _arrivals(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def cli_token(tree: Tree, keys: Keys, session: str) -> str:
    """A call token for `session` as the tree's own `toolmesh token` mints it (no --subject given)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.tenants",
            "command",
            "toolmesh.auth.command",
            "token",
            "--role",
            "call",
            "--session",
            session,
        ],
        env={**os.environ, **tree.env, "TOOLMESH_AUTH_SECRET": keys.secret},
        cwd=procs.REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def subject_of(token: str) -> str:
    import base64  # noqa: PLC0415 - only here

    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return repr(claims.get("sub"))


async def subject(tree: Tree, keys: Keys, sizes: Sizes) -> dict[str, Any]:
    limits = f"calls_per_second_per_caller={RATE_LIMIT},calls_burst_per_caller={RATE_LIMIT}"
    victim_token = cli_token(tree, keys, VICTIM)
    attacker_token = cli_token(tree, keys, CHARLIE)

    async def start(system: System) -> Proc:
        args = ["flood", system.invocation.target, attacker_token, str(sizes.flood_concurrency)]
        return await attacker(tree, args, system.env)

    async def subjectless(system: System) -> dict[str, Any]:
        """One call with a token whose sub is "" (as the baseline's `toolmesh token` mints them)."""
        token = _subjectless(keys)
        async with InvocationClient(system.invocation.target, token=token) as client:
            return {"subject-less token's call": (await victim_call(client)).code}

    result = await turn(
        tree,
        keys,
        sizes,
        limits=limits,
        victim_token=victim_token,
        start_attack=start,
        quiet_extra=subjectless,
    )
    result["subjects"] = {"victim": subject_of(victim_token), "attacker": subject_of(attacker_token)}
    result["limits"] = limits
    return result


def _subjectless(keys: Keys) -> str:
    import jwt  # noqa: PLC0415 - only here

    now = int(time.time())
    claims = {
        "iss": DEFAULT_ISSUER,
        "aud": DEFAULT_AUDIENCE,
        "sub": "",
        "iat": now,
        "exp": now + 3600,
        "roles": ["call"],
        "sessions": [VICTIM],
    }
    return jwt.encode(claims, keys.secret.encode(), algorithm="HS256")


async def mcp(tree: Tree, keys: Keys, sizes: Sizes) -> dict[str, Any]:
    gateway: dict[str, Any] = {}

    async def start(system: System) -> Proc:
        proc = await procs.start(
            "mcp-gateway",
            [
                "-m",
                "bench.tenants",
                "command",
                "toolmesh.cli.mcp",
                "mcp",
                "--http",
                "--listen",
                "127.0.0.1:0",
                "--registry",
                system.registry.target,
                "--invocation",
                system.invocation.target,
            ],
            env=system.env,
            port_line=False,
        )
        system.procs.append(proc)
        match = await proc.wait_for(r"serving (http://127\.0\.0\.1:\d+)/sessions/")
        gateway["base"], gateway["proc"] = match.group(1), proc
        gateway["quiet"] = await tenant_lists(gateway["base"], 3)
        args = ["mcp", gateway["base"], str(sizes.mcp_sessions), str(sizes.flood_concurrency)]
        return await attacker(tree, args, system.env)

    async def tenant_lists(base: str, count: int) -> dict[str, Any]:
        token = keys.token(Role.CALL, [VICTIM], "alpha")
        outcomes: Counter[str] = Counter()
        ms: list[float] = []
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(count):
                started = time.monotonic()
                try:
                    opened, listed, tools = await mcp_tools_list(http, base, VICTIM, token)
                    outcomes[f"{opened} / {listed} / {tools} tools"] += 1
                except httpx.HTTPError as error:
                    outcomes[type(error).__name__] += 1
                ms.append((time.monotonic() - started) * 1000)
        return {"outcomes": dict(outcomes), "max_ms": max(ms)}

    async def after(system: System) -> dict[str, Any]:
        figures = await tenant_lists(gateway["base"], 3)
        gateway_mb = procs.memory_kb(gateway["proc"].pid)["VmRSS"] / 1024
        return {"quiet": gateway["quiet"], "during": figures, "gateway_rss_mb": gateway_mb}

    return await turn(tree, keys, sizes, start_attack=start, during_extra=after)


async def connect_calls(port: int, token: str, seconds: float) -> dict[str, Any]:
    """Sequential SubmitToolResult calls over Connect, each on a new connection, for `seconds`."""
    url = f"http://127.0.0.1:{port}/toolmesh.v1.BridgeService/SubmitToolResult"
    body = {"hostSessionId": "hs_none", "toolRequestId": "tr_none", "outcome": {"resultJson": "{}"}}
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    outcomes: Counter[str] = Counter()
    ms: list[float] = []
    stop_at = time.monotonic() + seconds
    while time.monotonic() < stop_at:
        started = time.monotonic()
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                response = await http.post(url, json=body, headers=headers)
            try:
                code = response.json().get("code", "")
            except ValueError:
                code = ""
            outcomes[f"HTTP {response.status_code} {code}".strip()] += 1
        except httpx.HTTPError as error:
            outcomes[type(error).__name__] += 1
        ms.append((time.monotonic() - started) * 1000)
        await asyncio.sleep(0.1)
    ms.sort()
    return {"calls": len(ms), "p50_ms": ms[len(ms) // 2], "max_ms": ms[-1], "outcomes": dict(outcomes)}


async def slow(tree: Tree, keys: Keys, sizes: Sizes) -> dict[str, Any]:
    host_token = keys.token(Role.HOST, [VICTIM], "alpha-host")

    async def start(system: System) -> Proc:
        args = ["slow", "127.0.0.1", str(system.web_port), str(sizes.slow_connections)]
        return await attacker(tree, args, system.env)

    async def quiet_extra(system: System) -> dict[str, Any]:
        return await connect_calls(system.web_port, host_token, min(2.0, sizes.quiet_s))

    async def during_extra(system: System) -> dict[str, Any]:
        calls = await connect_calls(system.web_port, host_token, sizes.attack_s - 0.5)
        return calls | {"bridge_rss_mb": procs.memory_kb(system.bridge.pid)["VmRSS"] / 1024}

    return await turn(
        tree, keys, sizes, start_attack=start, quiet_extra=quiet_extra, during_extra=during_extra
    )


async def badtokens(tree: Tree, keys: Keys, sizes: Sizes) -> dict[str, Any]:
    async def start(system: System) -> Proc:
        args = ["badtokens", system.invocation.target, str(sizes.badtoken_concurrency)]
        return await attacker(tree, args, system.env)

    return await turn(tree, keys, sizes, start_attack=start)


RUNNERS: dict[str, Callable[[Tree, Keys, Sizes], Awaitable[dict[str, Any]]]] = {
    "inflight": inflight,
    "subject": subject,
    "mcp": mcp,
    "slow": slow,
    "badtokens": badtokens,
}


# -- the table ---------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return "; ".join(f"{key} {_fmt(count)}" for key, count in value.items()) or "none"
    return str(value)


ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("victim quiet p50 / p99 ms", lambda r: f"{r['quiet']['p50_ms']:.2f} / {r['quiet']['p99_ms']:.2f}"),
    ("victim during p50 / p99 ms", lambda r: f"{r['during']['p50_ms']:.2f} / {r['during']['p99_ms']:.2f}"),
    ("victim p99 during / quiet", lambda r: f"{r['p99_ratio']:.2f}x"),
    ("victim calls quiet / during", lambda r: f"{r['quiet']['calls']} / {r['during']['calls']}"),
    ("victim errors quiet", lambda r: _fmt(r["quiet"]["codes"])),
    ("victim errors during", lambda r: _fmt(r["during"]["codes"])),
    (
        "invocation CPU quiet / during",
        lambda r: f"{r['quiet']['invocation_cpu']:.2f} / {r['during']['invocation_cpu']:.2f}",
    ),
    ("attacker", lambda r: _fmt(r["attacker"])),
    ("settled", lambda r: _fmt(r.get("settled"))),
    ("quiet extra", lambda r: _fmt(r.get("quiet_extra"))),
    ("during extra", lambda r: _fmt(r.get("during_extra"))),
    ("subjects", lambda r: _fmt(r.get("subjects"))),
    ("peak RSS MB", lambda r: _fmt(r["rss_mb"])),
]


def table(results: dict[str, dict[str, Any]]) -> str:
    labels = list(results)
    lines = []
    for attack in ATTACKS:
        if not any(attack in results[label] for label in labels):
            continue
        lines += [
            f"\n== {attack}",
            "| figure | " + " | ".join(labels) + " |",
            "| --- |" + " --- |" * len(labels),
        ]
        for name, cell in ROWS:
            cells = []
            for label in labels:
                found = results[label].get(attack)
                try:
                    cells.append(cell(found) if found else "-")
                except (KeyError, TypeError):
                    cells.append("-")
            if all(text in ("-", "none") for text in cells):
                continue
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(results: dict[str, dict[str, Any]], label: str) -> dict[str, str]:
    """Issue 27's targets on one tree: no victim error; p99 during within 2x of quiet."""
    found = {}
    for attack, result in results[label].items():
        errors = sum(result["during"]["codes"].values()) + sum(result["quiet"]["codes"].values())
        ratio = result["p99_ratio"]
        errors_met = "met" if not errors else "MISSED"
        found[attack] = (
            f"errors {errors} ({errors_met}); p99 {ratio:.2f}x ({'met' if ratio <= 2 else 'MISSED'})"
        )
    return found


async def run(args: argparse.Namespace, sizes: Sizes) -> dict[str, dict[str, Any]]:
    attacks = [a for a in ATTACKS if not args.only or a in args.only.split(",")]
    keys = Keys()
    with tempfile.TemporaryDirectory(prefix="toolmesh-baseline-") as directory:
        trees = [Tree("this tree")]
        if args.baseline != "none":
            trees.insert(0, baseline(args.baseline, Path(directory)))
        results: dict[str, dict[str, Any]] = {tree.label: {} for tree in trees}
        for number, attack in enumerate(attacks):
            for tree in trees if number % 2 == 0 else list(reversed(trees)):
                print(f"{attack}: {tree.label} ...", file=sys.stderr, flush=True)
                results[tree.label][attack] = await RUNNERS[attack](tree, keys, sizes)
    return results


def command_main(argv: list[str]) -> None:
    """`toolmesh COMMAND ...` from the command's own module (`toolmesh.cli.mcp`, `toolmesh.auth.command`).

    Not through `toolmesh.cli.main`: it loads every installed plugin command, and the installed
    ones are this tree's, which do not import under a baseline's PYTHONPATH."""
    module = importlib.import_module(argv[0])
    parser = argparse.ArgumentParser(prog="toolmesh")
    module.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv[1:])
    args.metrics = None  # set by toolmesh.cli.main for the commands that serve metrics; none here
    sys.exit(asyncio.run(args.run(args)))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "attack":
        attack_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "command":
        command_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(prog="python -m bench.tenants")
    parser.add_argument("--baseline", default="a4261de", help="git ref of the baseline's services, or 'none'")
    parser.add_argument("--only", default="", help=f"comma-separated attacks of {', '.join(ATTACKS)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it all runs")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    load_before = os.getloadavg()
    started = time.monotonic()
    results = asyncio.run(run(args, sizes))
    load_after = os.getloadavg()
    print(table(results))
    for label in results:
        print(f"\ntargets, {label}: " + "; ".join(f"{a}: {t}" for a, t in targets(results, label).items()))
    load = f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}"
    print(f"\n{load}; {time.monotonic() - started:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    written = out / f"tenants-{'quick-' if args.quick else ''}{stamp}.json"
    document = {
        "sizes": asdict(sizes),
        "load_before": load_before,
        "load_after": load_after,
        "results": results,
    }
    written.write_text(json.dumps(document, indent=2, default=str))
    print(f"written to {written}")


if __name__ == "__main__":
    main()
