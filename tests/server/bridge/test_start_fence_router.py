"""The bridge's side of the start fence, on a Router whose fence is a ledger in memory.

A fenced request (one carrying a dispatch generation, not read-only nor idempotent) starts only
once its start is marked in the ledger: at START for a host that acknowledges starts, before it
is sent to one that does not. A mark refused ends it on this replica as not run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from functools import partial

import pytest
import pytest_asyncio

from redis_testing import RedisServer, new_prefix
from toolmesh.bridge.router import START_FENCE, HostSession, Router, StartVerdict, ToolRequestCancelled
from toolmesh.contracts.ledger import Ledger
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.store import slots
from toolmesh.store.backends import open_stores
from toolmesh.store.ledger import MarkVerdict, StartMark
from toolmesh.store.memory import MemoryLedgerStore
from toolmesh_testing import eventually

SESSION = "fenced"


class Refusals:
    """A fence that counts the ledger's STORE_UNAVAILABLE refusals of the marks it passes on."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.refused = 0

    async def mark_started(self, marks: Sequence[StartMark]) -> list[MarkVerdict]:
        try:
            return await self.ledger.mark_started(marks)
        except ToolmeshError as error:
            self.refused += error.code is Code.STORE_UNAVAILABLE
            raise


class Unreachable:
    """A fence whose store cannot be reached (as the Ledger raises it)."""

    def __init__(self) -> None:
        self.asked: list[StartMark] = []

    async def mark_started(self, marks: Sequence[StartMark]) -> list[MarkVerdict]:
        self.asked.extend(marks)
        raise ToolmeshError(Code.STORE_UNAVAILABLE)


async def claimed(ledger: Ledger, name: str) -> str:
    tool_request_id = slots.tool_request_id(SESSION, name)
    await ledger.claim(ToolCall(SESSION, "turn", "t", f'{{"n": "{name}"}}'), tool_request_id, 10_000)
    return tool_request_id


def request(tool_request_id: str, *, generation: int = 1, redeliverable: bool = False) -> ToolRequest:
    return ToolRequest(
        SESSION,
        "turn",
        tool_request_id,
        "t",
        "{}",
        10_000,
        redeliverable=redeliverable,
        dispatch_generation=generation,
    )


def open_host(router: Router, *, acks: bool = True) -> HostSession:
    return router.open_host(SESSION, "test", ["t"], False, acknowledges_starts=acks)


async def next_request(host: HostSession, timeout: float = 2) -> ToolRequest | ToolRequestCancelled:
    while True:
        event = await asyncio.wait_for(host.next_event(), timeout)
        if isinstance(event, ToolRequest | ToolRequestCancelled):
            return event


def fence_of(outcome: Outcome) -> str:
    failure = outcome.failure
    assert failure is not None and failure.code == Code.TOOL_HOST_UNAVAILABLE, outcome
    assert failure.details is not None
    return str(failure.details[START_FENCE])


@pytest.mark.unit
async def test_a_start_is_granted_once_its_mark_is_in_the_ledger() -> None:
    ledger = Ledger(MemoryLedgerStore())
    router = Router(fence=ledger)
    host = open_host(router)
    tool_request_id = await claimed(ledger, "won")
    outcomes: list[Outcome] = []
    router.start(request(tool_request_id), outcomes.append)
    sent = await next_request(host)
    assert isinstance(sent, ToolRequest) and sent.dispatch_generation == 0  # hosts never see it
    before = await ledger.get(tool_request_id)
    assert before is not None and before.started_at is None
    assert await router.start_requests(host.host_session_id, [tool_request_id]) == [StartVerdict.START]
    after = await ledger.get(tool_request_id)
    assert after is not None and after.started_at is not None
    # The delivery is started: the invocation service may not send it elsewhere.
    assert await ledger.redispatch(tool_request_id, 1) == 0
    assert outcomes == []


