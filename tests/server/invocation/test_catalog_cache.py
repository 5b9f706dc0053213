"""The invocation service's cached catalog: one watch per session, memory answers, bounds, failures.

Over a real registry server whose servicer counts the calls it serves and the
watch streams still open; and with in-process watch sources for the failures a
real registry does not produce on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field

import grpc
import pytest
import pytest_asyncio

from toolmesh.client import RegistryClient
from toolmesh.core.channels import open_channel
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.invocation.catalog_cache import (
    DEFAULT_IDLE_S,
    DEFAULT_MAX_SESSIONS,
    WatchedCatalog,
    WatchSource,
)
from toolmesh.invocation.remote import RemoteCatalog, cached_registry_catalog, registry_watch_source
from toolmesh.registry.registry import Registry
from toolmesh.registry.servicer import RegistryServicer
from toolmesh.runtime.rpc_types import ServicerContext
from toolmesh.runtime.server import RunningServer, Service, start_server
from toolmesh.store.memory import InMemoryStore
from toolmesh.v1 import registry_pb2, registry_pb2_grpc
from toolmesh_testing import eventually

OBJECT = '{"type":"object"}'
STRICT = '{"type":"object","required":["n"]}'


class CountingServicer(RegistryServicer):
    """The real registry servicer, counting what it serves and the watches still open."""

    def __init__(self, registry: Registry) -> None:
        super().__init__(registry)
        self.calls: Counter[str] = Counter()
        self.open_watches = 0

    async def GetTool(
        self, request: registry_pb2.GetToolRequest, context: ServicerContext
    ) -> registry_pb2.GetToolResponse:
        self.calls["GetTool"] += 1
        return await super().GetTool(request, context)

    async def ListTools(
        self, request: registry_pb2.ListToolsRequest, context: ServicerContext
    ) -> registry_pb2.ListToolsResponse:
        self.calls["ListTools"] += 1
        return await super().ListTools(request, context)

    async def WatchTools(
        self, request: registry_pb2.WatchToolsRequest, context: ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchToolsResponse]:
        self.calls["WatchTools"] += 1
        self.open_watches += 1
        try:
            async for response in super().WatchTools(request, context):
                yield response
        finally:
            self.open_watches -= 1

    def reads(self) -> int:
        """Every call a catalog could make."""
        return self.calls["GetTool"] + self.calls["ListTools"] + self.calls["WatchTools"]


@dataclass
class Registered:
    server: RunningServer
    servicer: CountingServicer
    channel: grpc.aio.Channel
    client: RegistryClient
    target: str

    async def put(self, session_id: str, *tools: ToolSpec) -> int:
        return await self.client.put_tools(session_id, tools)

    def catalog(
        self,
        source: WatchSource | None = None,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        idle_s: float = DEFAULT_IDLE_S,
    ) -> WatchedCatalog:
        """A cache over this registry; `source` replaces the plain watch (e.g. to delay it)."""
        if source is None:
            return cached_registry_catalog(
                self.target, self.channel, max_sessions=max_sessions, idle_s=idle_s
            )
        return WatchedCatalog(source, RemoteCatalog(self.channel), max_sessions=max_sessions, idle_s=idle_s)


@pytest_asyncio.fixture
async def registry() -> AsyncIterator[Registered]:
    servicer = CountingServicer(Registry(InMemoryStore()))
    server = await start_server(
        [
            Service(
                descriptor=registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
                servicer=servicer,
                add_to_server=registry_pb2_grpc.add_RegistryServiceServicer_to_server,
            )
        ]
    )
    target = f"127.0.0.1:{server.port}"
    channel = open_channel(target)
    yield Registered(server, servicer, channel, RegistryClient(target, channel=channel), target)
    await channel.close()
    await server.stop(0.1)


@contextlib.asynccontextmanager
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Every task started inside (ours, and the server's for our streams) ends soon after."""
    before = asyncio.all_tasks()
    yield

    def leaked() -> list[asyncio.Task[object]]:
        return [
            task
            for task in asyncio.all_tasks() - before
            # The server's wait for its next call is not a call's task.
            if not task.done() and "_request_registered_call" not in repr(task)
        ]

    with contextlib.suppress(AssertionError):
        await eventually(lambda: not leaked(), timeout=2.0)
    assert leaked() == []


async def unavailable(lookup: Awaitable[ToolSpec | None]) -> ToolmeshError:
    with pytest.raises(ToolmeshError) as raised:
        await lookup
    assert raised.value.code is Code.REGISTRY_UNAVAILABLE
    return raised.value


# Over a real registry.


