"""Memory stays bounded for any number of distinct session ids: watch state goes with its last watcher.

Sizes are asserted, not RSS (`python -m bench.session_memory` measures RSS): the
registry's store holds watch state only for keys someone watches now, and the
invocation service's catalog watches at most DEFAULT_MAX_SESSIONS sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import start_bridge, start_invocation, start_registry
from toolmesh.core.errors import Code
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.invocation.catalog_cache import DEFAULT_MAX_SESSIONS, WatchedCatalog, unavailable
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import Stores, open_stores
from toolmesh.store.memory import InMemoryStore, MemoryLedgerStore
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc, registry_pb2, registry_pb2_grpc
from toolmesh_testing import eventually

SESSIONS = 50_000
# Over the wire each session costs a watch stream opened and closed on the registry: fewer, and
# bench/session_memory.py runs the full 50,000 with RSS before and after.
WIRE_SESSIONS = 6_000


@pytest.mark.unit
async def test_store_releases_a_key_s_watch_state_when_its_last_watcher_leaves() -> None:
    store = InMemoryStore()
    for index in range(SESSIONS):
        async with contextlib.aclosing(store.watch(f"session-{index}")) as updates:
            assert await anext(updates) is None
    assert store.watched_keys == 0
    first, second = store.watch("shared"), store.watch("shared")
    await anext(first)
    await anext(second)
    await first.aclose()
    assert store.watched_keys == 1
    await store.put("shared", b"v")
    assert (await anext(second)) is not None  # the one left still sees changes
    await second.aclose()
    assert store.watched_keys == 0


@pytest_asyncio.fixture
async def services() -> AsyncIterator[tuple[Stores, Stores, RunningServer, RunningServer]]:
    stores, ledger_stores = open_stores(), open_stores()
    registry = await start_registry(stores=stores)
    bridge, _ = await start_bridge()
    invocation = await start_invocation(
        f"127.0.0.1:{registry.internal_port}", f"127.0.0.1:{bridge.internal_port}", stores=ledger_stores
    )
    yield stores, ledger_stores, registry, invocation
    for server in (invocation, bridge, registry):
        await server.stop(0)


async def each(count: int, touch: object, parallel: int = 64) -> None:
    """`touch(index)` for every index below `count`, `parallel` at a time."""
    queue = iter(range(count))

    async def worker() -> None:
        for index in queue:
            await touch(index)  # type: ignore[operator]

    await asyncio.gather(*(worker() for _ in range(parallel)))


@pytest.mark.integration
@pytest.mark.slow
async def test_distinct_sessions_over_the_wire_leave_no_state_behind(
    services: tuple[Stores, Stores, RunningServer, RunningServer],
) -> None:
    """Watches, lists and calls of unknown tools for distinct session ids; the sizes come back down."""
    stores, ledger_stores, registry, invocation = services
    store = stores.store
    assert isinstance(store, InMemoryStore)
    baseline = (store.watched_keys, len(store))
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}") as registry_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{invocation.port}") as invocation_channel,
    ):
        tools = registry_pb2_grpc.RegistryServiceStub(registry_channel)
        calls = invocation_pb2_grpc.InvocationServiceStub(invocation_channel)

        async def watch_and_list(index: int) -> None:
            session_id = f"watched-{index}"
            watch = tools.WatchTools(registry_pb2.WatchToolsRequest(session_id=session_id), timeout=10)
            await anext(aiter(watch))
            watch.cancel()
            await tools.ListTools(registry_pb2.ListToolsRequest(session_id=session_id), timeout=10)

        await each(WIRE_SESSIONS // 2, watch_and_list)

        # Calls of unknown tools, a message of 100 at a time on one stream: each session is looked up once.
        stream = calls.InvokeTools(timeout=300)
        answers = aiter(stream)
        per_message = 100
        for start in range(0, WIRE_SESSIONS // 2, per_message):
            await stream.write(
                invocation_pb2.InvokeToolsRequest(
                    calls=[
                        invocation_pb2.StreamedToolCall(
                            call_id=index + 1,
                            request=invocation_pb2.InvokeToolRequest(
                                session_id=f"called-{index}", turn_id="t", tool_name="missing"
                            ),
                        )
                        for index in range(start, start + per_message)
                    ]
                )
            )
            answered = 0
            while answered < per_message:
                response = await anext(answers)
                for result in response.results:
                    found = (result.response.outcome.error.code, result.error.reason)
                    assert Code.TOOL_NOT_FOUND.value in found, result
                answered += len(response.results)
            # The catalog watches at most DEFAULT_MAX_SESSIONS sessions at a time.
            assert store.watched_keys <= baseline[0] + DEFAULT_MAX_SESSIONS
        await stream.done_writing()
    assert store.watched_keys <= baseline[0] + DEFAULT_MAX_SESSIONS
    # The invocation service gone, its watches end with it: back to where it started.
    await invocation.stop(0)

    await eventually(lambda: (store.watched_keys, len(store)) == baseline)
    ledger = ledger_stores.ledger
    assert isinstance(ledger, MemoryLedgerStore)
    assert len(ledger) == 0  # nothing ran: no invocation was recorded


class _Fallback:
    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        return ToolSpec(name)


@pytest.mark.unit
async def test_a_watch_pushed_out_before_its_first_list_sends_its_caller_to_the_registry() -> None:
    """More new sessions than the catalog keeps: a lookup whose watch was dropped asks directly.

    The dropped stream ends as a cancelled gRPC stream does, with REGISTRY_UNAVAILABLE: that is
    no failure of the registry, and must not reach the caller.
    """
    opened = asyncio.Event()

    async def slow_source(session_id: str) -> AsyncGenerator[ToolSet, None]:
        try:
            opened.set()
            await asyncio.Event().wait()
            yield ToolSet(0)
        except asyncio.CancelledError:
            raise unavailable(session_id, grpcStatus="CANCELLED") from None

    catalog = WatchedCatalog(slow_source, _Fallback(), max_sessions=1)
    try:
        first = asyncio.create_task(catalog.get_tool("first", "tool"))
        await opened.wait()
        second = asyncio.create_task(catalog.get_tool("second", "tool"))  # pushes "first" out
        assert await asyncio.wait_for(first, 5) == ToolSpec("tool")
        assert catalog.watched_sessions == ["second"]
        second.cancel()
    finally:
        await catalog.aclose()