@pytest.mark.unit
async def test_a_delivery_whose_generation_moved_on_is_not_started_and_ends_as_not_run() -> None:
    ledger = Ledger(MemoryLedgerStore())
    router = Router(fence=ledger)
    host = open_host(router)
    moved, ended = await claimed(ledger, "moved"), await claimed(ledger, "ended")
    outcomes: dict[str, Outcome] = {}
    for tool_request_id in (moved, ended):
        router.start(request(tool_request_id), partial(outcomes.__setitem__, tool_request_id))
        await next_request(host)
    # The invocation service lost this replica (as it saw it) and sent one elsewhere; the other ended.
    assert await ledger.redispatch(moved, 1) == 2
    await ledger.finish(ended, Outcome.success("1"))
    verdicts = await router.start_requests(host.host_session_id, [moved, ended])
    assert verdicts == [StartVerdict.CANCELLED, StartVerdict.CANCELLED]
    assert {fence_of(outcomes[moved]), fence_of(outcomes[ended])} == {"lost", "ended"}
    cancelled = {(await next_request(host)).tool_request_id for _ in range(2)}
    assert cancelled == {moved, ended}
    # Asked again: ended here, as cancelled.
    assert await router.start_requests(host.host_session_id, [moved]) == [StartVerdict.CANCELLED]
    record = await ledger.get(moved)
    assert record is not None and record.started_at is None


def unclaimed(name: str) -> tuple[str, ToolCall]:
    """An invocation's id and call, not claimed yet."""
    return slots.tool_request_id(SESSION, name), ToolCall(SESSION, "turn", "t", f'{{"n": "{name}"}}')


@pytest.mark.unit
@pytest.mark.parametrize("acks", [True, False])
async def test_a_request_sent_before_its_claim_starts_once_the_claim_is_in_the_ledger(acks: bool) -> None:
    ledger = Ledger(MemoryLedgerStore())
    router = Router(fence=ledger)
    host = open_host(router, acks=acks)
    tool_request_id, call = unclaimed("early")
    outcomes: list[Outcome] = []
    router.start(request(tool_request_id), outcomes.append)
    if acks:
        sent = await next_request(host)
        assert sent.tool_request_id == tool_request_id
        starting = asyncio.ensure_future(router.start_requests(host.host_session_id, [tool_request_id]))
    else:
        sending = asyncio.ensure_future(next_request(host))
    await asyncio.sleep(0.05)  # the marks find nothing meanwhile, and are asked again
    if acks:
        assert not starting.done()
    else:
        assert not sending.done()  # nothing is sent to a host that starts at once
    await ledger.claim(call, tool_request_id, 10_000)
    if acks:
        assert await asyncio.wait_for(starting, 2) == [StartVerdict.START]
    else:
        assert (await asyncio.wait_for(sending, 2)).tool_request_id == tool_request_id
    record = await ledger.get(tool_request_id)
    assert record is not None and record.started_at is not None
    assert outcomes == []


@pytest.mark.unit
async def test_a_request_sent_before_a_claim_that_made_nothing_is_withdrawn_unstarted() -> None:
    ledger = Ledger(MemoryLedgerStore())
    router = Router(fence=ledger)
    host = open_host(router)
    tool_request_id, _ = unclaimed("joined")
    router.start(request(tool_request_id), lambda _: None)
    await next_request(host)
    starting = asyncio.ensure_future(router.start_requests(host.host_session_id, [tool_request_id]))
    await asyncio.sleep(0.05)
    router.cancel(tool_request_id)  # its claim joined another invocation: the invocation service withdraws it
    assert await asyncio.wait_for(starting, 2) == [StartVerdict.CANCELLED]
    assert await ledger.get(tool_request_id) is None


@pytest.mark.unit
async def test_a_request_whose_claim_never_comes_ends_as_not_run_within_its_time() -> None:
    ledger = Ledger(MemoryLedgerStore())
    router = Router(fence=ledger, mark_retry_s=0.3)
    host = open_host(router)
    tool_request_id, _ = unclaimed("never")
    outcomes: list[Outcome] = []
    router.start(request(tool_request_id), outcomes.append)
    await next_request(host)
    verdicts = await asyncio.wait_for(router.start_requests(host.host_session_id, [tool_request_id]), 2)
    assert verdicts == [StartVerdict.CANCELLED]
    assert [fence_of(outcome) for outcome in outcomes] == ["absent"]