@pytest.mark.integration
async def test_first_lookup_opens_one_watch_and_later_lookups_make_no_call(registry: Registered) -> None:
    await registry.put("s", ToolSpec("a", "", OBJECT), ToolSpec("b", "", OBJECT))
    async with no_leaked_tasks():
        catalog = registry.catalog()
        # Concurrent first lookups share the one watch.
        found = await asyncio.gather(*(catalog.get_tool("s", name) for name in ("a", "b", "a")))
        assert [tool.name if tool else None for tool in found] == ["a", "b", "a"]
        assert registry.servicer.calls == Counter(WatchTools=1)
        assert registry.servicer.open_watches == 1
        for _ in range(20):
            tool = await catalog.get_tool("s", "b")
            assert tool is not None and tool.name == "b"
        assert registry.servicer.reads() == 1
        await catalog.aclose()


@pytest.mark.integration
async def test_changed_schema_becomes_visible_through_the_watch(registry: Registered) -> None:
    await registry.put("s", ToolSpec("a", "", OBJECT))
    catalog = registry.catalog()
    try:
        first = await catalog.get_tool("s", "a")
        assert first is not None and first.input_schema_json == OBJECT
        await registry.put("s", ToolSpec("a", "", STRICT, timeout_ms=1500))

        async def changed() -> bool:
            tool = await catalog.get_tool("s", "a")
            return tool is not None and tool.input_schema_json == STRICT and tool.timeout_ms == 1500

        await eventually(changed, timeout=1.0, message="the change never arrived")
        # Seen through the watch, not by asking.
        assert registry.servicer.calls == Counter(WatchTools=1)
    finally:
        await catalog.aclose()


@pytest.mark.integration
async def test_tool_put_just_before_the_lookup_is_found_with_one_get_tool(registry: Registered) -> None:
    # The watch's messages after the first are held back, as if still in flight.
    release = asyncio.Event()
    plain = registry_watch_source(registry.client)

    async def delayed(session_id: str) -> AsyncGenerator[ToolSet, None]:
        async with contextlib.aclosing(plain(session_id)) as updates:
            first = True
            async for tools in updates:
                if not first:
                    await release.wait()
                first = False
                yield tools

    await registry.put("s", ToolSpec("a", "", OBJECT))
    catalog = registry.catalog(delayed)
    try:
        assert await catalog.get_tool("s", "a") is not None
        await registry.put("s", ToolSpec("a", "", OBJECT), ToolSpec("b", "", OBJECT))
        added = await catalog.get_tool("s", "b")
        assert added is not None and added.name == "b"
        assert registry.servicer.calls == Counter(WatchTools=1, GetTool=1)
        # A name the registry does not have either: None, after one GetTool.
        assert await catalog.get_tool("s", "missing") is None
        assert registry.servicer.calls["GetTool"] == 2
        # Once the watch delivers, b is answered from memory.
        release.set()

        async def from_memory() -> bool:
            before = registry.servicer.calls["GetTool"]
            if await catalog.get_tool("s", "b") is None:
                pytest.fail("b was found, then not")
            return registry.servicer.calls["GetTool"] == before

        await eventually(from_memory, timeout=1.0)
    finally:
        await catalog.aclose()


@pytest.mark.integration
async def test_least_recently_used_session_is_dropped_with_its_stream(registry: Registered) -> None:
    catalog = registry.catalog(max_sessions=2)
    try:
        for session in ("s1", "s2"):
            await catalog.get_tool(session, "x")
        await catalog.get_tool("s1", "x")  # s2 is now the least recently used
        await catalog.get_tool("s3", "x")
        assert catalog.watched_sessions == ["s1", "s3"]
        await eventually(lambda: registry.servicer.open_watches == 2)
        watches = registry.servicer.calls["WatchTools"]
        await catalog.get_tool("s2", "x")  # opens again, dropping s1
        assert registry.servicer.calls["WatchTools"] == watches + 1
        assert catalog.watched_sessions == ["s3", "s2"]
        await eventually(lambda: registry.servicer.open_watches == 2)
    finally:
        await catalog.aclose()


