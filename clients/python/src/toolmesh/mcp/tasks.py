"""MCP tasks backed by the invocation ledger: the task id is the tool request id (`tr_`, 122 random bits).

Two revisions of tasks are served:

- 2025-11-25 (`tasks` in the capabilities): the client asks for a task
  (`tools/call` with `task`); tasks/get, tasks/result, tasks/cancel.
- 2026-07-28 (the extension `io.modelcontextprotocol/tasks`, SEP-2663): the
  server decides. A `tools/call` whose client declared the extension waits
  TASK_AFTER_S for its outcome; an outcome in time is the ordinary result,
  otherwise the answer is a task (`resultType: "task"`), returned once the
  ledger has recorded the invocation. tasks/get carries the result inline once
  done (a tool's isError result too: the task is `completed`, its `result`
  the isError content the model reads), tasks/update is accepted (toolmesh
  tools ask for no input, so no task is ever `input_required`), tasks/cancel.

A tools/call that carries `task` starts the invocation and answers at once
with the task; the call goes on in the invocation service whatever the client
does next. tasks/get and tasks/result read the ledger (GetInvocation), so a
client can disconnect and ask any gateway replica later, for as long as the
ledger keeps the invocation (10 minutes after its end); tasks/result waits
while it runs. tasks/cancel is CancelInvocation: it stops the invocation
unless another caller has joined it. tasks/list is not served: the ledger
lists no invocations (a client keeps the ids it was given).

The SDK's low-level server does not dispatch tasks/* (its types say so, and it
has no types of the extension), so this is a middleware that answers them
before the SDK's dispatch.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio
import grpc
import mcp_types as types
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from toolmesh.client.invocation import CallResult
from toolmesh.client.views import Invocation, InvocationState
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code
from toolmesh.mcp.mapping import call_tool_result, no_outcome_error, refused

if TYPE_CHECKING:
    from toolmesh.mcp.gateway import Gateway

log = logging.getLogger("toolmesh.mcp")

TASKS_VERSION = "2025-11-25"
# How long the ledger keeps an invocation after its end, and so the task.
TASK_TTL_MS = 10 * 60_000
POLL_INTERVAL_MS = 1000
# tasks/result asks the ledger this often while the invocation runs (doubling up to POLL_INTERVAL_MS).
FIRST_POLL_S = 0.05
RELATED_TASK_META = "io.modelcontextprotocol/related-task"
# The tasks extension of 2026-07-28 (SEP-2663), as clients declare it and the server advertises it.
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
# How long a 2026-07-28 tools/call of a client with the extension waits for its outcome before it
# answers with a task instead.
TASK_AFTER_S = 1.0
# How long a call abandoned before it became a task waits for CancelInvocation.
CANCEL_TIMEOUT_S = 5.0

_STATUS = {
    InvocationState.RUNNING: "working",
    InvocationState.COMPLETED: "completed",
    InvocationState.TIMED_OUT: "failed",
    InvocationState.FAILED: "failed",
    InvocationState.CANCELLED: "cancelled",
}


def extensions() -> dict[str, dict[str, Any]]:
    """The extensions the gateway advertises: 2026-07-28 tasks (its settings are an empty object)."""
    return {TASKS_EXTENSION: {}}


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

    def __init__(self, gateway: Gateway, *, task_after_s: float = TASK_AFTER_S) -> None:
        self._gateway = gateway
        self.task_after_s = task_after_s
        # Calls started for tasks: they outlive the request that started them.
        self._running: set[asyncio.Task[CallResult]] = set()

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        params = ctx.params or {}
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return await self._modern(ctx, call_next)
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

    async def _modern(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        """2026-07-28: tools/call may become a task (the extension declared); tasks/get, update, cancel."""
        params = ctx.params or {}
        if ctx.method == "tools/call" and _declares_tasks(ctx):
            return await self._call_or_task(ctx, types.CallToolRequestParams.model_validate(params))
        if ctx.method not in ("tasks/get", "tasks/update", "tasks/cancel"):
            return await call_next(ctx)
        task_id = params.get("taskId")
        if not isinstance(task_id, str) or not task_id:
            raise MCPError(types.INVALID_PARAMS, "taskId must be a non-empty string.")
        session_id = self._gateway.enter(ctx)
        if ctx.method == "tasks/get":
            return _detailed_task(await self._invocation(session_id, task_id))
        if ctx.method == "tasks/update":
            if not isinstance(params.get("inputResponses", {}), dict):
                raise MCPError(types.INVALID_PARAMS, "inputResponses must be an object.")
            # No toolmesh tool asks for input: the task is known, the responses answer nothing.
            await self._invocation(session_id, task_id)
            return {}
        await self._cancel(session_id, task_id)
        return {}

    async def _call_or_task(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> HandlerResult:
        """The call's result if it ends within `task_after_s`; else a task, once the ledger has it.

        Until it is a task, the client closing its response stream (how 2026-07-28 cancels)
        cancels the invocation, unless another caller joined it (the service decides).
        """
        session_id = self._gateway.enter(ctx)
        await self._gateway.hold_connection(ctx, session_id)
        call, started = self._launch(session_id, params)
        either: set[asyncio.Future[Any]] = {started, call}
        try:
            await asyncio.wait({call}, timeout=self.task_after_s)
            if not call.done():
                # The invocation is named as soon as it runs; a call refused first ends instead.
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            with anyio.move_on_after(CANCEL_TIMEOUT_S, shield=True):
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if started.done() and not call.done():
                    await self._stop(started.result())
            call.cancel()
            raise
        if call.done():
            # Ended in time (or refused, or without an outcome): the ordinary answer.
            return call_tool_result(call.result())
        invocation = await self._invocation(session_id, started.result())
        return {"resultType": "task", **_task_v2(invocation)}

    def _launch(
        self, session_id: str, params: types.CallToolRequestParams
    ) -> tuple[asyncio.Task[CallResult], asyncio.Future[str]]:
        """The call, in a task of its own (it outlives the request), and its tool request id once named."""
        started: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def announce(tool_request_id: str) -> None:
            if not started.done():
                started.set_result(tool_request_id)

        call = asyncio.create_task(self._gateway.invoke(session_id, params, on_started=announce))
        self._running.add(call)
        call.add_done_callback(self._running.discard)
        return call, started

    async def _stop(self, tool_request_id: str) -> None:
        """CancelInvocation for a call abandoned before it became a task; a failure is logged."""
        try:
            await self._gateway.invocation.cancel_invocation(tool_request_id)
        except grpc.aio.AioRpcError as error:
            code = error_code(error)
            log.warning(
                "cancelling an invocation failed",
                extra={"tool_request_id": tool_request_id, "code": code.value if code else error.code().name},
            )

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
        call, started = self._launch(session_id, params)
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
        """CancelInvocation of a running task; a task already ended cannot be cancelled (INVALID_PARAMS)."""
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


def _task_v2(invocation: Invocation) -> dict[str, Any]:
    """A task as the 2026-07-28 extension says it: `ttlMs` and `pollIntervalMs`, no result."""
    created = invocation.created_at
    end = invocation.finished_at
    # The ledger keeps an invocation 10 minutes after its end: while it runs, at least that from now.
    lived = (end or datetime.now(UTC)) - created
    task: dict[str, Any] = {
        "taskId": invocation.tool_request_id,
        "status": _STATUS.get(invocation.state, "working"),
        "createdAt": created.isoformat(),
        "lastUpdatedAt": (end or created).isoformat(),
        "ttlMs": TASK_TTL_MS + max(0, int(lived.total_seconds() * 1000)),
        "pollIntervalMs": POLL_INTERVAL_MS,
    }
    failure = None if invocation.outcome is None else invocation.outcome.failure
    if failure is not None:
        task["statusMessage"] = failure.code
    return task


def _detailed_task(invocation: Invocation) -> dict[str, Any]:
    """tasks/get at 2026-07-28: the task, and once it has ended, its result inline.

    An outcome (a result, or an error of the tool: isError) is `completed` with
    the CallToolResult as `result`, so the model reads the error as any other;
    a cancelled invocation is `cancelled`, without a result.
    """
    task = _task_v2(invocation)
    outcome = invocation.outcome
    if invocation.state is InvocationState.RUNNING or outcome is None:
        task["status"] = "working"
        return task
    if invocation.state is InvocationState.CANCELLED:
        task["status"] = "cancelled"
        return task
    task["status"] = "completed"
    result = call_tool_result(CallResult(invocation.tool_request_id, outcome))
    task["result"] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    return task


def _declares_tasks(ctx: ServerRequestContext[Any, Any]) -> bool:
    """Whether the request's client declared the tasks extension (its per-request capabilities)."""
    capabilities = ctx.session.client_capabilities
    declared = None if capabilities is None else capabilities.extensions
    return declared is not None and TASKS_EXTENSION in declared


def _unknown_task() -> MCPError:
    return MCPError(types.INVALID_PARAMS, "Unknown task: no such task in this session, or it has expired.")
