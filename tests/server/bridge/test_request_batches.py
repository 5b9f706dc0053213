"""Tool requests ready together go to a host in one event when it reads batches
(OpenHostSessionRequest.reads_tool_request_batches), one by one to a host that does not; a real
bridge, raw stubs as the host and as the invocation service's dispatch stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from toolmesh.assembly.system import start_bridge
from toolmesh.bridge.router import EndReason, HostSession, ToolRequestCancelled
from toolmesh.core.calls import ToolRequest
from toolmesh.v1 import bridge_pb2, tool_pb2
from toolmesh_testing import bridge_stubs

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

OK = tool_pb2.ToolOutcome(result_json='{"done": true}')


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stubs() -> AsyncIterator[tuple[Any, Any]]:
    server, _ = await start_bridge(heartbeat_s=30)
    async with bridge_stubs(server) as both:
        yield both
    await server.stop(0.1)


async def open_host(stub: Any, session: str, *, batches: bool) -> tuple[Any, Any]:
    stream = stub.OpenHostSession(
        bridge_pb2.OpenHostSessionRequest(
            session_id=session, host_name="test", handler_names=["t"], reads_tool_request_batches=batches
        )
    )
    opened = (await asyncio.wait_for(stream.read(), 5)).opened
    return stream, opened


def requests(session: str, ids: list[str]) -> bridge_pb2.DispatchToolRequestsRequest:
    return bridge_pb2.DispatchToolRequestsRequest(
        requests=[
            bridge_pb2.ToolRequest(
                session_id=session,
                turn_id="turn",
                tool_request_id=request_id,
                tool_name="t",
                arguments_json=f'{{"n": {n}}}',
                timeout_ms=5000,
            )
            for n, request_id in enumerate(ids)
        ]
    )


async def read_requests(stream: Any, count: int) -> tuple[list[str], list[str]]:
    """The ids of the next `count` requests, in order, and the kind of each event that brought them."""
    ids: list[str] = []
    kinds: list[str] = []
    while len(ids) < count:
        event = await asyncio.wait_for(stream.read(), 5)
        kind = event.WhichOneof("event")
        if kind == "tool_request":
            ids.append(event.tool_request.tool_request_id)
        elif kind == "tool_requests":
            ids.extend(request.tool_request_id for request in event.tool_requests.requests)
        else:
            continue
        kinds.append(kind)
    return ids, kinds


@pytest.mark.parametrize("batches", [True, False])
async def test_requests_ready_together_come_in_one_event_to_a_host_that_reads_batches(
    stubs: tuple[Any, Any], batches: bool
) -> None:
    public, internal = stubs
    session = f"batches-{batches}"
    stream, opened = await open_host(public, session, batches=batches)
    assert opened.tool_requests_batched is batches
    dispatch = internal.DispatchToolRequests()
    ids = [f"{session}-{n}" for n in range(5)]
    await dispatch.write(requests(session, ids))  # five in one message: queued for the host together
    received, kinds = await read_requests(stream, len(ids))
    assert received == ids  # in order, whichever way they came
    assert kinds == (["tool_requests"] if batches else ["tool_request"] * len(ids))
    # Each is its own request still: answered one by one, each outcome to its own call.
    for request_id in reversed(ids):
        await public.SubmitToolResult(
            bridge_pb2.SubmitToolResultRequest(
                host_session_id=opened.host_session_id, tool_request_id=request_id, outcome=OK
            )
        )
    answered: list[str] = []
    while len(answered) < len(ids):
        response = await asyncio.wait_for(dispatch.read(), 5)
        answered.extend(result.tool_request_id for result in response.results if result.HasField("outcome"))
    assert sorted(answered) == sorted(ids)
    dispatch.cancel()
    stream.cancel()


def request(request_id: str, arguments: str = "{}") -> ToolRequest:
    return ToolRequest("s", "turn", request_id, "t", arguments, 5000)


async def test_a_batch_stops_at_an_event_that_is_not_a_request_and_at_its_budgets() -> None:
    host = HostSession("h", "s", "test", frozenset({"t"}), False)
    cancelled = ToolRequestCancelled("r0", EndReason.CANCELLED)
    for event in (request("r0"), request("r1"), cancelled, request("r2"), request("r3", "x" * 100)):
        host.send(event)
    assert await host.next_event() == request("r0")
    # r1, then the cancellation ends the batch: it is the next event, before r2.
    assert host.ready_requests(10, 1_000) == [request("r1")]
    assert host.ready_requests(10, 1_000) == []
    assert await host.next_event() == cancelled
    # At most `items` requests, and arguments of at most `budget_bytes` together: r3 waits.
    assert host.ready_requests(10, 50) == [request("r2")]
    assert await host.next_event() == request("r3", "x" * 100)
    host.send(request("r4"))
    host.send(request("r5"))
    assert host.ready_requests(1, 1_000) == [request("r4")]
    assert host.ready_requests(1, 1_000) == [request("r5")]
    assert host.ready_requests(1, 1_000) == []
