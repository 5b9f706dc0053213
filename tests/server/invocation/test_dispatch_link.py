"""The invocation service's one stream to the bridge: breaks, refusals, silence, cancellation.

Real registry, bridge and invocation servers on their own ports; the one
deliberately broken peer (a bridge that takes requests and never answers)
cannot be made from the real bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from toolmesh.assembly.system import start_bridge, start_invocation, start_registry
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.contracts.routes import route_key
from toolmesh.core.calls import ToolRequest
from toolmesh.core.deadlines import PAUSE_GRACE_S
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.core.tools import ToolSpec
from toolmesh.core.wire import outcome_to_pb
from toolmesh.host import ToolContext, ToolHost
from toolmesh.invocation import remote
from toolmesh.invocation.ports import BridgeLost
from toolmesh.invocation.remote import RemoteDispatcher, RoutedDispatcher
from toolmesh.store.memory import InMemoryStore
from toolmesh.v1 import bridge_pb2, invocation_pb2, invocation_pb2_grpc
from toolmesh_testing import closed_address, eventually, start_service_process

pytestmark = pytest.mark.integration

OBJECT = '{"type":"object"}'


def tool_request(request_id: str, session: str = "link", timeout_ms: int = 5000) -> ToolRequest:
    return ToolRequest(
        session_id=session,
        turn_id="turn",
        tool_request_id=request_id,
        tool_name="wait",
        arguments_json="{}",
        timeout_ms=timeout_ms,
    )


async def test_a_bridge_that_dies_fails_the_held_calls_and_the_next_call_reconnects() -> None:
    registry = await start_registry()
    ports: dict[str, int] = {}  # bound on the first start, kept for the restart
    bridge = await start_service_process("bridge", ports=ports)
    invocation = await start_invocation(f"127.0.0.1:{registry.internal_port}", bridge.internal_target)
    started = asyncio.Event()

    async def wait(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        started.set()
        await asyncio.sleep(30)
        return {}

    host = ToolHost(bridge.target, "restart")
    host.on_tool("wait", wait)
    host.on_tool("echo", lambda args, ctx: args)
    client = InvocationClient(f"127.0.0.1:{invocation.port}")
    try:
        async with RegistryClient(f"127.0.0.1:{registry.port}") as registry_client:
            await registry_client.put_tools(
                "restart", [ToolSpec("wait", "", OBJECT), ToolSpec("echo", "", OBJECT)]
            )
        await host.start(timeout=5)
        held = asyncio.ensure_future(client.invoke("restart", "wait", {}, turn_id="t1"))
        await asyncio.wait_for(started.wait(), 5)
        bridge.process.kill()  # gone without a word: the stream breaks under the held call
        await bridge.stop()
        broken = await asyncio.wait_for(held, 10)
        assert broken.outcome is None and broken.code is Code.BRIDGE_UNAVAILABLE
        bridge = await start_service_process("bridge", ports=ports)
        await host.wait_connected(20)
        answered = await client.invoke("restart", "echo", {"again": True}, turn_id="t2")
        assert answered.outcome is not None and answered.outcome.result_json == '{"again":true}'
    finally:
        await client.close()
        await host.stop()
        await invocation.stop(0)
        await bridge.stop()
        await registry.stop(0)


async def test_an_invocation_service_pointed_at_the_public_bridge_port_says_why_it_cannot_dispatch() -> None:
    registry = await start_registry()
    bridge, _ = await start_bridge()
    # Misconfigured: the bridge's public port, not its internal listener.
    invocation = await start_invocation(f"127.0.0.1:{registry.internal_port}", f"127.0.0.1:{bridge.port}")
    try:
        async with RegistryClient(f"127.0.0.1:{registry.port}") as registry_client:
            await registry_client.put_tools("wrong", [ToolSpec("echo", "", OBJECT)])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{invocation.port}") as channel:
            stub = invocation_pb2_grpc.InvocationServiceStub(channel)
            call = invocation_pb2.InvokeToolRequest(
                session_id="wrong", turn_id="t", tool_name="echo", arguments_json="{}"
            )
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.InvokeTool(call, timeout=10)
        assert error_code(failed.value) is Code.BRIDGE_UNAVAILABLE
        info = error_info(failed.value)
        assert info is not None and info.metadata["reason"] == "WRONG_LISTENER"
    finally:
        await invocation.stop(0)
        await bridge.stop(0)
        await registry.stop(0)


@contextlib.asynccontextmanager
async def dispatcher_to_bridge() -> AsyncIterator[tuple[RemoteDispatcher, str]]:
    """A dispatcher to a real bridge server, and the bridge's address."""
    bridge, _ = await start_bridge()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{bridge.internal_port}")
    dispatcher = RemoteDispatcher(channel)
    try:
        yield dispatcher, f"127.0.0.1:{bridge.port}"
    finally:
        await dispatcher.aclose()
        await channel.close()
        await bridge.stop(0)


