"""Start acknowledgements and absolute deadlines on a real bridge, with raw stubs as hosts.

A host that acknowledges starts asks StartToolRequests before running a request; one it never
got START for has not run, so when its host goes away it goes to another host (or waits for
one) instead of ending TOOL_HOST_DISCONNECTED.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import start_bridge
from toolmesh.bridge.router import Router
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code
from toolmesh.v1 import bridge_pb2, tool_pb2
from toolmesh_testing import bridge_stubs, eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

START = bridge_pb2.TOOL_START_VERDICT_START
OK = tool_pb2.ToolOutcome(result_json='{"done": true}')


ROUTER: list[Router] = []


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stubs() -> AsyncIterator[tuple[Any, Any]]:
    server, router = await start_bridge(heartbeat_s=0.2)
    ROUTER.append(router)
    async with bridge_stubs(server) as both:
        yield both
    await server.stop(0.1)


class Host:
    """A raw host stream; `acks`: it opens with acknowledges_starts."""

    def __init__(self, stub: Any, session: str, *, acks: bool = True) -> None:
        self.stub = stub
        self.stream = stub.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(
                session_id=session, host_name="test", handler_names=["t"], acknowledges_starts=acks
            )
        )
        self.opened: Any = None
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.reader: asyncio.Task[None] | None = None

    async def open(self) -> Host:
        self.opened = (await asyncio.wait_for(self.stream.read(), 5)).opened
        self.reader = asyncio.create_task(self._read())
        return self

    @property
    def id(self) -> str:
        return str(self.opened.host_session_id)

    async def _read(self) -> None:
        while (event := await self.stream.read()) is not grpc.aio.EOF:
            await self.events.put(event)

    async def next(self, kind: str, timeout: float = 5) -> Any:
        async def first_of_kind() -> Any:
            while True:
                event = await self.events.get()
                if event.WhichOneof("event") == kind:
                    return getattr(event, kind)

        return await asyncio.wait_for(first_of_kind(), timeout)

    async def start(self, *ids: str, host_session_id: str | None = None) -> list[int]:
        response = await self.stub.StartToolRequests(
            bridge_pb2.StartToolRequestsRequest(
                host_session_id=self.id if host_session_id is None else host_session_id,
                tool_request_ids=list(ids),
            )
        )
        assert [start.tool_request_id for start in response.starts] == list(ids)
        return [start.verdict for start in response.starts]

    async def submit(self, request_id: str) -> None:
        await self.stub.SubmitToolResult(
            bridge_pb2.SubmitToolResultRequest(
                host_session_id=self.id, tool_request_id=request_id, outcome=OK
            )
        )

    def leave(self) -> None:
        self.stream.cancel()


def dispatch(internal: Any, session: str, request_id: str, timeout_ms: int = 5000) -> asyncio.Future[Any]:
    message = bridge_pb2.DispatchToolRequestRequest(
        request=bridge_pb2.ToolRequest(
            session_id=session,
            turn_id="turn",
            tool_request_id=request_id,
            tool_name="t",
            arguments_json="{}",
            timeout_ms=timeout_ms,
        )
    )
    call: asyncio.Future[Any] = asyncio.ensure_future(internal.DispatchToolRequest(message))
    return call


async def test_the_bridge_says_its_clock_and_the_requests_deadline(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    before_ms = time.time() * 1000
    host = await Host(public, "clock").open()
    assert host.opened.starts_acknowledged
    assert before_ms - 1 <= host.opened.server_time_unix_ms <= time.time() * 1000 + 1
    beat = await host.next("heartbeat")
    assert beat.server_time_unix_ms >= host.opened.server_time_unix_ms
    # The answer to a read check says the clock too: read after the host asked, it bounds the offset.
    asked_ms = time.time() * 1000
    answer = await public.AnswerReadCheck(
        bridge_pb2.AnswerReadCheckRequest(host_session_id=host.id, read_check=beat.read_check)
    )
    assert asked_ms - 1 <= answer.server_time_unix_ms <= time.time() * 1000
    sent_ms = time.time() * 1000
    call = dispatch(internal, "clock", "clk-1", timeout_ms=4000)
    request = await host.next("tool_request")
    assert sent_ms + 4000 - 1 <= request.deadline_unix_ms <= time.time() * 1000 + 4000 + 1
    assert await host.start("clk-1") == [START]
    await host.submit("clk-1")
    assert (await call).outcome.result_json == '{"done": true}'
    # A host that does not ask is told nothing of acknowledgements.
    old = await Host(public, "clock-old", acks=False).open()
    assert not old.opened.starts_acknowledged
    host.leave()
    old.leave()


async def test_a_request_never_started_goes_to_another_host_and_runs_there(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    first = await Host(public, "moves").open()
    call = dispatch(internal, "moves", "mv-1")
    sent = await first.next("tool_request")
    assert not sent.redeliverable
    second = await Host(public, "moves").open()
    first.leave()  # delivered, never asked to start
    again = await second.next("tool_request")
    assert again.tool_request_id == "mv-1"
    assert again.deadline_unix_ms == sent.deadline_unix_ms  # the same deadline on every delivery
    assert again.timeout_ms <= sent.timeout_ms
    assert await second.start("mv-1") == [START]
    await second.submit("mv-1")
    assert (await asyncio.wait_for(call, 5)).outcome.result_json == '{"done": true}'
    second.leave()


async def test_a_request_never_started_waits_for_the_next_host(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    page = await Host(public, "reload").open()
    call = dispatch(internal, "reload", "rl-1")
    await page.next("tool_request")
    page.leave()  # the page reloads: no host of the session for a while
    await eventually(lambda: not ROUTER[0].serves("reload"))
    assert not call.done()
    reloaded = await Host(public, "reload").open()
    assert (await reloaded.next("tool_request")).tool_request_id == "rl-1"
    assert await reloaded.start("rl-1") == [START]
    await reloaded.submit("rl-1")
    assert (await asyncio.wait_for(call, 5)).outcome.result_json == '{"done": true}'
    reloaded.leave()


async def test_a_started_request_keeps_tool_host_disconnected(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    holder = await Host(public, "started").open()
    call = dispatch(internal, "started", "st-1")
    await holder.next("tool_request")
    other = await Host(public, "started").open()
    assert await holder.start("st-1") == [START]
    # START once: asked again, by the holder or by another host session, it is not given.
    assert await holder.start("st-1") == [bridge_pb2.TOOL_START_VERDICT_ALREADY_STARTED]
    assert await other.start("st-1") == [bridge_pb2.TOOL_START_VERDICT_UNKNOWN]
    assert await holder.start("never-sent") == [bridge_pb2.TOOL_START_VERDICT_UNKNOWN]
    holder.leave()
    outcome = (await asyncio.wait_for(call, 5)).outcome
    assert outcome.error.code == "TOOL_HOST_DISCONNECTED"
    other.leave()


async def test_start_after_the_deadline_is_refused_and_the_caller_has_tool_timeout(
    stubs: tuple[Any, Any],
) -> None:
    public, internal = stubs
    host = await Host(public, "late").open()
    call = dispatch(internal, "late", "lt-1", timeout_ms=150)
    await host.next("tool_request")
    assert (await asyncio.wait_for(call, 5)).outcome.error.code == "TOOL_TIMEOUT"
    assert await host.start("lt-1") == [bridge_pb2.TOOL_START_VERDICT_TIMED_OUT]
    # A request cancelled by its caller is not started either.
    cancelled = dispatch(internal, "late", "lt-2")
    await host.next("tool_request")
    cancelled.cancel()
    await host.next("cancelled")
    assert await host.start("lt-2") == [bridge_pb2.TOOL_START_VERDICT_CANCELLED]
    # Answered: ended.
    answered = dispatch(internal, "late", "lt-3")
    await host.next("tool_request")
    await host.submit("lt-3")
    await answered
    assert await host.start("lt-3") == [bridge_pb2.TOOL_START_VERDICT_ENDED]
    host.leave()


async def test_progress_counts_as_a_start(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "progress").open()
    call = dispatch(internal, "progress", "pg-1")
    await host.next("tool_request")
    report = bridge_pb2.ReportToolProgressRequest(host_session_id=host.id, tool_request_id="pg-1", progress=1)
    assert (await public.ReportToolProgress(report)).status == bridge_pb2.PROGRESS_REPORT_STATUS_ACCEPTED
    assert await host.start("pg-1") == [bridge_pb2.TOOL_START_VERDICT_ALREADY_STARTED]
    host.leave()
    assert (await asyncio.wait_for(call, 5)).outcome.error.code == "TOOL_HOST_DISCONNECTED"


async def test_a_host_without_the_flag_is_served_as_before(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    old = await Host(public, "old", acks=False).open()
    spare = await Host(public, "old-spare", acks=False).open()  # another session: never a target
    call = dispatch(internal, "old", "old-1")
    await old.next("tool_request")
    old.leave()
    assert (await asyncio.wait_for(call, 5)).outcome.error.code == "TOOL_HOST_DISCONNECTED"
    spare.leave()


async def test_bad_start_requests_are_refused_whole(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "bad").open()
    call = dispatch(internal, "bad", "bad-1")
    await host.next("tool_request")
    for ids, host_session_id, code in [
        (["bad-1"], "hs_nope", Code.HOST_SESSION_UNKNOWN),
        (["bad-1", "not an id!"], None, Code.INVALID_REQUEST),
        (["bad-1"] * 1001, None, Code.INVALID_REQUEST),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await host.start(*ids, host_session_id=host_session_id)
        assert error_code(refused.value) is code
    # None of those started it.
    assert await host.start("bad-1") == [START]
    await host.submit("bad-1")
    await call
    host.leave()