@pytest.mark.unit
async def test_no_start_while_the_ledger_cannot_be_reached() -> None:
    fence = Unreachable()
    router = Router(fence=fence, mark_retry_s=0.2)
    host = open_host(router)
    outcomes: list[Outcome] = []
    router.start(request(slots.tool_request_id(SESSION, "out")), outcomes.append)
    sent = await next_request(host)
    assert await router.start_requests(host.host_session_id, [sent.tool_request_id]) == [
        StartVerdict.CANCELLED
    ]
    assert [fence_of(outcome) for outcome in outcomes] == ["store_unavailable"]
    # Asked again, after 50 ms, then 100 (a loaded machine may leave time for one only).
    assert len(fence.asked) >= 2
    assert {(mark.tool_request_id, mark.generation) for mark in fence.asked} == {(sent.tool_request_id, 1)}


@pytest.mark.unit
async def test_unfenced_requests_are_not_marked() -> None:
    fence = Unreachable()
    router = Router(fence=fence)
    host = open_host(router)
    # Read-only or idempotent (it may run again anyway), or from an invocation service that sent
    # no generation: granted as before, without the ledger.
    router.start(request(slots.tool_request_id(SESSION, "ro"), redeliverable=True), lambda _: None)
    router.start(request(slots.tool_request_id(SESSION, "old"), generation=0), lambda _: None)
    ids = [(await next_request(host)).tool_request_id for _ in range(2)]
    assert await router.start_requests(host.host_session_id, ids) == [StartVerdict.START] * 2
    assert fence.asked == []


@pytest.mark.unit
async def test_a_host_that_does_not_acknowledge_starts_gets_a_request_only_once_its_start_is_marked() -> None:
    ledger = Ledger(MemoryLedgerStore())
    router = Router(fence=ledger)
    host = open_host(router, acks=False)
    marked, moved = await claimed(ledger, "marked"), await claimed(ledger, "moved")
    assert await ledger.redispatch(moved, 1) == 2  # sent elsewhere before this replica read it
    outcomes: list[Outcome] = []
    router.start(request(moved), outcomes.append)
    router.start(request(marked), outcomes.append)
    sent = await next_request(host)
    assert sent.tool_request_id == marked
    record = await ledger.get(marked)
    assert record is not None and record.started_at is not None
    assert [fence_of(outcome) for outcome in outcomes] == ["lost"]
    with pytest.raises(TimeoutError):
        await next_request(host, timeout=0.2)  # the one that moved on was never sent


@pytest.mark.unit
async def test_a_request_whose_host_left_before_its_start_was_marked_was_never_sent_there() -> None:
    ledger = Ledger(MemoryLedgerStore())
    router = Router(fence=ledger)
    first = open_host(router, acks=False)
    outcomes: list[Outcome] = []
    tool_request_id = await claimed(ledger, "left")
    router.start(request(tool_request_id), outcomes.append)
    router.close_host(first)  # before its start could be marked: it waits for the next host
    assert outcomes == []
    second = open_host(router)
    sent = await next_request(second)
    assert sent.tool_request_id == tool_request_id
    # START, even when the first host's mark was written first: it is this process's own mark.
    assert await router.start_requests(second.host_session_id, [tool_request_id]) == [StartVerdict.START]
    assert outcomes == []
    with pytest.raises(asyncio.QueueEmpty):
        while True:
            event = first._events.get_nowait()
            assert not isinstance(event, ToolRequest)


@pytest_asyncio.fixture
async def redis_ledger(redis_server: RedisServer) -> AsyncIterator[Ledger]:
    """A ledger on a real Redis of the test's own (redis_server: to kill and start again)."""
    stores = open_stores(redis_server.url, new_prefix())
    try:
        yield Ledger(stores.ledger)
    finally:
        await stores.close()


