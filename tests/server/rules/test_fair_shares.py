"""Fair shares over real servers: the attacks of one grant (a `bravo*` token) replayed in small numbers.

A grant at its share gets QUOTA_EXCEEDED naming the per-grant limit; another tenant's calls, host
sessions, watches and lists go on as if nothing happened. Tokens must name their subject (the
grant key), and `toolmesh token` gives each token minted without one its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import jwt
import pytest

from limits_testing import SilentHost, limits, status_of, system_with, tool
from toolmesh.assembly.system import LocalSystem
from toolmesh.auth.grants import Role
from toolmesh.auth.tokens import SharedSecret, Verifier, mint
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_info
from toolmesh.host import ToolHost
from toolmesh.rules.limits import Limits
from toolmesh.runtime.security import Security
from toolmesh.v1 import (
    bridge_pb2,
    bridge_pb2_grpc,
    invocation_pb2,
    invocation_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)
from toolmesh_testing import eventually, run_cli
from trust_testing import SECRET

pytestmark = pytest.mark.integration

Metadata = tuple[tuple[str, str], ...]


def bearer(subject: str, role: Role, *sessions: str) -> Metadata:
    minted = mint(SECRET, roles=[role], sessions=sessions, ttl_s=600, subject=subject)
    return (("authorization", f"Bearer {minted}"),)


def secured(settings: Limits) -> Any:
    return system_with(settings, security=Security(verifier=Verifier(SharedSecret(SECRET))))


def refused_as(raised: pytest.ExceptionInfo[grpc.aio.AioRpcError], limit: str, value: str) -> None:
    status, code, metadata = status_of(raised)
    assert (status, code, metadata["limit"], metadata["value"]) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        Code.QUOTA_EXCEEDED,
        limit,
        value,
    )


def invoke(session: str, tool_name: str, n: int) -> invocation_pb2.InvokeToolRequest:
    return invocation_pb2.InvokeToolRequest(
        session_id=session, turn_id="t", tool_name=tool_name, arguments_json=json.dumps({"n": n})
    )


@contextlib.asynccontextmanager
async def channels(system: LocalSystem) -> AsyncIterator[tuple[Any, Any, Any]]:
    async with (
        grpc.aio.insecure_channel(system.registry_target) as registry,
        grpc.aio.insecure_channel(system.bridge_target) as bridge,
        grpc.aio.insecure_channel(system.invocation_target) as invocation,
    ):
        yield (
            registry_pb2_grpc.RegistryServiceStub(registry),
            bridge_pb2_grpc.BridgeServiceStub(bridge),
            invocation_pb2_grpc.InvocationServiceStub(invocation),
        )


async def test_a_prefix_grant_at_its_share_of_calls_waiting_leaves_a_victims_calls_alone() -> None:
    """The high finding: one `bravo*` grant held every waiting place over three sessions (each under
    its per-session quota) and every other tenant got OVERLOADED. Now it gets QUOTA_EXCEEDED at its
    share and the victim's calls all succeed."""
    settings = limits(calls_in_flight_per_grant=3, calls_in_flight=8)
    async with secured(settings) as system, channels(system) as (registry, bridge, invocation):
        admin = bearer("operator", Role.ADMIN, "*")
        for session in ("bravo-1", "bravo-2", "bravo-3"):
            await registry.PutTools(
                registry_pb2.PutToolsRequest(session_id=session, tools=[tool("wait", timeout_ms=20_000)]),
                metadata=admin,
            )
        await registry.PutTools(
            registry_pb2.PutToolsRequest(session_id="alpha", tools=[tool("echo")]), metadata=admin
        )
        hosts = [
            await SilentHost(bridge, session, bearer("bravo-host", Role.HOST, "bravo*")).open()
            for session in ("bravo-1", "bravo-2", "bravo-3")
        ]
        victim_host = ToolHost(
            system.bridge_target,
            "alpha",
            token=mint(SECRET, roles=[Role.HOST], sessions=["alpha"], ttl_s=600, subject="alpha-host"),
        )
        victim_host.on_tool("echo", lambda args, ctx: args)
        await victim_host.start(timeout=10)
        attacker = bearer("bravo", Role.CALL, "bravo*")
        held = [invocation.InvokeTool(invoke(f"bravo-{n}", "wait", n), metadata=attacker) for n in (1, 2, 3)]
        try:
            await eventually(lambda: sum(host.requests for host in hosts) == 3)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await invocation.InvokeTool(invoke("bravo-1", "wait", 4), metadata=attacker)
            refused_as(raised, "calls_in_flight_per_grant", "3")
            victim = bearer("alpha", Role.CALL, "alpha")
            answers = []
            for batch in range(5):  # as many at once as its own share takes
                answers += await asyncio.gather(
                    *(
                        invocation.InvokeTool(invoke("alpha", "echo", batch * 3 + n), metadata=victim)
                        for n in range(3)
                    )
                )
            assert [answer.outcome.WhichOneof("outcome") for answer in answers] == ["result_json"] * 15
        finally:
            for call in held:
                call.cancel()
            for host in hosts:
                host.close()
            await victim_host.stop()