@pytest.mark.integration
async def test_idle_sessions_are_dropped_with_their_streams(registry: Registered) -> None:
    # Idle after 1 s: lookups every 50 ms keep "busy" watched even on a loaded machine (at 0.3 s a
    # stalled CI worker once let it go idle and watch again).
    catalog = registry.catalog(idle_s=1.0)
    try:
        await catalog.get_tool("idle", "x")
        await catalog.get_tool("busy", "x")

        async def only_busy_left() -> bool:
            await catalog.get_tool("busy", "x")  # looked up more often than idle_s: never idle
            return catalog.watched_sessions == ["busy"]

        await eventually(only_busy_left, interval=0.05)
        assert registry.servicer.calls["WatchTools"] == 2  # "busy" kept its one watch all along
        await eventually(lambda: registry.servicer.open_watches == 1)
        await eventually(lambda: catalog.watched_sessions == [], timeout=5.0)
        await eventually(lambda: registry.servicer.open_watches == 0)
    finally:
        await catalog.aclose()


@pytest.mark.integration
async def test_registry_stopped(registry: Registered) -> None:
    """A new session fails with REGISTRY_UNAVAILABLE. A cached session keeps its last list while its
    watch reconnects (up to stale_s); then it is forgotten, and its next lookup fails the same way."""
    await registry.put("cached", ToolSpec("a", "", OBJECT))
    async with no_leaked_tasks():
        catalog = WatchedCatalog(
            registry_watch_source(registry.client), RemoteCatalog(registry.channel), stale_s=1.0
        )
        assert await catalog.get_tool("cached", "a") is not None
        await registry.server.stop(0.1)
        await asyncio.sleep(0.3)  # the stream broke; it reconnects, in vain
        found = await catalog.get_tool("cached", "a")  # served from the kept list
        assert found is not None and catalog.watched_sessions == ["cached"]
        await unavailable(catalog.get_tool("new", "a"))
        await eventually(lambda: catalog.watched_sessions == [], timeout=5.0)  # past stale_s
        error = await unavailable(catalog.get_tool("cached", "a"))
        assert error.metadata["sessionId"] == "cached" and error.metadata["grpcStatus"]
        await catalog.aclose()


@pytest.mark.integration
async def test_close_cancels_every_stream_and_leaves_no_tasks(registry: Registered) -> None:
    async with no_leaked_tasks():
        catalog = registry.catalog()
        for session in ("c1", "c2", "c3"):
            await catalog.get_tool(session, "x")
        assert registry.servicer.open_watches == 3
        await catalog.aclose()
        await catalog.aclose()  # again: nothing to do
    await eventually(lambda: registry.servicer.open_watches == 0)
    error = await unavailable(catalog.get_tool("c1", "x"))
    assert error.metadata["cause"] == "closed"


# With in-process sources.


@dataclass
class FakeRegistry:
    """A watch source and a fallback catalog over in-memory lists."""

    sessions: dict[str, ToolSet] = field(default_factory=dict)
    opened: Counter[str] = field(default_factory=Counter)
    closed: Counter[str] = field(default_factory=Counter)
    lookups: int = 0
    # What a stream does after its first message: "follow", "end" or "fail"; "hang" sends nothing.
    behaviour: str = "follow"
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def watch(self, session_id: str) -> AsyncGenerator[ToolSet, None]:
        self.opened[session_id] += 1
        try:
            if self.behaviour == "hang":
                await asyncio.Event().wait()
            if self.behaviour == "fail_first":
                raise ToolmeshError(Code.REGISTRY_UNAVAILABLE, "", {"grpcStatus": "UNAVAILABLE"})
            yield self.sessions.get(session_id, ToolSet(0))
            if self.behaviour == "end":
                return
            if self.behaviour == "fail":
                raise RuntimeError("stream broke")
            while True:
                await self.changed.wait()
                yield self.sessions.get(session_id, ToolSet(0))
        finally:
            self.closed[session_id] += 1

    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        self.lookups += 1
        return self.sessions.get(session_id, ToolSet(0)).find(name)


@pytest.mark.unit
async def test_no_first_message_in_time_is_unavailable_and_closes_the_stream() -> None:
    fake = FakeRegistry(behaviour="hang")
    async with no_leaked_tasks():
        catalog = WatchedCatalog(fake.watch, fake, open_timeout_s=0.1)
        error = await unavailable(catalog.get_tool("s", "a"))
        assert error.metadata == {"sessionId": "s", "cause": "watch_timeout"}
        await eventually(lambda: fake.closed["s"] == 1)
        assert catalog.watched_sessions == [] and fake.lookups == 0
        await catalog.aclose()


@pytest.mark.unit
async def test_stream_failing_before_its_first_message_passes_its_error_on() -> None:
    fake = FakeRegistry(behaviour="fail_first")
    catalog = WatchedCatalog(fake.watch, fake)
    error = await unavailable(catalog.get_tool("s", "a"))
    assert error.metadata == {"grpcStatus": "UNAVAILABLE"}
    assert catalog.watched_sessions == []
    await catalog.aclose()