async def sent_then_redis_killed(
    router: Router, ledger: Ledger, redis_server: RedisServer, name: str
) -> tuple[HostSession, str, list[Outcome]]:
    """A host of `router`, a claimed request sent to it, and its outcomes; then Redis SIGKILLed."""
    host = open_host(router)
    tool_request_id = await claimed(ledger, name)
    outcomes: list[Outcome] = []
    router.start(request(tool_request_id), outcomes.append)
    await next_request(host)
    await redis_server.kill()
    return host, tool_request_id, outcomes


@pytest.mark.integration
async def test_a_start_asked_while_redis_restarts_waits_for_it_and_starts_once(
    redis_ledger: Ledger, redis_server: RedisServer
) -> None:
    # A real Redis, SIGKILLed as a host asks to start, and started again on its append-only file.
    fence = Refusals(redis_ledger)
    router = Router(fence=fence)
    sent = await sent_then_redis_killed(router, redis_ledger, redis_server, "restart")
    host, tool_request_id, outcomes = sent
    asking = asyncio.create_task(router.start_requests(host.host_session_id, [tool_request_id]))
    await eventually(lambda: fence.refused >= 2)  # nothing listens on the port: asked again
    assert not asking.done()
    await redis_server.start()
    assert await asyncio.wait_for(asking, 5) == [StartVerdict.START]
    record = await redis_ledger.get(tool_request_id)
    assert record is not None and record.started_at is not None
    assert await redis_ledger.redispatch(tool_request_id, 1) == 0
    assert outcomes == []
    # Told START once: asked again, it is not started again.
    assert await router.start_requests(host.host_session_id, [tool_request_id]) == [
        StartVerdict.ALREADY_STARTED
    ]


@pytest.mark.integration
async def test_a_start_whose_redis_stays_down_ends_as_not_run(
    redis_ledger: Ledger, redis_server: RedisServer
) -> None:
    router = Router(fence=redis_ledger, mark_retry_s=0.3)
    host, tool_request_id, outcomes = await sent_then_redis_killed(router, redis_ledger, redis_server, "down")
    verdicts = await router.start_requests(host.host_session_id, [tool_request_id])
    assert verdicts == [StartVerdict.CANCELLED]
    assert [fence_of(outcome) for outcome in outcomes] == ["store_unavailable"]
    await redis_server.start()
    # Nothing was marked: the invocation service may send it through another replica.
    assert await redis_ledger.redispatch(tool_request_id, 1) == 2


class Gated:
    """A fence that holds every mark until `open` is set (a ledger that answers late), then marks."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.open = asyncio.Event()
        self.waiting = 0

    async def mark_started(self, marks: Sequence[StartMark]) -> list[MarkVerdict]:
        self.waiting += 1
        await self.open.wait()
        return await self.ledger.mark_started(marks)


@pytest.mark.unit
async def test_a_host_that_leaves_while_its_start_is_being_marked_never_started_it() -> None:
    # START is told only once the mark is in the ledger: a host gone before that never ran it, so
    # the request goes to another host of the session, not TOOL_HOST_DISCONNECTED.
    ledger = Ledger(MemoryLedgerStore())
    fence = Gated(ledger)
    router = Router(fence=fence)
    first = open_host(router)
    tool_request_id = await claimed(ledger, "marking")
    outcomes: list[Outcome] = []
    router.start(request(tool_request_id), outcomes.append)
    await next_request(first)
    asking = asyncio.ensure_future(router.start_requests(first.host_session_id, [tool_request_id]))
    await eventually(lambda: fence.waiting == 1)
    # Asked again while the first ask is being marked: not a second START.
    assert await router.start_requests(first.host_session_id, [tool_request_id]) == [
        StartVerdict.ALREADY_STARTED
    ]
    second = open_host(router)
    router.close_host(first)
    assert (await next_request(second)).tool_request_id == tool_request_id
    fence.open.set()
    assert await asyncio.wait_for(asking, 2) == [StartVerdict.UNKNOWN]  # the first host is gone
    assert await router.start_requests(second.host_session_id, [tool_request_id]) == [StartVerdict.START]
    router.submit(second.host_session_id, tool_request_id, Outcome.success('{"ran": 1}'))
    assert [outcome.result_json for outcome in outcomes] == ['{"ran": 1}']
