"""Fair shares, counted alone: per grant (the token's subject) and per process, in each service's domain."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator

import jwt
import pytest

from toolmesh.auth.grants import Role
from toolmesh.auth.tokens import SharedSecret, Verifier, mint
from toolmesh.bridge.router import Router
from toolmesh.contracts.ledger import Ledger
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.invocation.invoker import Invoker, InvokeResult
from toolmesh.invocation.quotas import Quotas
from toolmesh.registry.registry import Registry
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.rules.shares import Shares
from toolmesh.store.memory import InMemoryStore, MemoryLedgerStore
from toolmesh_testing import OneTool, SlowHost, eventually
from trust_testing import SECRET

pytestmark = pytest.mark.unit


def limits(**settings: int) -> Limits:
    return dataclasses.replace(DEFAULT_LIMITS, **settings)


def refused_by(error: ToolmeshError, code: Code, limit: str, value: str) -> None:
    assert (error.code, error.metadata["limit"], error.metadata["value"]) == (code, limit, value)


def test_every_process_bound_is_larger_than_one_grants_share_by_default() -> None:
    for total, share in [
        ("calls_in_flight", "calls_in_flight_per_grant"),
        ("host_sessions", "host_sessions_per_grant"),
        ("watches", "watches_per_grant"),
        ("registry_bytes", "registry_bytes_per_grant"),
    ]:
        assert getattr(DEFAULT_LIMITS, total) > getattr(DEFAULT_LIMITS, share), total


def test_a_grant_at_its_share_is_refused_alone_and_the_process_bound_refuses_everyone() -> None:
    shares = Shares(limits(watches=5, watches_per_grant=2), "watches", "watches_per_grant", what="watches")
    shares.take("bravo")
    shares.take("bravo")
    with pytest.raises(ToolmeshError) as raised:
        shares.take("bravo")
    refused_by(raised.value, Code.QUOTA_EXCEEDED, "watches_per_grant", "2")
    assert raised.value.retryable and raised.value.retry_delay_s == 1.0
    shares.take("alpha")  # another grant is not affected
    shares.take(None)  # no grant: the process bound alone
    shares.take(None)
    assert shares.held == 5
    with pytest.raises(ToolmeshError) as raised:
        shares.take("charlie")
    refused_by(raised.value, Code.OVERLOADED, "watches", "5")
    shares.give_back("bravo")
    shares.take("charlie")  # room again
    assert (shares.held_by("bravo"), shares.held_by("charlie"), shares.held) == (1, 1, 5)


async def test_a_prefix_grant_at_its_share_of_waiting_calls_leaves_the_others_theirs() -> None:
    host = SlowHost()
    settings = limits(calls_in_flight=6, calls_in_flight_per_grant=3)
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()), quotas=Quotas(None, settings))

    def call(session: str, n: int, caller: str) -> asyncio.Future[InvokeResult]:
        return asyncio.ensure_future(
            invoker.invoke(ToolCall(session, "t", "tool", f'{{"n": {n}}}'), caller=caller)
        )

    # One `bravo*` grant over three sessions, each far below its per-session quota.
    held = [call(f"bravo-{n}", n, "bravo") for n in range(3)]
    await eventually(lambda: host.started == 3)
    with pytest.raises(ToolmeshError) as raised:
        await invoker.invoke(ToolCall("bravo-9", "t", "tool", "{}"), caller="bravo")
    refused_by(raised.value, Code.QUOTA_EXCEEDED, "calls_in_flight_per_grant", "3")
    victims = [call("alpha", n, "alpha") for n in range(3)]  # the victim's calls all wait, none refused
    await eventually(lambda: host.started == 6)
    with pytest.raises(ToolmeshError) as raised:
        await invoker.invoke(ToolCall("charlie", "t", "tool", "{}"), caller="charlie")
    refused_by(raised.value, Code.OVERLOADED, "calls_in_flight", "6")
    host.release.set()
    for task in [*held, *victims]:
        assert (await task).outcome.ok
    assert (await invoker.invoke(ToolCall("bravo-1", "t", "tool", '{"n": 7}'), caller="bravo")).outcome.ok


async def test_host_sessions_per_grant_over_all_its_sessions() -> None:
    router = Router(limits=limits(host_sessions=4, host_sessions_per_grant=2))
    hosts = [router.open_host(f"bravo-{n}", "h", (), True, grant="bravo") for n in range(2)]
    with pytest.raises(ToolmeshError) as raised:
        router.open_host("bravo-3", "h", (), True, grant="bravo")
    refused_by(raised.value, Code.QUOTA_EXCEEDED, "host_sessions_per_grant", "2")
    assert raised.value.retry_delay_s == router.heartbeat_s
    others = [router.open_host("alpha", "h", (), True, grant="alpha"), router.open_host("x", "h", (), True)]
    with pytest.raises(ToolmeshError) as raised:
        router.open_host("charlie", "h", (), True, grant="charlie")
    refused_by(raised.value, Code.OVERLOADED, "host_sessions", "4")
    router.close_host(hosts[0])
    hosts.append(router.open_host("bravo-3", "h", (), True, grant="bravo"))  # its place is free again
    for host in [*hosts, *others]:
        router.close_host(host)


def tools_of(size: int) -> list[ToolSpec]:
    return [ToolSpec("t", "d" * size, '{"type": "object"}')]


async def test_registry_bytes_per_grant_count_what_it_stored_and_free_when_replaced() -> None:
    registry = Registry(InMemoryStore(), limits(registry_bytes=5000, registry_bytes_per_grant=2500))
    await registry.put_tools("bravo-1", tools_of(1000), grant="bravo")
    await registry.put_tools("bravo-2", tools_of(1000), grant="bravo")
    with pytest.raises(ToolmeshError) as raised:
        await registry.put_tools("bravo-3", tools_of(1000), grant="bravo")
    refused_by(raised.value, Code.QUOTA_EXCEEDED, "registry_bytes_per_grant", "2500")
    assert (await registry.list_tools("bravo-3")).revision == 0  # nothing stored
    await registry.put_tools("bravo-2", tools_of(10), grant="bravo")  # replaced: its bytes counted anew
    await registry.put_tools("bravo-3", tools_of(1000), grant="bravo")
    await registry.put_tools("alpha", tools_of(1000), grant="alpha")  # another grant is not affected
    await registry.put_tools("alpha-2", tools_of(1000), grant="alpha")
    with pytest.raises(ToolmeshError) as raised:
        await registry.put_tools("internal", tools_of(1000))
    refused_by(raised.value, Code.OVERLOADED, "registry_bytes", "5000")
    # A refused replacement keeps the list, and its count, as they were.
    with pytest.raises(ToolmeshError):
        await registry.put_tools("bravo-2", tools_of(2000), grant="bravo")
    assert (await registry.list_tools("bravo-2")).tools == tuple(tools_of(10))


async def test_watches_per_grant_are_given_back_when_a_watch_ends() -> None:
    registry = Registry(InMemoryStore(), limits(watches=3, watches_per_grant=2))

    async def first(watch: AsyncGenerator[ToolSet, None]) -> ToolSet:
        return await anext(watch)

    watches = [registry.watch(f"bravo-{n}", "bravo") for n in range(2)]
    for watch in watches:
        await first(watch)
    with pytest.raises(ToolmeshError) as raised:
        await first(registry.watch("bravo-3", "bravo"))
    refused_by(raised.value, Code.QUOTA_EXCEEDED, "watches_per_grant", "2")
    alpha = registry.watch("alpha", "alpha")
    await first(alpha)
    with pytest.raises(ToolmeshError) as raised:
        await first(registry.watch("charlie", "charlie"))
    refused_by(raised.value, Code.OVERLOADED, "watches", "3")
    await watches[0].aclose()
    again = registry.watch("bravo-3", "bravo")
    await first(again)
    for watch in (watches[1], alpha, again):
        await watch.aclose()


async def test_a_token_without_a_subject_is_refused_and_minting_gives_each_its_own() -> None:
    verifier = Verifier(SharedSecret(SECRET))
    claims = {"iss": "toolmesh", "aud": "toolmesh", "exp": time.time() + 60, "roles": ["call"]}
    for subject in ({}, {"sub": ""}, {"sub": "  "}):
        token = jwt.encode(claims | {"sessions": ["s"]} | subject, SECRET, algorithm="HS256")
        with pytest.raises(ToolmeshError) as raised:
            await verifier.grant(token)
        assert raised.value.code is Code.UNAUTHENTICATED and raised.value.metadata == {"reason": "no_subject"}
    minted = [mint(SECRET, roles=[Role.CALL], sessions=["s"], ttl_s=60) for _ in range(2)]
    subjects = {(await verifier.grant(token)).subject for token in minted}
    assert len(subjects) == 2 and all(subjects)
