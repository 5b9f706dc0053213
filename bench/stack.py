"""The systems under test, each started as separate processes: the floor and toolmesh."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc

from bench import procs
from bench.host import ERROR, READY
from bench.procs import Proc
from toolmesh.client import RegistryClient
from toolmesh.core.tools import ToolSpec

SESSION = "bench"
NOOP_SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
TOOLS = [
    ToolSpec("noop", "Does nothing", NOOP_SCHEMA),
    ToolSpec("noop_sync", "Does nothing, in a worker thread", NOOP_SCHEMA),
    ToolSpec(
        "hold",
        "Waits until all held calls arrived",
        json.dumps({"type": "object", "properties": {"i": {"type": "integer"}}, "required": ["i"]}),
        timeout_ms=120_000,
    ),
    ToolSpec("counted", "Counts its executions", '{"type":"object"}', timeout_ms=120_000),
]


@dataclass
class Floor:
    procs: list[Proc] = field(default_factory=list)
    target: str = ""  # the front server

    async def stop(self) -> None:
        await procs.stop_all(self.procs)


async def start_floor(with_lookup: bool = False, host_args: list[str] | None = None) -> Floor:
    """back, front (and lookup) servers and a host, each its own process; `host_args` go to the host."""
    floor = Floor()
    try:
        back = await procs.start("floor-back", ["-m", "bench.floor", "back"])
        floor.procs.append(back)
        front_args = ["-m", "bench.floor", "front", "--back", back.target]
        if with_lookup:
            lookup = await procs.start("floor-lookup", ["-m", "bench.floor", "lookup"])
            floor.procs.append(lookup)
            front_args += ["--lookup", lookup.target]
        host = await procs.start(
            "floor-host",
            ["-m", "bench.floor", "host", "--back", back.target, *(host_args or [])],
            port_line=False,
        )
        floor.procs.append(host)
        await host.wait_for("floor host: connected")
        front = await procs.start("floor-front", front_args)
        floor.procs.append(front)
        floor.target = front.target
    except BaseException:
        await floor.stop()
        raise
    return floor


@dataclass
class Toolmesh:
    registry: Proc
    bridge: Proc
    invocation: Proc
    host: Proc

    @property
    def services(self) -> dict[str, Proc]:
        return {
            "invocation": self.invocation,
            "bridge": self.bridge,
            "registry": self.registry,
            "host": self.host,
        }

    async def stop(self) -> None:
        await procs.stop_all([self.registry, self.bridge, self.invocation, self.host])


async def start_toolmesh(
    host_env: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    admin_token: str | None = None,
) -> Toolmesh:
    """registry, bridge, invocation and a host process serving bench.handlers.

    `env` is added to every process's environment (e.g. OTEL_* variables, TLS
    files); `credentials` and `admin_token` are for putting the tools.
    """
    started: list[Proc] = []
    host_env = {**(env or {}), **(host_env or {})} or None
    try:
        listen = ["--listen", "127.0.0.1:0", "--internal-listen", "127.0.0.1:0"]
        registry, bridge = await asyncio.gather(
            procs.start("registry", ["-m", "toolmesh.registry", *listen], env=env),
            procs.start(
                "bridge",
                # Its web port too on a free port: the default one may be taken.
                ["-m", "toolmesh.bridge", *listen, "--web-listen", "127.0.0.1:0"],
                env=env,
            ),
        )
        started += [registry, bridge]
        invocation_args = [
            "--listen",
            "127.0.0.1:0",
            "--registry",
            await registry.internal_target(),
            "--bridge",
            await bridge.internal_target(),
        ]
        invocation = await procs.start("invocation", ["-m", "toolmesh.invocation", *invocation_args], env=env)
        started.append(invocation)
        host_args = ["--bridge", bridge.target, "--session", SESSION]
        host = await procs.start(
            "host", ["-m", "bench.host", *host_args], env=host_env, port_line=False, counted_prefix=ERROR
        )
        started.append(host)
        await host.wait_for(READY)
        async with RegistryClient(registry.target, credentials=credentials, token=admin_token) as client:
            await client.put_tools(SESSION, TOOLS)
    except BaseException:
        await procs.stop_all(started)
        raise
    return Toolmesh(registry, bridge, invocation, host)
