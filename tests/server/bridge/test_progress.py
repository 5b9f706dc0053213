"""Progress and cancellation end to end: a real host, real services, a real caller."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem
from toolmesh.client import InvocationClient, InvocationState, RegistryClient, ToolProgress
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, invocation_pb2, invocation_pb2_grpc
from toolmesh_testing import eventually, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "progress"
OBJECT = '{"type": "object"}'
TOOLS = [
    ToolSpec("steps", "Reports progress in steps, then answers", OBJECT),
    ToolSpec("chatty_until_deadline", "Reports progress until cancelled", OBJECT, timeout_ms=600),
    ToolSpec("wait_for_cancel", "Waits until cancelled", OBJECT, timeout_ms=20_000),
    ToolSpec("hostile", "Reports hostile progress", OBJECT),
    ToolSpec("odd_reports", "Reports what the SDK cannot send", OBJECT),
    ToolSpec("sync_steps", "A sync handler reporting progress from its thread", OBJECT),
    ToolSpec("last_words", "Reports progress from a task of its own and answers at once", OBJECT),
    ToolSpec("sync_last_words", "A sync handler that reports progress and answers at once", OBJECT),
]


class Handlers:
    """What the handlers saw: cancellations, and the bridge's answers to hostile reports."""

    def __init__(self) -> None:
        self.cancelled: dict[str, str] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.release = asyncio.Event()
        self.host: ToolHost | None = None
        self.reporting: asyncio.Future[None] | None = None

    async def steps(self, args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        count = int(args.get("count", 3))
        for step in range(1, count + 1):
            await ctx.report_progress(step, count, f"step {step}")
            # Past the bridge's interval, so that no report is coalesced away.
            await asyncio.sleep(0.15)
        return {"done": count}

    async def chatty_until_deadline(self, args: dict[str, Any], ctx: ToolContext) -> None:
        step = 0
        while True:
            step += 1
            await ctx.report_progress(step)
            await asyncio.sleep(0.02)

    async def wait_for_cancel(self, args: dict[str, Any], ctx: ToolContext) -> str:
        self.started.setdefault(args["key"], asyncio.Event()).set()
        try:
            await ctx.cancellation.wait()
        finally:
            self.cancelled[args["key"]] = ctx.cancellation.reason or ""
        return "stopped"

    async def odd_reports(self, args: dict[str, Any], ctx: ToolContext) -> str:
        await ctx.report_progress(math.nan)  # dropped by the bridge (INVALID)
        await ctx.report_progress("half", 2)  # type: ignore[arg-type]  # not a number: not sent
        await ctx.report_progress(1, 2, "x" * 100_000)  # cut to 512 characters by the SDK
        return "survived"

    def sync_steps(self, args: dict[str, Any], ctx: ToolContext) -> str:
        ctx.report_progress(1, 2, "from a thread")  # no await in a worker thread
        time.sleep(0.15)  # past the bridge's interval: the second report is not coalesced away
        ctx.report_progress(2, 2)
        time.sleep(0.15)
        return "done"

    async def last_words(self, args: dict[str, Any], ctx: ToolContext) -> str:
        # As an MCP server's progress reaches `toolmesh host --mcp`: from a callback's own task,
        # not awaited by the handler, which answers at once.
        self.reporting = asyncio.ensure_future(ctx.report_progress(1, 1, "last words"))
        return "said"

    def sync_last_words(self, args: dict[str, Any], ctx: ToolContext) -> str:
        ctx.report_progress(1, 1, "last words")
        return "said"

    async def hostile(self, args: dict[str, Any], ctx: ToolContext) -> str:
        await self.release.wait()
        return "ok"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def handlers(system: LocalSystem) -> AsyncIterator[Handlers]:
    seen = Handlers()
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    host = ToolHost(system.bridge_target, SESSION)
    for tool in TOOLS:
        host.on_tool(tool.name, getattr(seen, tool.name))
    seen.host = host
    async with host:
        yield seen


@pytest_asyncio.fixture(loop_scope="module")
async def client(system: LocalSystem, handlers: Handlers) -> AsyncIterator[InvocationClient]:
    async with InvocationClient(system.invocation_target) as invocation:
        yield invocation


async def test_progress_reaches_the_caller_in_order_and_leaves_the_outcome_alone(
    client: InvocationClient,
) -> None:
    started: list[str] = []
    reports: list[ToolProgress] = []

    async def on_progress(progress: ToolProgress) -> None:  # an async callback is awaited
        reports.append(progress)

    result = await client.invoke(
        SESSION, "steps", {"count": 3}, turn_id="t", on_progress=on_progress, on_started=started.append
    )
    assert result.outcome is not None and result.outcome.result_json == '{"done":3}'
    assert started == [result.tool_request_id]
    assert [(p.progress, p.total, p.message) for p in reports] == [
        (1, 3, "step 1"),
        (2, 3, "step 2"),
        (3, 3, "step 3"),
    ]
    assert {p.tool_request_id for p in reports} == {result.tool_request_id}
    plain = await client.invoke(SESSION, "steps", {"count": 2}, turn_id="t")
    assert plain.outcome is not None and plain.outcome.result_json == '{"done":2}'


async def test_reports_the_sdk_cannot_send_never_reach_the_handler(client: InvocationClient) -> None:
    reports: list[ToolProgress] = []
    result = await client.invoke(SESSION, "odd_reports", {}, turn_id="t", on_progress=reports.append)
    assert result.outcome is not None and result.outcome.result_json == '"survived"'
    assert [(p.progress, p.total, len(p.message or "")) for p in reports] == [(1, 2, 512)]


async def test_a_sync_handler_reports_progress_from_its_thread(client: InvocationClient) -> None:
    reports: list[ToolProgress] = []
    result = await client.invoke(SESSION, "sync_steps", {}, turn_id="t", on_progress=reports.append)
    assert result.outcome is not None and result.outcome.result_json == '"done"'
    assert [(p.progress, p.total, p.message) for p in reports] == [(1, 2, "from a thread"), (2, 2, None)]


@pytest.mark.parametrize("tool", ["last_words", "sync_last_words"])
async def test_a_report_made_before_the_handler_answers_reaches_the_caller_before_the_result(
    client: InvocationClient, tool: str
) -> None:
    """The result waits for the reports made before it: once the request has ended, the bridge
    drops a report that comes after it."""
    for attempt in range(5):  # several times: a race, if there is one, shows
        reports: list[ToolProgress] = []
        result = await client.invoke(SESSION, tool, {"n": attempt}, turn_id="t", on_progress=reports.append)
        assert result.outcome is not None and result.outcome.result_json == '"said"'
        assert [(p.progress, p.total, p.message) for p in reports] == [(1, 1, "last words")]


async def test_progress_does_not_extend_the_deadline_and_is_rate_limited(client: InvocationClient) -> None:
    reports: list[ToolProgress] = []
    result = await client.invoke(
        SESSION, "chatty_until_deadline", {}, turn_id="t", on_progress=reports.append
    )
    assert result.outcome is not None and result.outcome.failure is not None
    assert result.outcome.failure.code == Code.TOOL_TIMEOUT
    # About 30 reports in 600 ms; at most one per 100 ms passes the bridge.
    assert 1 <= len(reports) <= 8
    assert [p.progress for p in reports] == sorted(p.progress for p in reports)


async def test_cancel_stops_the_handler_and_the_caller_gets_tool_cancelled(
    client: InvocationClient, handlers: Handlers
) -> None:
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    call = asyncio.ensure_future(
        client.invoke(
            SESSION,
            "wait_for_cancel",
            {"key": "one"},
            turn_id="t",
            on_started=started.set_result,
            confirm_delivery=False,
        )
    )
    tool_request_id = await started
    await eventually(lambda: "one" in handlers.started)
    assert await client.cancel_invocation(tool_request_id) is True
    result = await call
    assert result.outcome is not None and result.outcome.failure is not None
    assert result.outcome.failure.code == Code.TOOL_CANCELLED
    assert result.outcome.failure.retryable is False
    await eventually(lambda: handlers.cancelled.get("one") == "cancelled")
    recorded = await client.get_invocation(tool_request_id)
    assert recorded.state is InvocationState.CANCELLED
    # An exact retry replays the cancellation (it was not confirmed); nothing runs again.
    retry = await client.invoke(SESSION, "wait_for_cancel", {"key": "one"}, turn_id="t")
    assert retry.replayed and retry.tool_request_id == tool_request_id
    assert retry.outcome is not None and retry.outcome.failure is not None
    assert retry.outcome.failure.code == Code.TOOL_CANCELLED
    # The invocation has ended: cancelling again changes nothing.
    assert await client.cancel_invocation(tool_request_id) is False


async def test_cancel_is_refused_when_another_call_joined(
    system: LocalSystem, client: InvocationClient, handlers: Handlers
) -> None:
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    first = asyncio.ensure_future(
        client.invoke(
            SESSION, "wait_for_cancel", {"key": "joined"}, turn_id="t", on_started=started.set_result
        )
    )
    tool_request_id = await started
    joined: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    second = asyncio.ensure_future(
        client.invoke(
            SESSION, "wait_for_cancel", {"key": "joined"}, turn_id="t", on_started=joined.set_result
        )
    )
    assert await joined == tool_request_id
    assert await client.cancel_invocation(tool_request_id) is False
    async with grpc.aio.insecure_channel(system.invocation_target) as channel:
        stub = invocation_pb2_grpc.InvocationServiceStub(channel)
        request = invocation_pb2.CancelInvocationRequest(tool_request_id=tool_request_id)
        raw = await stub.CancelInvocation(request)
    assert raw.result == invocation_pb2.CANCEL_INVOCATION_RESULT_JOINED
    assert not first.done() and "joined" not in handlers.cancelled
    first.cancel()
    second.cancel()


async def test_cancel_of_an_unknown_or_malformed_invocation_raises(client: InvocationClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await client.cancel_invocation("tr_" + "0" * 32)
    assert error_code(unknown.value) is Code.INVOCATION_NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as malformed:
        await client.cancel_invocation("not an id!")
    assert error_code(malformed.value) is Code.INVALID_REQUEST


async def test_hostile_progress_gets_typed_answers_and_costs_only_itself(
    system: LocalSystem, client: InvocationClient, handlers: Handlers
) -> None:
    reports: list[ToolProgress] = []
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    call = asyncio.ensure_future(
        client.invoke(
            SESSION, "hostile", {}, turn_id="t", on_progress=reports.append, on_started=started.set_result
        )
    )
    tool_request_id = await started
    assert handlers.host is not None
    host = handlers.host.host_session_id
    channel = grpc.aio.insecure_channel(system.bridge_target)
    bridge = bridge_pb2_grpc.BridgeServiceStub(channel)

    async def report(**fields: Any) -> bridge_pb2.ReportToolProgressResponse:
        request = bridge_pb2.ReportToolProgressRequest(host_session_id=host, **fields)
        response: bridge_pb2.ReportToolProgressResponse = await bridge.ReportToolProgress(request)
        return response

    invalid = bridge_pb2.PROGRESS_REPORT_STATUS_INVALID
    assert (await report(tool_request_id=tool_request_id, progress=math.nan)).status == invalid
    assert (await report(tool_request_id=tool_request_id, progress=math.inf)).status == invalid
    assert (await report(tool_request_id=tool_request_id, progress=1, total=0)).status == invalid
    assert (await report(tool_request_id=tool_request_id, progress=1, total=-math.inf)).status == invalid
    huge = await report(tool_request_id=tool_request_id, progress=1, message="x" * 1_000_000)
    assert huge.status == bridge_pb2.PROGRESS_REPORT_STATUS_ACCEPTED and huge.message_truncated
    unknown = await report(tool_request_id="tr_" + "1" * 32, progress=1)
    assert unknown.status == bridge_pb2.PROGRESS_REPORT_STATUS_REQUEST_UNKNOWN
    # A flood: every report is answered, the caller gets a handful.
    answers = await asyncio.gather(
        *(report(tool_request_id=tool_request_id, progress=2 + n) for n in range(300))
    )
    assert {answer.status for answer in answers} == {bridge_pb2.PROGRESS_REPORT_STATUS_ACCEPTED}
    await eventually(lambda: bool(reports) and reports[-1].progress == 301)
    assert len(reports[0].message or "") == 512
    assert len(reports) < 30
    handlers.release.set()
    result = await call
    assert result.outcome is not None and result.outcome.result_json == '"ok"'
    ended = await report(tool_request_id=tool_request_id, progress=400)
    assert ended.status == bridge_pb2.PROGRESS_REPORT_STATUS_REQUEST_ENDED
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await bridge.ReportToolProgress(
            bridge_pb2.ReportToolProgressRequest(host_session_id="hs_gone", tool_request_id=tool_request_id)
        )
    assert error_code(gone.value) is Code.HOST_SESSION_UNKNOWN
    await channel.close()


async def test_the_cli_prints_progress_on_stderr_and_the_outcome_on_stdout(
    cli_env: dict[str, str], handlers: Handlers
) -> None:
    code, out, err = await run_cli(
        "tool-call", "--session-id", SESSION, "--tool", "steps", "--args", '{"count": 2}', env=cli_env
    )
    assert code == 0 and json.loads(out)["result"] == {"done": 2}
    assert err.splitlines() == ["progress 1/2: step 1", "progress 2/2: step 2"]
    code, out, err = await run_cli(
        "tool-call",
        "--session-id",
        SESSION,
        "--tool",
        "steps",
        "--args",
        '{"count": 1}',
        "--no-progress",
        env=cli_env,
    )
    assert code == 0 and json.loads(out)["result"] == {"done": 1} and err == ""


async def test_the_cli_cancels_an_invocation(
    client: InvocationClient, handlers: Handlers, cli_env: dict[str, str]
) -> None:
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    call = asyncio.ensure_future(
        client.invoke(SESSION, "wait_for_cancel", {"key": "cli"}, turn_id="t", on_started=started.set_result)
    )
    tool_request_id = await started
    await eventually(lambda: "cli" in handlers.started)
    code, out, _ = await run_cli("invocations", "cancel", tool_request_id, env=cli_env)
    assert code == 0 and json.loads(out) == {"toolRequestId": tool_request_id, "cancelled": True}
    result = await call
    assert result.outcome is not None and result.outcome.code == Code.TOOL_CANCELLED
    code, out, _ = await run_cli("invocations", "cancel", tool_request_id, env=cli_env)
    assert code == 0 and json.loads(out)["cancelled"] is False
    code, _, err = await run_cli("invocations", "cancel", "tr_" + "2" * 32, env=cli_env)
    assert code == 1 and json.loads(err)["error"]["code"] == "INVOCATION_NOT_FOUND"


async def test_a_callback_that_raises_does_not_end_the_call(client: InvocationClient) -> None:
    def broken(progress: ToolProgress) -> None:
        raise RuntimeError("the caller's own bug")

    result = await client.invoke(SESSION, "steps", {"count": 1}, turn_id="t", on_progress=broken)
    assert result.outcome is not None and result.outcome.result_json == '{"done":1}'


async def test_a_caller_that_gives_up_leaves_the_invocation_running(
    client: InvocationClient, handlers: Handlers
) -> None:
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    call = asyncio.ensure_future(
        client.invoke(SESSION, "wait_for_cancel", {"key": "left"}, turn_id="t", on_started=started.set_result)
    )
    tool_request_id = await started
    await eventually(lambda: "left" in handlers.started)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert (await client.get_invocation(tool_request_id)).state is InvocationState.RUNNING
    assert "left" not in handlers.cancelled
    assert await client.cancel_invocation(tool_request_id) is True
    await eventually(lambda: handlers.cancelled.get("left") == "cancelled")


async def test_a_call_that_joins_on_the_same_replica_hears_the_progress_too(client: InvocationClient) -> None:
    first_started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    first = asyncio.ensure_future(
        client.invoke(SESSION, "steps", {"count": 4}, turn_id="t", on_started=first_started.set_result)
    )
    tool_request_id = await first_started
    reports: list[ToolProgress] = []
    joined = await client.invoke(SESSION, "steps", {"count": 4}, turn_id="t", on_progress=reports.append)
    assert joined.joined and joined.tool_request_id == tool_request_id
    assert reports and {p.tool_request_id for p in reports} == {tool_request_id}
    assert [p.progress for p in reports] == sorted(p.progress for p in reports) and reports[-1].progress == 4
    assert (await first).outcome == joined.outcome
