"""BridgeService over a real server with raw stubs: the host path and every submit refusal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import start_bridge
from toolmesh.core.errors import Code
from toolmesh.core.limits import MAX_RESULT_BYTES
from toolmesh.core.rpcstatus import error_code
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, tool_pb2

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


class BridgeStubs:
    """Hosts' RPCs on the public listener, the invocation service's Dispatch* on the internal one."""

    def __init__(self, public: grpc.aio.Channel, internal: grpc.aio.Channel) -> None:
        self._public = bridge_pb2_grpc.BridgeServiceStub(public)
        self._internal = bridge_pb2_grpc.BridgeServiceStub(internal)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._internal if name.startswith("Dispatch") else self._public, name)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def bridge() -> AsyncIterator[BridgeStubs]:
    server, _ = await start_bridge(heartbeat_s=0.2)
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as public,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.internal_port}") as internal,
    ):
        yield BridgeStubs(public, internal)
    await server.stop(0.1)


class Host:
    def __init__(self, stub: Any, session: str, handlers: list[str], *, generic: bool = False) -> None:
        self.stub = stub
        self.stream = stub.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(
                session_id=session, host_name="test", handler_names=handlers, has_generic_handler=generic
            )
        )
        self.id = ""
        # Reading in one task: cancelling a pending read would cancel the whole stream.
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        # The id of every tool request received, taken by `next` or not.
        self.request_ids: list[str] = []
        self.reader: asyncio.Task[None] | None = None

    async def open(self) -> Host:
        opened = await asyncio.wait_for(self.stream.read(), 5)
        self.id = opened.opened.host_session_id
        assert opened.opened.heartbeat_interval_ms == 200
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while (event := await self.stream.read()) is not grpc.aio.EOF:
            if event.WhichOneof("event") == "tool_request":
                self.request_ids.append(event.tool_request.tool_request_id)
            await self.events.put(event)

    async def next(self, kind: str, timeout: float = 5) -> Any:
        async def first_of_kind() -> Any:
            while True:
                event = await self.events.get()
                if event.WhichOneof("event") == kind:
                    return getattr(event, kind)

        return await asyncio.wait_for(first_of_kind(), timeout)

    async def submit(self, request_id: str, outcome: tool_pb2.ToolOutcome) -> None:
        await self.stub.SubmitToolResult(
            bridge_pb2.SubmitToolResultRequest(
                host_session_id=self.id, tool_request_id=request_id, outcome=outcome
            )
        )


def request(session: str, request_id: str, tool: str = "t", timeout_ms: int = 5000) -> Any:
    return bridge_pb2.DispatchToolRequestRequest(
        request=bridge_pb2.ToolRequest(
            session_id=session,
            turn_id="turn",
            tool_request_id=request_id,
            tool_name=tool,
            arguments_json="{}",
            timeout_ms=timeout_ms,
        )
    )


async def refusal(coro: Any) -> Code | None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await coro
    return error_code(raised.value)


OK = tool_pb2.ToolOutcome(result_json='{"done": true}')


async def test_request_travels_to_the_host_and_back(bridge: Any) -> None:
    host = await Host(bridge, "b1", ["t"]).open()
    dispatch = asyncio.ensure_future(bridge.DispatchToolRequest(request("b1", "req-1")))
    delivered = await host.next("tool_request")
    assert (delivered.tool_request_id, delivered.tool_name, delivered.turn_id) == ("req-1", "t", "turn")
    assert 0 < delivered.timeout_ms <= 5000
    await host.submit("req-1", OK)
    assert (await dispatch).outcome.result_json == '{"done": true}'
    # Heartbeats keep flowing on an idle stream.
    await host.next("heartbeat")
    host.stream.cancel()


async def test_submit_refusals_are_precise(bridge: Any) -> None:
    host = await Host(bridge, "b2", ["t"]).open()
    other = await Host(bridge, "b2", ["t"]).open()
    dispatch = asyncio.ensure_future(bridge.DispatchToolRequest(request("b2", "req-2")))
    delivered_to = None
    for candidate in (host, other):
        try:
            await candidate.next("tool_request", timeout=0.5)
            delivered_to = candidate
            break
        except TimeoutError:
            continue
    assert delivered_to is not None
    foreigner = other if delivered_to is host else host

    unknown_host = bridge_pb2.SubmitToolResultRequest(
        host_session_id="hs_nope", tool_request_id="req-2", outcome=OK
    )
    assert await refusal(bridge.SubmitToolResult(unknown_host)) is Code.HOST_SESSION_UNKNOWN
    assert await refusal(delivered_to.submit("req-unknown", OK)) is Code.REQUEST_UNKNOWN
    # Another host session's request gets the same answer as an unknown one (no existence oracle).
    assert await refusal(foreigner.submit("req-2", OK)) is Code.REQUEST_UNKNOWN
    not_json = tool_pb2.ToolOutcome(result_json="{oops")
    assert await refusal(delivered_to.submit("req-2", not_json)) is Code.RESULT_NOT_JSON
    too_big = tool_pb2.ToolOutcome(result_json='"' + "x" * MAX_RESULT_BYTES + '"')
    assert await refusal(delivered_to.submit("req-2", too_big)) is Code.RESULT_TOO_LARGE
    assert await refusal(delivered_to.submit("req-2", tool_pb2.ToolOutcome())) is Code.INVALID_REQUEST
    no_kind = tool_pb2.ToolOutcome(error=tool_pb2.ToolError(code="X", message="m"))
    assert await refusal(delivered_to.submit("req-2", no_kind)) is Code.INVALID_REQUEST
    # None of those refusals ended the request: a good result is still accepted, once.
    await delivered_to.submit("req-2", OK)
    assert (await dispatch).outcome.result_json == '{"done": true}'
    assert await refusal(delivered_to.submit("req-2", OK)) is Code.REQUEST_ENDED
    host.stream.cancel()
    other.stream.cancel()


async def test_timeout_cancels_on_the_host_and_refuses_the_late_result(bridge: Any) -> None:
    host = await Host(bridge, "b3", ["t"]).open()
    response = await bridge.DispatchToolRequest(request("b3", "req-3", timeout_ms=150))
    assert response.outcome.error.code == "TOOL_TIMEOUT"
    assert response.outcome.error.kind == tool_pb2.ERROR_KIND_RUNTIME
    cancelled = await host.next("cancelled")
    assert cancelled.tool_request_id == "req-3"
    assert cancelled.reason == bridge_pb2.CANCEL_REASON_TIMEOUT
    assert await refusal(host.submit("req-3", OK)) is Code.REQUEST_ENDED
    host.stream.cancel()


async def test_host_leaving_mid_call_ends_it(bridge: Any) -> None:
    host = await Host(bridge, "b4", ["t"]).open()
    dispatch = asyncio.ensure_future(bridge.DispatchToolRequest(request("b4", "req-4")))
    await host.next("tool_request")
    host.stream.cancel()
    outcome = (await asyncio.wait_for(dispatch, 5)).outcome
    assert outcome.error.code == "TOOL_HOST_DISCONNECTED"
    assert outcome.error.retryable is False
    assert await refusal(host.submit("req-4", OK)) is Code.HOST_SESSION_UNKNOWN


async def test_no_host_and_duplicate_ids(bridge: Any) -> None:
    response = await bridge.DispatchToolRequest(request("b5-nobody", "req-5"))
    assert response.outcome.error.code == "TOOL_HOST_UNAVAILABLE"
    host = await Host(bridge, "b5", ["t"]).open()
    first = asyncio.ensure_future(bridge.DispatchToolRequest(request("b5", "req-6")))
    await host.next("tool_request")
    assert await refusal(bridge.DispatchToolRequest(request("b5", "req-6"))) is Code.REQUEST_DUPLICATE
    await host.submit("req-6", OK)
    await first
    host.stream.cancel()


async def test_named_handler_host_is_preferred(bridge: Any) -> None:
    generic = await Host(bridge, "b6", [], generic=True).open()
    named = await Host(bridge, "b6", ["special"]).open()
    for index in range(3):
        dispatch = asyncio.ensure_future(
            bridge.DispatchToolRequest(request("b6", f"req-7-{index}", tool="special"))
        )
        delivered = await named.next("tool_request")
        assert delivered.tool_request_id == f"req-7-{index}"
        await named.submit(delivered.tool_request_id, OK)
        # The named host's answer is the outcome: the request went to it alone.
        assert (await dispatch).outcome.result_json == '{"done": true}'
    assert generic.request_ids == []
    # A tool nobody names goes to the generic host.
    other = asyncio.ensure_future(bridge.DispatchToolRequest(request("b6", "req-7-other", tool="other")))
    assert (await generic.next("tool_request")).tool_request_id == "req-7-other"
    await generic.submit("req-7-other", OK)
    assert (await other).outcome.result_json == '{"done": true}'
    assert named.request_ids == [f"req-7-{index}" for index in range(3)]
    generic.stream.cancel()
    named.stream.cancel()


@pytest.mark.parametrize(
    "bad",
    [
        bridge_pb2.OpenHostSessionRequest(session_id=""),
        bridge_pb2.OpenHostSessionRequest(session_id="ok", handler_names=["bad name"]),
    ],
)
async def test_bad_open_is_invalid_request(bridge: Any, bad: Any) -> None:
    stream = bridge.OpenHostSession(bad)
    assert await refusal(stream.read()) is Code.INVALID_REQUEST


async def test_bad_dispatch_is_invalid_request(bridge: Any) -> None:
    bad = request("b8", "req-8")
    bad.request.timeout_ms = 0
    assert await refusal(bridge.DispatchToolRequest(bad)) is Code.INVALID_REQUEST


class DispatchStream:
    """The invocation service's side of a DispatchToolRequests stream, driven by hand."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.DispatchToolRequests()
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while (response := await self.call.read()) is not grpc.aio.EOF:
            for result in response.results:
                await self.responses.put(result)
        await self.responses.put(None)

    async def send(self, session: str, *request_ids: str, timeout_ms: int = 5000) -> None:
        requests = [request(session, request_id, timeout_ms=timeout_ms).request for request_id in request_ids]
        await self.call.write(bridge_pb2.DispatchToolRequestsRequest(requests=requests))

    async def cancel(self, *request_ids: str) -> None:
        await self.call.write(bridge_pb2.DispatchToolRequestsRequest(cancel_tool_request_ids=request_ids))

    async def next(self, timeout: float = 5) -> Any:
        return await asyncio.wait_for(self.responses.get(), timeout)