async def test_a_token_without_a_subject_is_refused() -> None:
    async with secured(limits()) as system, channels(system) as (_, _, invocation):
        claims = {"iss": "toolmesh", "aud": "toolmesh", "exp": time.time() + 60}
        for subject in ({}, {"sub": ""}):
            token = jwt.encode(
                claims | {"roles": ["call"], "sessions": ["s"]} | subject, SECRET, algorithm="HS256"
            )
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await invocation.InvokeTool(
                    invoke("s", "none", 0), metadata=(("authorization", f"Bearer {token}"),)
                )
            status, code, metadata = status_of(raised)
            assert (status, code, metadata) == (
                grpc.StatusCode.UNAUTHENTICATED,
                Code.UNAUTHENTICATED,
                {"reason": "no_subject"},
            )


async def test_tokens_minted_without_a_subject_get_buckets_of_their_own() -> None:
    """The medium finding: every token minted without `--subject` shared one calls/s bucket, so one
    tenant's flood refused another's calls. Now each gets a subject of its own, printed on stderr."""
    settings = limits(calls_per_second_per_caller=1, calls_burst_per_caller=2)
    env = dict(os.environ, TOOLMESH_AUTH_SECRET=SECRET.decode())
    minted: list[tuple[str, str]] = []
    for _ in range(2):
        code, out, err = await run_cli("token", "--role", "call", "--session", "s", env=env)
        assert code == 0, err
        assert err.startswith("toolmesh token: subject sub-")
        minted.append((out.strip(), err.split()[-1]))
    assert minted[0][1] != minted[1][1]
    flooder, victim = ((("authorization", f"Bearer {token}"),) for token, _ in minted)
    async with secured(settings) as system, channels(system) as (_, _, invocation):
        for _ in range(2):
            await invocation.InvokeTool(invoke("s", "none", 0), metadata=flooder)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await invocation.InvokeTool(invoke("s", "none", 0), metadata=flooder)
        refused_as(raised, "calls_per_second_per_caller", "1")
        for _ in range(2):  # the other token's bucket is its own: full
            await invocation.InvokeTool(invoke("s", "none", 0), metadata=victim)


async def test_host_sessions_per_grant_hold_over_a_prefix_grants_sessions() -> None:
    async with secured(limits(host_sessions_per_grant=2)) as system, channels(system) as (_, bridge, _):
        attacker = bearer("bravo", Role.HOST, "bravo*")
        hosts = [await SilentHost(bridge, f"bravo-{n}", attacker).open() for n in (1, 2)]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await SilentHost(bridge, "bravo-3", attacker).open()
        refused_as(raised, "host_sessions_per_grant", "2")
        victims = [
            await SilentHost(bridge, "alpha", bearer("alpha", Role.HOST, "alpha")).open() for _ in (1, 2)
        ]
        hosts[0].close()
        again = await eventually(lambda: _opens(bridge, "bravo-3", attacker))
        for host in [*hosts, *victims, again]:
            host.close()


