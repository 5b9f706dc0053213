"""ExchangeHostWork on a real bridge, with raw stubs as hosts: start asks and results on one stream
mean exactly what StartToolRequests and SubmitToolResult mean."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import start_bridge
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.v1 import bridge_pb2, tool_pb2
from toolmesh_testing import bridge_stubs

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

START = bridge_pb2.TOOL_START_VERDICT_START
OK = tool_pb2.ToolOutcome(result_json='{"done": true}')


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stubs() -> AsyncIterator[tuple[Any, Any]]:
    server, _ = await start_bridge(heartbeat_s=0.2)
    async with bridge_stubs(server) as both:
        yield both
    await server.stop(0.1)


class Host:
    """A raw host stream (acknowledging starts) and its ExchangeHostWork stream."""

    def __init__(self, stub: Any, session: str) -> None:
        self.stub = stub
        self.stream = stub.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(
                session_id=session, host_name="test", handler_names=["t"], acknowledges_starts=True
            )
        )
        self.opened: Any = None
        self.requests: asyncio.Queue[Any] = asyncio.Queue()

    async def open(self) -> Host:
        self.opened = (await asyncio.wait_for(self.stream.read(), 5)).opened
        self._reader = asyncio.create_task(self._read())
        return self

    @property
    def id(self) -> str:
        return str(self.opened.host_session_id)

    async def _read(self) -> None:
        while (event := await self.stream.read()) is not grpc.aio.EOF:
            if event.WhichOneof("event") == "tool_request":
                await self.requests.put(event.tool_request)

    async def next_request(self) -> Any:
        return await asyncio.wait_for(self.requests.get(), 5)

    def exchange(self) -> Exchange:
        return Exchange(self.stub, self.id)

    def leave(self) -> None:
        self.stream.cancel()


class Exchange:
    """One ExchangeHostWork stream: `send` a message, `answer` reads the next response."""

    def __init__(self, stub: Any, host_session_id: str) -> None:
        self.host_session_id = host_session_id
        self.call = stub.ExchangeHostWork()

    async def send(
        self, starts: Sequence[str] = (), results: Sequence[str] = (), host_session_id: str | None = None
    ) -> None:
        await self.call.write(
            bridge_pb2.ExchangeHostWorkRequest(
                host_session_id=self.host_session_id if host_session_id is None else host_session_id,
                start_tool_request_ids=starts,
                results=[bridge_pb2.ToolResultSubmission(tool_request_id=i, outcome=OK) for i in results],
            )
        )

    async def answer(self) -> Any:
        response = await asyncio.wait_for(self.call.read(), 5)
        assert response is not grpc.aio.EOF
        return response

    async def start(self, *ids: str) -> list[int]:
        await self.send(starts=list(ids))
        response = await self.answer()
        assert [start.tool_request_id for start in response.starts] == list(ids)
        return [start.verdict for start in response.starts]

    async def submit(self, tool_request_id: str) -> Any:
        await self.send(results=[tool_request_id])
        (receipt,) = (await self.answer()).receipts
        assert receipt.tool_request_id == tool_request_id
        return receipt

    async def failure(self) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            while await asyncio.wait_for(self.call.read(), 5) is not grpc.aio.EOF:
                pass
        return failed.value


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


async def test_start_is_given_once_and_a_result_is_taken_once(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "once").open()
    assert host.opened.host_work_served
    exchange = host.exchange()
    call = dispatch(internal, "once", "once-1")
    await host.next_request()
    assert await exchange.start("once-1") == [START]
    assert await exchange.start("once-1") == [bridge_pb2.TOOL_START_VERDICT_ALREADY_STARTED]
    # Asked by the unary RPC too: the same START, not again.
    unary = await public.StartToolRequests(
        bridge_pb2.StartToolRequestsRequest(host_session_id=host.id, tool_request_ids=["once-1"])
    )
    assert [start.verdict for start in unary.starts] == [bridge_pb2.TOOL_START_VERDICT_ALREADY_STARTED]
    assert not (await exchange.submit("once-1")).HasField("refusal")
    assert (await asyncio.wait_for(call, 5)).outcome.result_json == '{"done": true}'
    # Handed in again after a lost receipt: refused, and the refusal says the first got through.
    again = await exchange.submit("once-1")
    assert again.refusal.reason == Code.REQUEST_ENDED.value
    assert again.refusal.metadata["ended"] == "answered"
    assert await exchange.start("once-1") == [bridge_pb2.TOOL_START_VERDICT_ENDED]
    await exchange.call.done_writing()
    assert await exchange.call.read() is grpc.aio.EOF  # everything answered: the stream ends
    host.leave()


async def test_asks_and_results_go_together_and_are_answered_each(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "together").open()
    exchange = host.exchange()
    calls = [dispatch(internal, "together", f"tg-{index}") for index in range(3)]
    for _ in calls:
        await host.next_request()
    assert await exchange.start("tg-0", "tg-1") == [START, START]
    await exchange.send(starts=["tg-2"], results=["tg-0", "tg-1"])
    starts: list[tuple[str, int]] = []
    receipts: list[str] = []
    while len(starts) < 1 or len(receipts) < 2:
        response = await exchange.answer()
        starts += [(start.tool_request_id, start.verdict) for start in response.starts]
        receipts += [
            receipt.tool_request_id for receipt in response.receipts if not receipt.HasField("refusal")
        ]
    assert starts == [("tg-2", START)] and sorted(receipts) == ["tg-0", "tg-1"]
    assert (await exchange.submit("tg-2")).HasField("refusal") is False
    for call in calls:
        assert (await asyncio.wait_for(call, 5)).outcome.result_json == '{"done": true}'
    host.leave()


async def test_a_receipt_goes_with_the_next_start(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "company").open()
    exchange = host.exchange()
    first = dispatch(internal, "company", "co-1")
    await host.next_request()
    assert await exchange.start("co-1") == [START]
    await exchange.send(results=["co-1"])
    # Its caller has the outcome: the result was taken, and its receipt waits for company.
    assert (await asyncio.wait_for(first, 5)).outcome.result_json == '{"done": true}'
    second = dispatch(internal, "company", "co-2")
    await host.next_request()
    await exchange.send(starts=["co-2"])
    response = await exchange.answer()
    assert [receipt.tool_request_id for receipt in response.receipts] == ["co-1"]
    assert not response.receipts[0].HasField("refusal")
    assert [(start.tool_request_id, start.verdict) for start in response.starts] == [("co-2", START)]
    assert not (await exchange.submit("co-2")).HasField("refusal")  # alone: it comes all the same
    assert (await asyncio.wait_for(second, 5)).outcome.result_json == '{"done": true}'
    host.leave()


async def test_past_its_deadline_a_request_is_refused_and_not_started(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "late").open()
    exchange = host.exchange()
    call = dispatch(internal, "late", "late-1", timeout_ms=150)
    await host.next_request()
    assert (await asyncio.wait_for(call, 5)).outcome.error.code == "TOOL_TIMEOUT"
    assert await exchange.start("late-1") == [bridge_pb2.TOOL_START_VERDICT_TIMED_OUT]
    refused = await exchange.submit("late-1")
    assert refused.refusal.reason == Code.REQUEST_ENDED.value
    host.leave()


async def test_another_host_sessions_request_is_unknown_to_this_one(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    holder = await Host(public, "wrong").open()
    call = dispatch(internal, "wrong", "wrong-1")
    await holder.next_request()
    other = await Host(public, "wrong").open()
    exchange = other.exchange()
    assert await exchange.start("wrong-1") == [bridge_pb2.TOOL_START_VERDICT_UNKNOWN]
    assert (await exchange.submit("wrong-1")).refusal.reason == Code.REQUEST_UNKNOWN.value
    # The holder still may.
    assert await holder.exchange().start("wrong-1") == [START]
    other.leave()
    holder.leave()
    assert (await asyncio.wait_for(call, 5)).outcome.error.code == "TOOL_HOST_DISCONNECTED"


async def test_a_stream_naming_no_open_host_session_or_another_fails(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    unknown = Exchange(public, "hs_nope")
    await unknown.send(starts=["x-1"])
    assert error_code(await unknown.failure()) is Code.HOST_SESSION_UNKNOWN
    host = await Host(public, "names").open()
    other = await Host(public, "names").open()
    exchange = host.exchange()
    call = dispatch(internal, "names", "names-1")
    holder = host if (await asyncio.wait_for(_first_request(host, other), 5)) is host else other
    assert await exchange.start("unsent") == [bridge_pb2.TOOL_START_VERDICT_UNKNOWN]
    await exchange.send(starts=["names-1"], host_session_id=other.id)  # another host session's stream
    assert error_code(await exchange.failure()) is Code.INVALID_REQUEST
    # Nothing of the refused message started: the holder's own START is still to give.
    assert await holder.exchange().start("names-1") == [START]
    call.cancel()
    host.leave()
    other.leave()


async def _first_request(*hosts: Host) -> Host:
    waits = {asyncio.ensure_future(host.next_request()): host for host in hosts}
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in pending:
        wait.cancel()
    return waits[done.pop()]


async def test_limits_one_stream_per_host_session_and_a_thousand_items_per_message(
    stubs: tuple[Any, Any],
) -> None:
    public, internal = stubs
    host = await Host(public, "limits").open()
    first = host.exchange()
    assert await first.start("unsent") == [bridge_pb2.TOOL_START_VERDICT_UNKNOWN]
    second = host.exchange()
    await second.send(starts=["unsent"])
    refused = await second.failure()
    assert error_code(refused) is Code.QUOTA_EXCEEDED and refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(refused)
    assert info is not None and info.metadata["limit"] == "host_work_streams_per_host_session"
    call = dispatch(internal, "limits", "limits-1")
    await host.next_request()
    await first.send(starts=["limits-1"] * 600, results=["limits-1"] * 401)
    assert error_code(await first.failure()) is Code.INVALID_REQUEST
    # The first stream has ended, so another may open; the oversized message started nothing.
    third = host.exchange()
    assert await third.start("limits-1") == [START]
    assert not (await third.submit("limits-1")).HasField("refusal")
    await asyncio.wait_for(call, 5)
    host.leave()


async def test_a_broken_stream_mid_ask_gives_at_most_one_start(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "broken").open()
    exchange = host.exchange()
    call = dispatch(internal, "broken", "broken-1")
    await host.next_request()
    await exchange.send(starts=["broken-1"])
    exchange.call.cancel()  # the host never reads the answer: it does not start the request
    # Asked again by the unary RPC: START if the bridge never read the ask, else not again.
    unary = await public.StartToolRequests(
        bridge_pb2.StartToolRequestsRequest(host_session_id=host.id, tool_request_ids=["broken-1"])
    )
    assert [start.verdict for start in unary.starts] in (
        [START],
        [bridge_pb2.TOOL_START_VERDICT_ALREADY_STARTED],
    )
    # The host session goes on: results by the unary RPC, as before.
    await public.SubmitToolResult(
        bridge_pb2.SubmitToolResultRequest(host_session_id=host.id, tool_request_id="broken-1", outcome=OK)
    )
    assert (await asyncio.wait_for(call, 5)).outcome.result_json == '{"done": true}'
    host.leave()


async def test_the_stream_ends_with_its_host_session(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "ends").open()
    exchange = host.exchange()
    call = dispatch(internal, "ends", "ends-1")
    await host.next_request()
    assert await exchange.start("ends-1") == [START]
    host.leave()
    assert await asyncio.wait_for(exchange.call.read(), 5) is grpc.aio.EOF
    assert (await asyncio.wait_for(call, 5)).outcome.error.code == "TOOL_HOST_DISCONNECTED"


async def test_an_old_host_asking_with_the_unary_rpc_is_served_as_before(stubs: tuple[Any, Any]) -> None:
    public, internal = stubs
    host = await Host(public, "old").open()
    call = dispatch(internal, "old", "old-1")
    await host.next_request()
    unary = await public.StartToolRequests(
        bridge_pb2.StartToolRequestsRequest(host_session_id=host.id, tool_request_ids=["old-1"])
    )
    assert [start.verdict for start in unary.starts] == [START]
    await public.SubmitToolResult(
        bridge_pb2.SubmitToolResultRequest(host_session_id=host.id, tool_request_id="old-1", outcome=OK)
    )
    assert (await asyncio.wait_for(call, 5)).outcome.result_json == '{"done": true}'
    host.leave()