@pytest.mark.unit
@pytest.mark.parametrize("behaviour", ["end", "fail"])
async def test_a_stream_that_ends_or_fails_keeps_its_list_and_reconnects(behaviour: str) -> None:
    fake = FakeRegistry({"s": ToolSet(1, (ToolSpec("a"),))}, behaviour=behaviour)
    async with no_leaked_tasks():
        catalog = WatchedCatalog(fake.watch, fake)
        assert await catalog.get_tool("s", "a") is not None
        await eventually(lambda: fake.opened["s"] >= 2)  # reopened by itself
        assert catalog.watched_sessions == ["s"]
        assert await catalog.get_tool("s", "a") is not None
        assert fake.lookups == 0
        await catalog.aclose()
    assert fake.closed["s"] == fake.opened["s"]


@pytest.mark.unit
async def test_a_broken_watch_serves_its_last_list_with_its_revision_until_it_reconnects() -> None:
    """The registry is down: lookups answer from the kept list (its revision too); the first list
    of the reconnected stream replaces it."""
    fake = FakeRegistry({"s": ToolSet(4, (ToolSpec("a"),))}, behaviour="fail")
    async with no_leaked_tasks():
        catalog = WatchedCatalog(fake.watch, fake)
        assert await catalog.get_tool("s", "a") is not None
        fake.behaviour = "fail_first"  # every reconnection fails: the registry is down
        await eventually(lambda: fake.opened["s"] >= 3)
        kept = await catalog.get_tool("s", "a")
        assert kept is not None and catalog.watched_sessions == ["s"] and fake.lookups == 0
        fake.sessions["s"] = ToolSet(5, (ToolSpec("a", "changed"),))
        fake.behaviour = "follow"  # back

        async def replaced() -> bool:
            tool = await catalog.get_tool("s", "a")
            return tool is not None and tool.description == "changed"

        await eventually(replaced)
        assert fake.lookups == 0  # from the new stream's list, not a direct lookup
        await catalog.aclose()


@pytest.mark.unit
async def test_a_watch_not_reconnected_within_stale_s_is_forgotten() -> None:
    fake = FakeRegistry({"s": ToolSet(1, (ToolSpec("a"),))}, behaviour="fail")
    async with no_leaked_tasks():
        catalog = WatchedCatalog(fake.watch, fake, stale_s=0.3)
        assert await catalog.get_tool("s", "a") is not None
        fake.behaviour = "fail_first"
        await eventually(lambda: catalog.watched_sessions == [])
        await unavailable(catalog.get_tool("s", "a"))
        await catalog.aclose()


@pytest.mark.unit
async def test_a_session_dropped_before_its_first_message_asks_the_fallback() -> None:
    fake = FakeRegistry({"s1": ToolSet(1, (ToolSpec("a"),))}, behaviour="hang")
    async with no_leaked_tasks():
        catalog = WatchedCatalog(fake.watch, fake, max_sessions=1)
        waiting = asyncio.create_task(catalog.get_tool("s1", "a"))
        await eventually(lambda: fake.opened["s1"] == 1)
        other = asyncio.create_task(catalog.get_tool("s2", "a"))  # drops s1
        found = await asyncio.wait_for(waiting, 1.0)
        assert found is not None and found.name == "a" and fake.lookups == 1
        await catalog.aclose()
        await unavailable(other)
    assert fake.closed == Counter(s1=1, s2=1)


@pytest.mark.unit
async def test_a_lookup_cancelled_while_waiting_leaves_the_watch_for_the_next() -> None:
    fake = FakeRegistry({"s": ToolSet(1, (ToolSpec("a"),))}, behaviour="hang")
    catalog = WatchedCatalog(fake.watch, fake)
    waiting = asyncio.create_task(catalog.get_tool("s", "a"))
    await eventually(lambda: fake.opened["s"] == 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert catalog.watched_sessions == ["s"] and fake.closed["s"] == 0
    await catalog.aclose()
    assert fake.closed["s"] == 1


@pytest.mark.unit
@pytest.mark.parametrize(
    ("max_sessions", "idle_s", "open_timeout_s"), [(0, 1.0, 1.0), (1, 0.0, 1.0), (1, 1.0, -1.0)]
)
def test_bounds_must_be_positive(max_sessions: int, idle_s: float, open_timeout_s: float) -> None:
    fake = FakeRegistry()
    with pytest.raises(ValueError, match="positive"):
        WatchedCatalog(
            fake.watch, fake, max_sessions=max_sessions, idle_s=idle_s, open_timeout_s=open_timeout_s
        )
