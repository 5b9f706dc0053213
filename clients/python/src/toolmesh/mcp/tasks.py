"""MCP tasks (protocol 2025-11-25) backed by the invocation ledger: the task id is the tool request id.

A tools/call that carries `task` starts the invocation and answers at once
with the task; the call goes on in the invocation service whatever the client
does next. tasks/get and tasks/result read the ledger (GetInvocation), so a
client can disconnect and ask any gateway replica later, for as long as the
ledger keeps the invocation (10 minutes after its end); tasks/result waits
while it runs. tasks/cancel is CancelInvocation: it stops the invocation
unless another caller has joined it. tasks/list is not served: the ledger
lists no invocations (a client keeps the ids it was given).

The SDK's low-level server does not dispatch tasks/* (its types say so), so
this is a middleware that answers them before the SDK's dispatch.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import grpc
import mcp_types as types
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError

from toolmesh.client.invocation import CallResult
from toolmesh.client.views import Invocation, InvocationState
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code
from toolmesh.mcp.mapping import call_tool_result, no_outcome_error, refused

if TYPE_CHECKING:
    from toolmesh.mcp.gateway import Gateway

TASKS_VERSION = "2025-11-25"
# How long the ledger keeps an invocation after its end, and so the task.
TASK_TTL_MS = 10 * 60_000
POLL_INTERVAL_MS = 1000
# tasks/result asks the ledger this often while the invocation runs (doubling up to POLL_INTERVAL_MS).
FIRST_POLL_S = 0.05
RELATED_TASK_META = "io.modelcontextprotocol/related-task"

_STATUS = {
    InvocationState.RUNNING: "working",
    InvocationState.COMPLETED: "completed",
    InvocationState.TIMED_OUT: "failed",
    InvocationState.FAILED: "failed",
    InvocationState.CANCELLED: "cancelled",
}


def capabilities() -> types.ServerTasksCapability:
    """What the gateway serves of tasks: task-augmented tools/call, and tasks/cancel."""
    return types.ServerTasksCapability(
        cancel=types.TasksCancelCapability(),
        requests=types.ServerTasksRequestsCapability(
            tools=types.TasksToolsCapability(call=types.TasksCallCapability())
        ),
    )


class TaskMiddleware:
    """Answers task-augmented tools/call and tasks/get, tasks/result, tasks/cancel; the rest passes on."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        # Calls started for tasks: they outlive the request that started them.
        self._running: set[asyncio.Task[CallResult]] = set()

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        params = ctx.params or {}
        if ctx.protocol_version != TASKS_VERSION:
            return await call_next(ctx)
        if ctx.method == "tools/call" and params.get("task") is not None:
            return await self._start(ctx, types.CallToolRequestParams.model_validate(params))
        if ctx.method in ("tasks/get", "tasks/result", "tasks/cancel"):
            task_id = params.get("taskId")
            if not isinstance(task_id, str) or not task_id:
                raise MCPError(types.INVALID_PARAMS, "taskId must be a non-empty string.")
            session_id = self._gateway.enter(ctx)
            if ctx.method == "tasks/get":
                return _task(await self._invocation(session_id, task_id))
            if ctx.method == "tasks/result":
                return await self._result(session_id, task_id)
            return await self._cancel(session_id, task_id)
        return await call_next(ctx)

    async def close(self) -> None:
        """Stop waiting for the calls started for tasks (they go on in the invocation service)."""
        for running in self._running:
            running.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    async def _start(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> HandlerResult:
        session_id = self._gateway.enter(ctx)
        await self._gateway.hold_connection(ctx, session_id)
        started: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def announce(tool_request_id: str) -> None:
            if not started.done():
                started.set_result(tool_request_id)

        call = asyncio.create_task(self._gateway.invoke(session_id, params, on_started=announce))
        self._running.add(call)
        call.add_done_callback(self._running.discard)
        waits: set[asyncio.Future[Any]] = {started, call}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if started.done():
            tool_request_id = started.result()
        else:
            result = call.result()
            if result.tool_request_id is None:
                # Refused before it became an invocation (an unknown tool), or no answer at all.
                call_tool_result(result)
                raise no_outcome_error(result)
            tool_request_id = result.tool_request_id
        return {"task": _task(await self._invocation(session_id, tool_request_id))}

    async def _invocation(self, session_id: str, task_id: str) -> Invocation:
        """The ledger's invocation of this task; "unknown task" when it has none of this session."""
        try:
            invocation = await self._gateway.invocation.get_invocation(task_id)
        except grpc.aio.AioRpcError as error:
            code = error_code(error)
            if code in (Code.INVOCATION_NOT_FOUND, Code.INVALID_REQUEST):
                raise _unknown_task() from None
            raise refused(error) from None
        if invocation.session_id != session_id:
            raise _unknown_task()
        return invocation

    async def _result(self, session_id: str, task_id: str) -> HandlerResult:
        wait_s = FIRST_POLL_S
        invocation = await self._invocation(session_id, task_id)
        while invocation.state is InvocationState.RUNNING:
            # The ledger has no watch for one id: ask again, less often as it goes on.
            await asyncio.sleep(wait_s)
            wait_s = min(wait_s * 2, POLL_INTERVAL_MS / 1000)
            invocation = await self._invocation(session_id, task_id)
        assert invocation.outcome is not None  # an ended invocation has its outcome
        result = call_tool_result(CallResult(task_id, invocation.outcome))
        dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        dumped["_meta"] = {**dumped.get("_meta", {}), RELATED_TASK_META: {"taskId": task_id}}
        return dumped

    async def _cancel(self, session_id: str, task_id: str) -> HandlerResult:
        invocation = await self._invocation(session_id, task_id)
        if invocation.state is not InvocationState.RUNNING:
            raise MCPError(
                types.INVALID_PARAMS,
                f"Cannot cancel a task in terminal status {_task(invocation)['status']}.",
            )
        try:
            await self._gateway.invocation.cancel_invocation(task_id)
        except grpc.aio.AioRpcError as error:
            raise refused(error) from None
        return _task(await self._invocation(session_id, task_id))


def _task(invocation: Invocation) -> dict[str, Any]:
    created = invocation.created_at.isoformat()
    updated = created if invocation.finished_at is None else invocation.finished_at.isoformat()
    task: dict[str, Any] = {
        "taskId": invocation.tool_request_id,
        "status": _STATUS.get(invocation.state, "working"),
        "createdAt": created,
        "lastUpdatedAt": updated,
        "ttl": TASK_TTL_MS,
        "pollInterval": POLL_INTERVAL_MS,
    }
    failure = None if invocation.outcome is None else invocation.outcome.failure
    if failure is not None:
        # An error of the tool (isError in its result) fails the task, as MCP says.
        task["status"] = "cancelled" if task["status"] == "cancelled" else "failed"
        task["statusMessage"] = failure.code
    return task


def _unknown_task() -> MCPError:
    return MCPError(types.INVALID_PARAMS, "Unknown task: no such task in this session, or it has expired.")
