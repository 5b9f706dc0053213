"""The observer seams: the invoker and the router tell their observer what happens, and nothing else does.

In process, with the invoker's ports played by small doubles; what the
OpenTelemetry observers make of it is checked over real servers in test_tracing.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from toolmesh.bridge.router import HostSession, Router
from toolmesh.contracts.ledger import InvocationRecord, Ledger
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.outcome import Outcome
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.invoker import Invoker
from toolmesh.store.memory import MemoryLedgerStore

pytestmark = pytest.mark.unit

CALL = ToolCall("s", "t", "tool", '{"n": 1}')
CONTEXT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


class OneTool:
    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        return ToolSpec(name, "", '{"type": "object"}', timeout_ms=5000)


class HeldHost:
    """Stands in for the bridge: holds each request until released."""

    def __init__(self) -> None:
        self.dispatched = asyncio.Event()
        self.release = asyncio.Event()

    async def dispatch(self, request: ToolRequest, on_progress: object = None) -> Outcome:
        self.dispatched.set()
        await self.release.wait()
        return Outcome.success('{"ok": true}')


class Recording:
    """An InvocationObserver that writes down every hook, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []
        self.joined = asyncio.Event()

    def call(self, call: ToolCall) -> RecordedCall:
        return RecordedCall(self.events, call)

    @contextlib.contextmanager
    def invocation(self, tool_request_id: str) -> Iterator[None]:
        self.events.append(("invocation", tool_request_id))
        yield
        self.events.append(("invocation ends", tool_request_id))

    @contextlib.contextmanager
    def attached(self, record: InvocationRecord, how: str) -> Iterator[None]:
        self.events.append((how, record.tool_request_id, record.trace_context["traceparent"]))
        if how == "joined":
            self.joined.set()
        yield

    def executing(self, request: ToolRequest) -> RecordedRun:
        return RecordedRun(self.events, request)

    def in_flight(self, change: int) -> None:
        self.events.append(("in flight", str(change)))

    def trace_context(self) -> dict[str, str]:
        return dict(CONTEXT)


class RecordedCall:
    def __init__(self, events: list[tuple[str, ...]], call: ToolCall) -> None:
        self._events = events
        self._events.append(("call", call.session_id, call.turn_id, call.tool_name))

    def __enter__(self) -> None:
        self._events.append(("enter",))

    def __exit__(self, *exc_info: object) -> None:
        self._events.append(("exit",))

    def answered(self, tool_request_id: str, outcome: Outcome) -> None:
        self._events.append(("answered", tool_request_id, outcome.code))


class RecordedRun:
    def __init__(self, events: list[tuple[str, ...]], request: ToolRequest) -> None:
        self._events = events
        self._id = request.tool_request_id

    def __enter__(self) -> RecordedRun:
        self._events.append(("executing", self._id))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._events.append(("executed", self._id))

    def ran(self, outcome: Outcome) -> None:
        self._events.append(("ran", self._id, outcome.code))


async def test_the_invoker_tells_its_observer_each_step_of_a_run_a_join_and_a_replay() -> None:
    observer = Recording()
    host = HeldHost()
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()), observer=observer)

    first = asyncio.ensure_future(invoker.invoke(CALL))
    await host.dispatched.wait()
    second = asyncio.ensure_future(invoker.invoke(CALL))
    await observer.joined.wait()
    host.release.set()
    ran, joined = await first, await second
    replayed = await invoker.invoke(CALL)  # nothing confirmed its delivery: the outcome is replayed

    request_id = ran.tool_request_id
    assert joined.joined and replayed.replayed
    assert joined.tool_request_id == replayed.tool_request_id == request_id
    call = ("call", "s", "t", "tool")
    assert observer.events[:5] == [
        call,
        ("enter",),
        ("invocation", request_id),
        ("executing", request_id),
        ("in flight", "1"),
    ]
    # The run alone is executed, once, around its dispatch, and told its outcome.
    assert observer.events.count(("executing", request_id)) == 1
    ran_at = observer.events.index(("ran", request_id, "OK"))
    assert observer.events[ran_at + 1] == ("executed", request_id)
    assert observer.events.index(("in flight", "-1")) < ran_at
    assert ("joined", request_id, CONTEXT["traceparent"]) in observer.events
    assert observer.events[-7:] == [
        call,
        ("enter",),
        ("invocation", request_id),
        ("replayed", request_id, CONTEXT["traceparent"]),
        ("invocation ends", request_id),
        ("answered", request_id, "OK"),
        ("exit",),
    ]
    assert observer.events.count(("answered", request_id, "OK")) == 3
    assert observer.events.count(("in flight", "1")) == observer.events.count(("in flight", "-1")) == 1
    # What the ledger keeps to link later calls is what the observer gave it.
    record = await invoker.ledger.get(request_id)
    assert record is not None and record.trace_context == CONTEXT


async def test_an_invoker_without_an_observer_keeps_nothing_for_links() -> None:
    host = HeldHost()
    host.release.set()
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()))
    result = await invoker.invoke(CALL)
    record = await invoker.ledger.get(result.tool_request_id)
    assert result.outcome.ok and record is not None and record.trace_context == {}


class Hosts:
    """A RouterObserver that counts connected hosts."""

    def __init__(self) -> None:
        self.connected: list[str] = []

    def host_opened(self, host: HostSession) -> None:
        self.connected.append(host.host_session_id)

    def host_closed(self, host: HostSession) -> None:
        self.connected.remove(host.host_session_id)


async def test_the_router_tells_its_observer_when_hosts_come_and_go() -> None:
    observer = Hosts()
    router = Router(observer=observer)
    one = router.open_host("s", "one", ["tool"], False)
    two = router.open_host("s", "two", [], True)
    assert observer.connected == [one.host_session_id, two.host_session_id]
    router.close_host(one)
    router.close_host(one)  # closing twice tells it once
    assert observer.connected == [two.host_session_id]
    router.close_host(two)
    assert observer.connected == []