async def test_one_stream_carries_many_requests_answered_as_they_end(bridge: Any) -> None:
    host = await Host(bridge, "s1", ["t"]).open()
    stream = DispatchStream(bridge)
    await stream.send("s1", "s1-req-0", "s1-req-1")  # two in one message
    await stream.send("s1", "s1-req-2")
    delivered = [(await host.next("tool_request")).tool_request_id for _ in range(3)]
    assert sorted(delivered) == ["s1-req-0", "s1-req-1", "s1-req-2"]
    for index in (2, 0, 1):
        await host.submit(f"s1-req-{index}", tool_pb2.ToolOutcome(result_json=str(index)))
        response = await stream.next()
        assert (response.tool_request_id, response.outcome.result_json) == (f"s1-req-{index}", str(index))
    await stream.send("s1-nobody", "s1-req-3")
    unavailable = await stream.next()
    assert unavailable.tool_request_id == "s1-req-3"
    assert unavailable.outcome.error.code == "TOOL_HOST_UNAVAILABLE"
    # Once the caller stops sending and nothing is held, the stream ends.
    await stream.call.done_writing()
    assert await stream.next() is None
    host.stream.cancel()


async def test_stream_refuses_bad_requests_one_by_one_and_goes_on(bridge: Any) -> None:
    host = await Host(bridge, "s2", ["t"]).open()
    stream = DispatchStream(bridge)
    await stream.send("s2", "s2-req-1")
    await host.next("tool_request")
    await stream.send("s2", "s2-req-1")  # the same id again, on the same stream
    duplicate = await stream.next()
    assert (duplicate.tool_request_id, duplicate.refusal.reason) == ("s2-req-1", "REQUEST_DUPLICATE")
    await stream.send("s2", "s2-req-2", timeout_ms=0)
    invalid = await stream.next()
    assert (invalid.tool_request_id, invalid.refusal.reason) == ("s2-req-2", "INVALID_REQUEST")
    assert "timeout_ms" in invalid.refusal.message
    # The refusals ended nothing: the first request still gets its outcome.
    await host.submit("s2-req-1", OK)
    answered = await stream.next()
    assert (answered.tool_request_id, answered.outcome.result_json) == ("s2-req-1", '{"done": true}')
    stream.call.cancel()
    host.stream.cancel()


