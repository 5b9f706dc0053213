"""Long-lived streams do not outlive their token; the host SDK renews its stream ahead of expiry.

Tokens here live 3 s (whole seconds: 2 to 3 s remain when minted) and the
services allow no leeway, so that expiry comes within the test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.auth.tokens import SharedSecret, Verifier
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.bearer import renew_in
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.runtime.instrument import until_token_expires
from toolmesh.runtime.security import Security
from toolmesh.v1 import (
    bridge_pb2,
    bridge_pb2_grpc,
    invocation_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)
from toolmesh_testing import eventually, run_on
from trust_testing import SECRET, token

SAME_LOOP = pytest.mark.asyncio(loop_scope="module")

SESSION = "renewing"
SHORT_S = 3.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system() -> AsyncIterator[LocalSystem]:
    security = Security(verifier=Verifier(SharedSecret(SECRET), leeway_s=0))
    running = await start_local_system(heartbeat_s=0.5, security=security)
    async with RegistryClient(running.registry_target, token=token("admin", SESSION)) as registry:
        await registry.put_tools(SESSION, [ToolSpec("echo", "", '{"type":"object"}', timeout_ms=10_000)])
    yield running
    await running.stop(grace=0.5)


def bearer(value: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {value}")]


def assert_expired(error: grpc.aio.AioRpcError, opened_at: float) -> None:
    assert error_code(error) is Code.UNAUTHENTICATED, error
    info = error_info(error)
    assert info is not None and info.metadata["reason"] == "expired"
    assert time.monotonic() - opened_at < SHORT_S + 2


@pytest.mark.unit
def test_a_stream_is_renewed_ahead_of_its_token() -> None:
    assert renew_in(None) is None
    assert renew_in("not a jwt") is None
    long = token("call", SESSION, ttl_s=3600)
    soon = renew_in(long, now=time.time())
    assert soon is not None and 3600 - 32 < soon < 3600 - 28  # 30 s ahead
    short = token("call", SESSION, ttl_s=3)
    assert renew_in(short, now=time.time() + 10) == 0.0  # already past: at once
    ahead = renew_in(short)
    assert ahead is not None and 1.0 < ahead < 2.1  # a third of what is left, ahead


@pytest.mark.unit
def test_a_stream_ends_unauthenticated_at_expiry_on_uvloop() -> None:
    """uvloop's clock (whole milliseconds, read once per turn) can be short of a deadline whose
    timer has fired: expiry was then taken for the servicer's own timeout, and the stream ended
    INTERNAL (17 of 40 deadlines below, before the fix)."""

    async def silent() -> AsyncIterator[None]:
        await asyncio.Event().wait()
        yield None

    async def codes() -> list[Code]:
        ended = []
        for step in range(40):  # deadlines with every fraction of a millisecond
            with pytest.raises(ToolmeshError) as error:
                async for _ in until_token_expires(silent(), time.time() + 0.005 + step * 0.00023):
                    pass
            ended.append(error.value.code)
        return ended

    assert set(run_on("uvloop", codes())) == {Code.UNAUTHENTICATED}


@SAME_LOOP
@pytest.mark.integration
async def test_watch_tools_ends_when_its_token_expires(system: LocalSystem) -> None:
    async with grpc.aio.insecure_channel(system.registry_target) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        opened_at = time.monotonic()
        watch = stub.WatchTools(
            registry_pb2.WatchToolsRequest(session_id=SESSION),
            metadata=bearer(token("call", SESSION, ttl_s=SHORT_S)),
        )
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for _ in watch:
                pass
    assert_expired(ended.value, opened_at)


@SAME_LOOP
@pytest.mark.integration
async def test_invoke_tools_and_a_host_stream_end_when_their_token_expires(system: LocalSystem) -> None:
    async with (
        grpc.aio.insecure_channel(system.invocation_target) as calls,
        grpc.aio.insecure_channel(system.bridge_target) as hosts,
    ):
        opened_at = time.monotonic()
        stream = invocation_pb2_grpc.InvocationServiceStub(calls).InvokeTools(
            metadata=bearer(token("call", SESSION, ttl_s=SHORT_S))
        )
        host = bridge_pb2_grpc.BridgeServiceStub(hosts).OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(session_id=SESSION, host_name="raw"),
            metadata=bearer(token("host", SESSION, ttl_s=SHORT_S)),
        )

        async def drain(call: Any) -> grpc.aio.AioRpcError:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in call:
                    pass
            return ended.value

        for error in await asyncio.gather(drain(stream), drain(host)):
            assert_expired(error, opened_at)


@SAME_LOOP
@pytest.mark.integration
async def test_a_host_with_refreshing_tokens_keeps_serving_and_loses_no_call(system: LocalSystem) -> None:
    minted: list[str] = []

    def fresh_host_token() -> str:
        minted.append(token("host", SESSION, ttl_s=SHORT_S))
        return minted[-1]

    async def echo(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        await asyncio.sleep(0.2)  # calls overlap the renewals
        return {"n": args["n"]}

    caller_tokens: list[str] = []

    def fresh_call_token() -> str:
        caller_tokens.append(token("call", SESSION, ttl_s=SHORT_S))
        return caller_tokens[-1]

    host = ToolHost(system.bridge_target, SESSION, token=fresh_host_token)
    host.on_tool("echo", echo)
    await host.start()
    results = []
    try:
        # The caller's InvokeTools stream has short-lived tokens too: it is renewed as well.
        client = InvocationClient(system.invocation_target, token=fresh_call_token, multiplex=True)
        async with client:
            started = time.monotonic()
            n = 0
            while time.monotonic() - started < 3 * SHORT_S:
                batch = [client.invoke(SESSION, "echo", {"n": n + i}, turn_id="t") for i in range(4)]
                results += await asyncio.gather(*batch)
                n += 4
    finally:
        await host.stop()
    failures = [r for r in results if r.outcome is None or r.outcome.failure is not None]
    assert failures == []
    assert len(results) >= 40
    # Its stream was opened again (with a fresh token each time) several times meanwhile.
    assert len(set(minted)) >= 3
    assert len(set(caller_tokens)) >= 3


@SAME_LOOP
@pytest.mark.integration
async def test_a_tool_watch_goes_on_past_its_token(system: LocalSystem) -> None:
    """The client's watch opens its stream again with the callback's fresh token, skipping no change."""

    minted: list[str] = []

    def fresh_call_token() -> str:
        minted.append(token("call", SESSION, ttl_s=SHORT_S))
        return minted[-1]

    admin = token("admin", SESSION)
    async with (
        RegistryClient(system.registry_target, token=fresh_call_token) as watcher,
        RegistryClient(system.registry_target, token=admin) as writer,
    ):
        updates = watcher.watch_tools(SESSION)
        first = await anext(updates)
        next_update = asyncio.ensure_future(anext(updates))
        # The first stream's token expires; the watch opens a second stream with a fresh token.
        await eventually(lambda: len(minted) >= 2, timeout=10)
        await writer.put_tools(SESSION, [ToolSpec("echo", "", '{"type":"object"}', timeout_ms=9_000)])
        later = await asyncio.wait_for(next_update, 10)
        await updates.aclose()
    assert later.revision > first.revision
