"""A new invocation's request goes to its bridge while its claim is on its way to Redis
(toolmesh.invocation.early), and still runs at most once.

A bridge process on one Redis, the invocation service here with its ledger's claims held back
(`HeldClaims`: each claim waits, then runs on Redis, as a slow store would answer it), and a raw
host session (AskingHost) that asks START only when the test says: so the test sees the request
reach the host before its claim is in the ledger, and what START says then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_invocation, start_registry
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.tools import ToolSpec
from toolmesh.rules.limits import DEFAULT_LIMITS
from toolmesh.store.backends import Stores, open_stores
from toolmesh.store.ledger import Delivered, LeaseTerms, LedgerStore, StoredInvocation
from toolmesh.v1 import bridge_pb2
from toolmesh_testing import AskingHost, ServiceProcess, eventually, start_service_process

pytestmark = pytest.mark.integration

SESSION = "early-dispatch"
# Not read-only nor idempotent: its start is fenced.
WRITE = ToolSpec("write", "Writes", '{"type": "object"}', timeout_ms=20_000)
HELD_S = 0.5


class HeldClaims:
    """The Redis ledger store, each claim held back `HELD_S` before it runs; once `lose_reply`, a
    claim runs and then fails STORE_UNAVAILABLE, as when Redis went away with its reply."""

    def __init__(self, store: LedgerStore) -> None:
        self._store = store
        self.lose_reply = False
        self.synchronous = store.synchronous
        self.claims_replicated = store.claims_replicated

    async def claim(
        self,
        tool_request_id: str,
        record: bytes,
        identity: str,
        running_ttl_s: float,
        *,
        confirmed: Sequence[Delivered] = (),
        lease: LeaseTerms | None = None,
    ) -> StoredInvocation | None:
        await asyncio.sleep(HELD_S)
        claimed = await self._store.claim(
            tool_request_id, record, identity, running_ttl_s, confirmed=confirmed, lease=lease
        )
        if self.lose_reply:
            raise ToolmeshError(Code.STORE_UNAVAILABLE)
        return claimed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def first_call(client: InvocationClient, host: AskingHost) -> None:
    """One call run to its end: the dispatch stream's first, on which the bridge says it fences
    starts (until then a request waits for its claim). Leaves the host's lists empty."""
    calling = asyncio.create_task(client.invoke(SESSION, WRITE.name, {"n": 0}, turn_id="t"))
    await eventually(lambda: host.received)
    assert await host.start(host.received[0]) == bridge_pb2.TOOL_START_VERDICT_START
    await host.submit(host.received[0], "{}")
    result = await asyncio.wait_for(calling, 10)
    assert result.outcome is not None and result.outcome.failure is None, result
    host.received.clear()


@contextlib.asynccontextmanager
async def system(
    *, in_flight_per_session: int = DEFAULT_LIMITS.calls_in_flight_per_session
) -> AsyncIterator[tuple[InvocationClient, AskingHost, HeldClaims]]:
    prefix = new_prefix()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    bridge: ServiceProcess | None = None
    invocation = None
    try:
        bridge = await start_service_process("bridge", "--registry", registry_internal, env=env)
        stores = open_stores(SHARED_URL, prefix)
        claims = HeldClaims(stores.ledger)
        held = Stores(stores.store, claims, stores.close, shared=True)
        limits = dataclasses.replace(DEFAULT_LIMITS, calls_in_flight_per_session=in_flight_per_session)
        invocation = await start_invocation(
            registry_internal, bridge.internal_target, stores=held, limits=limits
        )
        async with RegistryClient(f"127.0.0.1:{registry.port}") as registry_client:
            await registry_client.put_tools(SESSION, [WRITE])
        host = AskingHost(bridge.target, SESSION, [WRITE.name])
        try:
            await asyncio.wait_for(host.opened, 10)
            async with InvocationClient(f"127.0.0.1:{invocation.port}") as client:
                await first_call(client, host)
                yield client, host, claims
        finally:
            await host.close()
    finally:
        if bridge is not None:
            await bridge.stop()
        for server in (invocation, registry):
            if server is not None:
                await server.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)


async def test_a_call_reaches_its_host_before_its_claim_is_in_and_starts_once_it_is() -> None:
    async with system() as (client, host, _):
        loop = asyncio.get_running_loop()
        began = loop.time()
        calling = asyncio.create_task(client.invoke(SESSION, WRITE.name, {"n": 1}, turn_id="t"))
        await eventually(lambda: host.received)
        [tool_request_id] = host.received
        assert loop.time() - began < HELD_S  # sent while its claim was held back
        # Asked now, START waits for the claim (the mark finds it absent, and asks again).
        assert await host.start(tool_request_id) == bridge_pb2.TOOL_START_VERDICT_START
        assert loop.time() - began >= HELD_S
        await host.submit(tool_request_id, '{"done": 1}')
        result = await asyncio.wait_for(calling, 10)
        assert result.tool_request_id == tool_request_id
        assert result.outcome is not None and json.loads(result.outcome.result_json or "") == {"done": 1}
        record = await client.get_invocation(tool_request_id)
        assert record.started_at is not None


async def test_a_request_sent_before_a_claim_the_session_has_no_place_for_is_withdrawn_unstarted() -> None:
    async with system(in_flight_per_session=1) as (client, host, _):
        holding = asyncio.create_task(client.invoke(SESSION, WRITE.name, {"n": 1}, turn_id="t"))
        await eventually(lambda: host.received)
        [first] = host.received
        assert await host.start(first) == bridge_pb2.TOOL_START_VERDICT_START
        refused = await asyncio.wait_for(client.invoke(SESSION, WRITE.name, {"n": 2}, turn_id="t"), 10)
        assert refused.outcome is None and refused.code is Code.QUOTA_EXCEEDED, refused
        # It reached the host while its claim was on its way, and was withdrawn before any start.
        await eventually(lambda: len(host.received) == 2 and host.cancelled)
        second = host.received[1]
        assert host.cancelled == [second]
        assert await host.start(second) != bridge_pb2.TOOL_START_VERDICT_START
        await host.submit(first, '{"done": 1}')
        held = await asyncio.wait_for(holding, 10)
        assert held.outcome is not None and held.outcome.failure is None


async def test_a_claim_whose_reply_was_lost_still_has_its_outcome_recorded() -> None:
    async with system() as (client, host, claims):
        claims.lose_reply = True
        calling = asyncio.create_task(client.invoke(SESSION, WRITE.name, {"n": 1}, turn_id="t"))
        await eventually(lambda: host.received)
        [tool_request_id] = host.received
        # The claim ran on Redis, its reply lost: the caller is told STORE_UNAVAILABLE (retryable) ...
        lost = await asyncio.wait_for(calling, 10)
        assert lost.outcome is None and lost.code is Code.STORE_UNAVAILABLE, lost
        # ... and the request it sent goes on: the host may start it, and its result is recorded.
        assert await host.start(tool_request_id) == bridge_pb2.TOOL_START_VERDICT_START
        await host.submit(tool_request_id, '{"done": 1}')

        async def recorded() -> bool:
            record = await client.get_invocation(tool_request_id)
            return record.outcome is not None

        await eventually(recorded)
        record = await client.get_invocation(tool_request_id)
        assert record.outcome is not None and json.loads(record.outcome.result_json or "") == {"done": 1}