async def test_cancel_on_the_stream_tells_the_host_and_sends_no_outcome(bridge: Any) -> None:
    host = await Host(bridge, "s3", ["t"]).open()
    stream = DispatchStream(bridge)
    await stream.send("s3", "s3-req-1")
    await host.next("tool_request")
    await stream.cancel("s3-req-1")
    cancelled = await host.next("cancelled")
    assert (cancelled.tool_request_id, cancelled.reason) == ("s3-req-1", bridge_pb2.CANCEL_REASON_CANCELLED)
    assert await refusal(host.submit("s3-req-1", OK)) is Code.REQUEST_ENDED
    await stream.cancel("s3-req-unknown")  # nothing to cancel: ignored
    await stream.call.done_writing()
    assert await stream.next() is None  # the stream ended without an outcome for it
    host.stream.cancel()


async def test_a_broken_stream_cancels_the_requests_it_held(bridge: Any) -> None:
    host = await Host(bridge, "s4", ["t"]).open()
    stream = DispatchStream(bridge)
    await stream.send("s4", "s4-req-1")
    await host.next("tool_request")
    stream.call.cancel()
    cancelled = await host.next("cancelled")
    assert (cancelled.tool_request_id, cancelled.reason) == ("s4-req-1", bridge_pb2.CANCEL_REASON_CANCELLED)
    host.stream.cancel()