async def _opens(bridge: Any, session: str, metadata: Metadata) -> SilentHost | None:
    try:
        return await SilentHost(bridge, session, metadata).open()
    except grpc.aio.AioRpcError as error:
        info = error_info(error)
        assert info is not None and info.metadata["limit"] == "host_sessions_per_grant"
        return None


async def test_watches_per_grant_hold_over_a_prefix_grants_sessions() -> None:
    async with secured(limits(watches_per_grant=2)) as system, channels(system) as (registry, _, _):
        attacker = bearer("bravo", Role.CALL, "bravo*")

        async def watch(session: str, metadata: Metadata) -> Any:
            stream = registry.WatchTools(
                registry_pb2.WatchToolsRequest(session_id=session), metadata=metadata
            )
            await stream.read()  # the current list: the watch is open
            return stream

        watches = [await watch(f"bravo-{n}", attacker) for n in (1, 2)]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await watch("bravo-3", attacker)
        refused_as(raised, "watches_per_grant", "2")
        victims = [await watch("alpha", bearer("alpha", Role.CALL, "alpha")) for _ in (1, 2)]
        watches[0].cancel()

        async def reopened() -> Any:
            try:
                return await watch("bravo-3", attacker)
            except grpc.aio.AioRpcError:
                return None

        again = await eventually(reopened)
        for stream in [*watches, *victims, again]:
            stream.cancel()


async def test_registry_bytes_per_grant_hold_over_a_prefix_grants_sessions() -> None:
    async with secured(limits(registry_bytes_per_grant=5000)) as system, channels(system) as (registry, _, _):
        attacker = bearer("bravo", Role.ADMIN, "bravo*")
        big = [tool("t", json.dumps({"type": "object", "description": "d" * 2000}))]

        async def put(session: str, metadata: Metadata) -> None:
            await registry.PutTools(
                registry_pb2.PutToolsRequest(session_id=session, tools=big), metadata=metadata
            )

        for n in (1, 2):
            await put(f"bravo-{n}", attacker)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await put("bravo-3", attacker)
        refused_as(raised, "registry_bytes_per_grant", "5000")
        for session in ("alpha-1", "alpha-2"):
            await put(session, bearer("alpha", Role.ADMIN, "alpha-*"))


async def test_declared_tools_count_against_the_hosts_grant_in_the_bridge() -> None:
    """A host declares its tools through the bridge, which puts them on the registry's internal
    listener (no grant there): the bridge counts them against the host's grant."""
    settings = limits(registry_bytes_per_grant=3000)
    async with secured(settings) as system, channels(system) as (_, bridge, _):
        big = [tool("t", json.dumps({"type": "object", "description": "d" * 2000}))]
        attacker = bearer("bravo", Role.HOST, "bravo*")
        hosts = [await SilentHost(bridge, f"bravo-{n}", attacker).open() for n in (1, 2)]

        async def declare(host: SilentHost, metadata: Metadata) -> None:
            request = bridge_pb2.DeclareHostToolsRequest(host_session_id=host.host_session_id, tools=big)
            await bridge.DeclareHostTools(request, metadata=metadata)

        await declare(hosts[0], attacker)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await declare(hosts[1], attacker)
        refused_as(raised, "registry_bytes_per_grant", "3000")
        victim = bearer("alpha", Role.HOST, "alpha")
        alpha = await SilentHost(bridge, "alpha", victim).open()
        await declare(alpha, victim)
        hosts[0].close()  # its declaration's bytes go with it
        await eventually(lambda: _declares(declare, hosts[1], attacker))
        for host in [*hosts, alpha]:
            host.close()


async def _declares(declare: Any, host: SilentHost, metadata: Metadata) -> bool:
    try:
        await declare(host, metadata)
    except grpc.aio.AioRpcError:
        return False
    return True