async def test_a_refused_request_fails_alone_and_the_stream_goes_on() -> None:
    async with dispatcher_to_bridge() as (dispatcher, _):
        with pytest.raises(ToolmeshError) as refused:
            await dispatcher.dispatch(tool_request("tr_bad", timeout_ms=0))
        assert refused.value.code is Code.INTERNAL
        assert refused.value.metadata["reason"] == "INVALID_REQUEST"
        outcome = await dispatcher.dispatch(tool_request("tr_good", session="nobody-serves-this"))
        assert outcome.code == "TOOL_HOST_UNAVAILABLE"


async def test_giving_up_on_a_dispatch_cancels_it_on_the_host() -> None:
    started = asyncio.Event()
    reasons: list[str | None] = []

    async def wait(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:  # the SDK cancels an async handler when the runtime says so
            reasons.append(ctx.cancellation.reason)
        return {}

    async with dispatcher_to_bridge() as (dispatcher, bridge_target):
        host = ToolHost(bridge_target, "link")
        host.on_tool("wait", wait)
        try:
            await host.start(timeout=5)
            dispatch = asyncio.ensure_future(dispatcher.dispatch(tool_request("tr_left")))
            await asyncio.wait_for(started.wait(), 5)
            dispatch.cancel()
            await eventually(lambda: reasons)
            assert reasons == ["cancelled"]
        finally:
            await host.stop()


class QuietBridge:
    """Serves only DispatchToolRequests: takes every message and never answers."""

    def __init__(self) -> None:
        self.received: list[bridge_pb2.DispatchToolRequestsRequest] = []

    async def take(self, request_iterator: Any, context: Any) -> None:
        async for message in request_iterator:
            self.received.append(message)

    def handler(self) -> grpc.GenericRpcHandler:
        take = grpc.stream_stream_rpc_method_handler(
            self.take,
            request_deserializer=bridge_pb2.DispatchToolRequestsRequest.FromString,
            response_serializer=bridge_pb2.DispatchToolRequestsResponse.SerializeToString,
        )
        methods = {"DispatchToolRequests": take}
        return grpc.method_handlers_generic_handler("toolmesh.v1.BridgeService", methods)


@contextlib.asynccontextmanager
async def dispatcher_to(bridge: QuietBridge) -> AsyncIterator[RemoteDispatcher]:
    """A dispatcher to `bridge`, served on a port of its own."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((bridge.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    dispatcher = RemoteDispatcher(channel)
    try:
        yield dispatcher
    finally:
        await dispatcher.aclose()
        await channel.close()
        await server.stop(0)


@contextlib.asynccontextmanager
async def dispatcher_to_quiet_bridge() -> AsyncIterator[tuple[RemoteDispatcher, QuietBridge]]:
    quiet = QuietBridge()
    async with dispatcher_to(quiet) as dispatcher:
        yield dispatcher, quiet


async def test_a_bridge_that_never_answers_ends_the_call_as_a_timeout(monkeypatch: Any) -> None:
    monkeypatch.setattr(remote, "BRIDGE_GRACE_S", 0.2)
    async with dispatcher_to_quiet_bridge() as (dispatcher, quiet):
        outcome = await asyncio.wait_for(dispatcher.dispatch(tool_request("tr_quiet", timeout_ms=100)), 5)
        assert outcome.code == "TOOL_TIMEOUT"
        await eventually(lambda: len(quiet.received) >= 2)
        # The request, then its cancellation: the bridge is told the caller gave up.
        sent, cancelled = quiet.received
        assert [r.tool_request_id for r in sent.requests] == ["tr_quiet"] and not sent.cancel_tool_request_ids
        assert list(cancelled.cancel_tool_request_ids) == ["tr_quiet"] and not cancelled.requests


class AnsweringBridge(QuietBridge):
    """Answers each request with a success once `answer` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def take(self, request_iterator: Any, context: Any) -> Any:
        async for message in request_iterator:
            self.received.append(message)
            await self.answer.wait()
            yield bridge_pb2.DispatchToolRequestsResponse(
                results=[
                    bridge_pb2.DispatchResult(
                        tool_request_id=r.tool_request_id, outcome=outcome_to_pb(Outcome.success("1"))
                    )
                    for r in message.requests
                ]
            )


@pytest.mark.parametrize(
    "stall_s",
    # Just past the guard's time (0.3 s from the dispatch), and far past it and PAUSE_GRACE_S.
    [0.35, 0.3 + PAUSE_GRACE_S + 0.5],
    ids=["barely overdue", "long overdue"],
)
async def test_an_answer_queued_while_this_process_was_paused_beats_its_overdue_guard(
    monkeypatch: Any, stall_s: float
) -> None:
    """A guard that fires after a pause of this process (SIGSTOP, a starved loop), however late,
    does not end the wait before the answer that came meanwhile is read: a pause that ended just
    after the guard was due makes it fire barely late."""
    monkeypatch.setattr(remote, "BRIDGE_GRACE_S", 0.2)
    bridge = AnsweringBridge()
    async with dispatcher_to(bridge) as dispatcher:
        dispatch = asyncio.ensure_future(dispatcher.dispatch(tool_request("tr_paused", timeout_ms=100)))
        await eventually(lambda: bridge.received)
        bridge.answer.set()
        # The loop stands still: nothing is read.
        time.sleep(stall_s)  # noqa: ASYNC251
        outcome = await asyncio.wait_for(dispatch, 5)
        assert outcome == Outcome.success("1")


async def test_requests_ready_together_go_out_in_one_message() -> None:
    async with dispatcher_to_quiet_bridge() as (dispatcher, quiet):
        dispatches = [asyncio.ensure_future(dispatcher.dispatch(tool_request(f"tr_{n}"))) for n in range(50)]

        def sent() -> list[str]:
            return [r.tool_request_id for message in quiet.received for r in message.requests]

        await eventually(lambda: len(sent()) == 50)
        assert sorted(sent()) == sorted(f"tr_{n}" for n in range(50))
        assert len(quiet.received) <= 5  # batched, not one message per request
        for dispatch in dispatches:
            dispatch.cancel()


async def test_a_bridge_that_refuses_connections_was_sent_nothing() -> None:
    channel = grpc.aio.insecure_channel(closed_address())  # nothing listens there
    dispatcher = RemoteDispatcher(channel)
    try:
        with pytest.raises(BridgeLost) as lost:
            await asyncio.wait_for(dispatcher.dispatch(tool_request("tr_refused")), 10)
        assert lost.value.code is Code.BRIDGE_UNAVAILABLE and lost.value.sent is False
    finally:
        await dispatcher.aclose()
        await channel.close()


async def test_a_bridge_that_never_completes_the_connection_was_sent_nothing() -> None:
    held: list[asyncio.StreamWriter] = []

    async def accept_and_say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # no HTTP/2 settings ever: the channel stays CONNECTING

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    dispatcher = RemoteDispatcher(channel, connect_s=0.3)
    try:
        with pytest.raises(BridgeLost) as lost:
            await asyncio.wait_for(dispatcher.dispatch(tool_request("tr_silent")), 10)
        assert lost.value.sent is False and lost.value.metadata["grpcStatus"] == "UNAVAILABLE"
    finally:
        await dispatcher.aclose()
        await channel.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_request_handed_to_a_stream_that_then_breaks_may_have_been_sent() -> None:
    async with dispatcher_to_quiet_bridge() as (dispatcher, quiet):
        dispatch = asyncio.ensure_future(dispatcher.dispatch(tool_request("tr_taken")))
        await eventually(lambda: quiet.received)
        await dispatcher.aclose()  # the stream ends under the request the bridge took
        with pytest.raises(BridgeLost) as lost:
            await asyncio.wait_for(dispatch, 10)
        assert lost.value.sent is True


async def test_a_request_that_never_left_goes_to_another_replica_when_there_is_one() -> None:
    store = InMemoryStore()
    bridge, _ = await start_bridge()
    host = ToolHost(f"127.0.0.1:{bridge.port}", "moved")
    host.on_tool("wait", lambda args, ctx: {"served": True})
    dispatcher = RoutedDispatcher(store, f"127.0.0.1:{bridge.internal_port}")
    try:
        await host.start(timeout=5)
        # The session's route names a replica that is down; the default holds the host.
        await store.put(route_key("moved"), closed_address().encode(), ttl_s=60)
        outcome = await asyncio.wait_for(dispatcher.dispatch(tool_request("tr_moved", session="moved")), 10)
        assert outcome.ok and outcome.result_json == '{"served":true}'
        # Down, and no other replica to try: it ends at once, saying nothing ran.
        await store.put(route_key("stranded"), closed_address().encode(), ttl_s=60)
        stranded = RoutedDispatcher(store, closed_address())
        try:
            alone = await asyncio.wait_for(
                stranded.dispatch(tool_request("tr_alone", session="stranded")), 10
            )
        finally:
            await stranded.aclose()
        assert alone.failure is not None and alone.failure.code == "TOOL_HOST_UNAVAILABLE"
        assert alone.failure.details == {"sessionId": "stranded", "bridge": "unreachable"}
    finally:
        await host.stop()
        await dispatcher.aclose()
        await bridge.stop(0)


class RestartingBridge(QuietBridge):
    """Says it fences starts on its first stream and takes what comes; ends every later stream at
    once, without a word (a replica restarting under the next stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams = 0

    async def take(self, request_iterator: Any, context: Any) -> Any:
        self.streams += 1
        if self.streams > 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        yield bridge_pb2.DispatchToolRequestsResponse(starts_fenced=True)
        async for message in request_iterator:
            self.received.append(message)


async def test_a_new_stream_to_a_bridge_that_fenced_sends_nothing_before_its_word() -> None:
    """Had the request gone out before the bridge's word, a stream that breaks then would leave a
    request that may have started unfenced: the invocation could not send it elsewhere."""
    bridge = RestartingBridge()
    async with dispatcher_to(bridge) as dispatcher:
        first = asyncio.ensure_future(dispatcher.dispatch(tool_request("tr_first"), generation=1))
        await eventually(lambda: bridge.received)
        assert dispatcher._link is not None
        await dispatcher._link.aclose()  # the first stream breaks under the request it took
        with pytest.raises(BridgeLost) as lost:
            await asyncio.wait_for(first, 10)
        assert lost.value.sent is True and lost.value.fenced is True
        with pytest.raises(BridgeLost) as lost:
            await asyncio.wait_for(dispatcher.dispatch(tool_request("tr_next"), generation=2), 10)
        assert lost.value.sent is False
        assert bridge.streams == 2
        assert [r.tool_request_id for m in bridge.received for r in m.requests] == ["tr_first"]