async def test_stream_times_out_requests_like_the_unary_call(bridge: Any) -> None:
    host = await Host(bridge, "s5", ["t"]).open()
    stream = DispatchStream(bridge)
    await stream.send("s5", "s5-req-1", timeout_ms=150)
    await host.next("tool_request")
    timed_out = await stream.next()
    assert timed_out.outcome.error.code == "TOOL_TIMEOUT"
    assert (await host.next("cancelled")).reason == bridge_pb2.CANCEL_REASON_TIMEOUT
    stream.call.cancel()
    host.stream.cancel()


async def test_a_tool_no_connected_host_handles_is_not_sent_to_any(bridge: Any) -> None:
    host = await Host(bridge, "b-route", ["known"]).open()
    response = await bridge.DispatchToolRequest(request("b-route", "req-route-1", tool="unknown"))
    assert response.outcome.error.code == "TOOL_HANDLER_NOT_FOUND"
    assert response.outcome.error.kind == tool_pb2.ERROR_KIND_RUNTIME
    assert host.request_ids == []
    host.stream.cancel()


async def test_a_host_may_not_answer_with_the_runtimes_own_codes(bridge: Any) -> None:
    host = await Host(bridge, "b-codes", ["t"]).open()
    dispatch = asyncio.ensure_future(bridge.DispatchToolRequest(request("b-codes", "req-codes-1")))
    await host.next("tool_request")
    for kind, code in [
        (tool_pb2.ERROR_KIND_RUNTIME, "TOOL_TIMEOUT"),
        (tool_pb2.ERROR_KIND_RUNTIME, "TOOL_HOST_UNAVAILABLE"),
        (tool_pb2.ERROR_KIND_RUNTIME, "MADE_UP"),
        (tool_pb2.ERROR_KIND_DOMAIN, "TOOL_TIMEOUT"),
        (tool_pb2.ERROR_KIND_DOMAIN, "BRIDGE_UNAVAILABLE"),
    ]:
        posing = tool_pb2.ToolOutcome(error=tool_pb2.ToolError(kind=kind, code=code, message="m"))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await host.submit("req-codes-1", posing)
        assert error_code(raised.value) is Code.INVALID_REQUEST, (kind, code)
        assert "code" in (raised.value.details() or "")
    # A code a host may give is taken, and ends the request.
    allowed = tool_pb2.ToolOutcome(
        error=tool_pb2.ToolError(kind=tool_pb2.ERROR_KIND_RUNTIME, code="TOOL_HANDLER_ERROR", message="m")
    )
    await host.submit("req-codes-1", allowed)
    assert (await dispatch).outcome.error.code == "TOOL_HANDLER_ERROR"
    host.stream.cancel()


async def test_a_late_result_is_told_why_the_request_ended(bridge: Any) -> None:
    host = await Host(bridge, "b-late", ["t"]).open()
    await bridge.DispatchToolRequest(request("b-late", "req-late-1", timeout_ms=50))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await host.submit("req-late-1", OK)
    assert error_code(raised.value) is Code.REQUEST_ENDED
    assert (raised.value.details() or "").endswith("It timed out.")
    host.stream.cancel()


async def test_a_redelivered_request_carries_the_time_it_has_left(bridge: Any) -> None:
    first = await Host(bridge, "b-again", ["t"]).open()
    timeout_ms = 3000
    dispatch = asyncio.ensure_future(
        bridge.DispatchToolRequest(
            bridge_pb2.DispatchToolRequestRequest(
                request=bridge_pb2.ToolRequest(
                    session_id="b-again",
                    turn_id="turn",
                    tool_request_id="req-again-1",
                    tool_name="t",
                    arguments_json="{}",
                    timeout_ms=timeout_ms,
                    redeliverable=True,
                )
            )
        )
    )
    sent = await first.next("tool_request")
    assert sent.timeout_ms == timeout_ms
    started = asyncio.get_running_loop().time()
    first.stream.cancel()
    second = await Host(bridge, "b-again", ["t"]).open()
    again = await second.next("tool_request")
    waited_ms = (asyncio.get_running_loop().time() - started) * 1000
    assert again.tool_request_id == "req-again-1"
    # At most what was left when the second host got it, and never the original timeout.
    assert again.timeout_ms <= timeout_ms - waited_ms + 50
    assert again.timeout_ms < timeout_ms
    await second.submit("req-again-1", OK)
    assert (await dispatch).outcome.result_json == '{"done": true}'
    second.stream.cancel()
