"""The invocation service's caller RPCs over Connect and gRPC-Web, for pages (toolmesh.runtime.web).

InvokeTool, RunTool (server-streaming), GetInvocation, ConfirmDelivery and CancelInvocation:
each admitted by the same policy as on the gRPC port (role call, its sessions), then handed to
the gRPC servicer's own method. InvokeTools (bidirectional) is not served: a browser cannot
stream requests; RunTool is the page's call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from connectrpc.request import RequestContext

from toolmesh.auth.guard import Listener, admission
from toolmesh.auth.tokens import Verifier
from toolmesh.core.limits import MAX_MESSAGE_BYTES
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.servicer import InvocationServicer
from toolmesh.runtime.web import admit, connect_app, fail
from toolmesh.v1 import invocation_pb2
from toolmesh.v1.invocation_connect import InvocationService, InvocationServiceASGIApplication

CALLER_FACING: Sequence[str] = (
    "InvokeTool",
    "RunTool",
    "GetInvocation",
    "ConfirmDelivery",
    "CancelInvocation",
)
CALLER_FACING_PATHS = frozenset(f"/toolmesh.v1.InvocationService/{name}" for name in CALLER_FACING)


class _NoEarlyId:
    """The servicer's context on a web port: no early initial metadata (the outcome carries the id;
    RunTool's first event is the id)."""

    def time_remaining(self) -> float | None:
        return None

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        return None


class WebInvocation(InvocationService):
    """The caller-facing InvocationService methods for connectrpc, on the gRPC servicer's own.

    InvokeTools keeps its generated body (UNIMPLEMENTED); `guarded` never lets a request reach it.
    """

    def __init__(self, invoker: Invoker, verifier: Verifier | None) -> None:
        self._servicer = InvocationServicer(invoker)
        self._context: Any = _NoEarlyId()
        self._admit = {
            name: admission(f"toolmesh.v1.InvocationService/{name}", Listener.PUBLIC, verifier)
            for name in CALLER_FACING
        }

    async def invoke_tool(
        self, request: invocation_pb2.InvokeToolRequest, ctx: RequestContext[Any, Any]
    ) -> invocation_pb2.InvokeToolResponse:
        try:
            await admit(self._admit["InvokeTool"], request, ctx)
            return await self._servicer.InvokeTool(request, self._context)
        except Exception as exc:
            fail("InvokeTool", exc)

    async def run_tool(
        self, request: invocation_pb2.RunToolRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[invocation_pb2.RunToolResponse]:
        try:
            await admit(self._admit["RunTool"], request, ctx)
            async for event in self._servicer.RunTool(request, self._context):
                yield event
        except Exception as exc:
            fail("RunTool", exc)

    async def get_invocation(
        self, request: invocation_pb2.GetInvocationRequest, ctx: RequestContext[Any, Any]
    ) -> invocation_pb2.GetInvocationResponse:
        try:
            await admit(self._admit["GetInvocation"], request, ctx)
            return await self._servicer.GetInvocation(request, self._context)
        except Exception as exc:
            fail("GetInvocation", exc)

    async def confirm_delivery(
        self, request: invocation_pb2.ConfirmDeliveryRequest, ctx: RequestContext[Any, Any]
    ) -> invocation_pb2.ConfirmDeliveryResponse:
        try:
            await admit(self._admit["ConfirmDelivery"], request, ctx)
            return await self._servicer.ConfirmDelivery(request, self._context)
        except Exception as exc:
            fail("ConfirmDelivery", exc)

    async def cancel_invocation(
        self, request: invocation_pb2.CancelInvocationRequest, ctx: RequestContext[Any, Any]
    ) -> invocation_pb2.CancelInvocationResponse:
        try:
            await admit(self._admit["CancelInvocation"], request, ctx)
            return await self._servicer.CancelInvocation(request, self._context)
        except Exception as exc:
            fail("CancelInvocation", exc)


def web_connect(
    invoker: Invoker, verifier: Verifier | None = None, *, read_max_bytes: int = MAX_MESSAGE_BYTES
) -> InvocationServiceASGIApplication:
    """The caller-facing routes, unguarded (`guarded` with CALLER_FACING_PATHS makes them a port)."""
    return connect_app(InvocationServiceASGIApplication, WebInvocation(invoker, verifier), read_max_bytes)
